"""Calibration of the cost model on the local backend: measured step vs the sum of its parts.

For each zoo model, on ONE local device, this measures the whole unsharded training step (one
jitted program repeated inside a loop) and the cost model's prediction of it: the sum of the
operators' measured forward and backward times and of the optimizer updates of every
parameter. The error is what the simulator gets wrong before any parallelism: XLA fuses
across operator boundaries in the whole step (so the sum over-counts small operators), and
the parts are measured in isolation (cold caches, no overlap).

Run::

    python scripts/bench_costs.py                        # every model, tiny configs
    python scripts/bench_costs.py --config default --models mlp lenet
    python scripts/bench_costs.py --cache-dir ~/.cache/soapjax/costs   # reuse measurements

By default the operator times are measured afresh in this process (a temporary cache), so the
step and its parts share one process: timings drift ~30% between processes on CPU.

Honest about CPU: a 2-core host that other processes share adds noise that only ever makes
things slower; every figure is a minimum over trials, and the load average is printed.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

import soapjax_zoo as zoo  # noqa: E402
from soapjax.cost import operators as cost  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="tiny", help="model config (default: %(default)s)")
    p.add_argument("--models", nargs="*", default=None, help="default: the whole zoo")
    p.add_argument("--cache-dir", default=None, help="reuse this cost cache (default: a fresh "
                   "temporary one, so everything is measured in this process)")
    p.add_argument("--markdown", action="store_true", help="print a markdown table")
    args = p.parse_args(argv)

    names = args.models or list(zoo.names())
    dev = jax.devices()[0]
    print(f"# local backend: {dev.platform} ({dev.device_kind}), {os.cpu_count()} cores, "
          f"jax {jax.__version__}; load average at start {_load()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="soapjax-bench-") as tmp:
        cache_dir = args.cache_dir or tmp
        rows = []
        header = ("model", "config", "ops", "step ms", "spread", "sum ms", "fwd ms", "bwd ms",
                  "update ms", "error", "bench s")
        _row(header, args.markdown)
        if args.markdown:
            print("|" + "|".join("---" for _ in header) + "|")
        for name in names:
            t0 = time.perf_counter()
            try:
                c = cost.calibrate(zoo.get(name, args.config), cache_dir=cache_dir)
            except Exception as e:  # noqa: BLE001  one model failing must not hide the others
                print(f"{name}: failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
                continue
            rows.append(c)
            _row((c.model, c.config, str(c.num_operators), f"{c.step_s * 1e3:.3f}",
                  f"{c.step_spread:.0%}", f"{c.predicted_s * 1e3:.3f}", f"{c.forward_s * 1e3:.3f}",
                  f"{c.backward_s * 1e3:.3f}", f"{c.update_s * 1e3:.3f}", f"{c.error:+.0%}",
                  f"{time.perf_counter() - t0:.0f}"), args.markdown)
            other = {k: v for k, v in c.sources.items() if k != "measured"}
            if other:
                print(f"  ({name}: operators not measured: {other})", flush=True)
    print(f"# load average at end {_load()}")
    return 0


def _row(cells, markdown: bool) -> None:
    if markdown:
        print("| " + " | ".join(cells) + " |", flush=True)
    else:
        widths = (14, 8, 5, 10, 8, 10, 9, 9, 10, 8, 8)
        print("".join(c.ljust(w) if i < 2 else c.rjust(w)
                      for i, (c, w) in enumerate(zip(cells, widths))), flush=True)


def _load() -> str:
    try:
        return " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


if __name__ == "__main__":
    sys.exit(main())
