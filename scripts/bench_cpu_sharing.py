"""Why cpu8 steps take twice what the simulator says: kernels and collectives of 8 virtual
devices sharing a 2-core host, timed in the settings a training step puts them in.

Three probes, each with soapjax's loop harness (`soapjax.measure.time_loop`: many repetitions
in one compiled program, dispatch amortised; the minimum over trials):

* **kernels**: an elementwise kernel (``tanh``, 1 or 4 of them fused) and a matmul, timed on
  one device alone, on all 8 at once, and on all 8 with a 1 KB all-reduce after each kernel
  (what a step does). The ratio to "alone" is what the simulator's ``[compute]`` stretch
  (one number, ``devices / concurrent_devices``) stands for.
* **collectives**: an all-reduce over the whole mesh, K in a chain (what
  ``soapjax calibrate --links`` times, K = 1) against one all-reduce of a K-operand tuple (what
  XLA makes of a step's gradient all-reduces: its all-reduce combiner).
* **repeat**: the same chain timed several times, to show the spread between runs.
* **links**: `soapjax calibrate --links`'s measurements taken twice over cpu8 (every kind,
  axis set and size, fitted and held back): how far one sweep's times are from the other's at
  the same sizes, against how far the fit of one sweep is from its held-back sizes and from
  the other sweep's. If a size measured twice disagrees as much as the fit does with it, the
  fit is as good as the measurement allows.

    python scripts/bench_cpu_sharing.py             # ~5 minutes on 2 cores; run it quiet
    python scripts/bench_cpu_sharing.py --only links

Figures of 2026-11-25 are in docs/accuracy.md.
"""

from __future__ import annotations

import argparse
import os
import sys

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import (  # noqa: E402
    Mesh,
    NamedSharding,
    PartitionSpec as P,
)

from soapjax.cost.operators import TimingOptions  # noqa: E402
from soapjax.measure import kick, time_loop  # noqa: E402

OPTIONS = TimingOptions(target_trial_s=0.02, trials=3)
AXES = ("data", "model")
SPEC = P(AXES)


def _mesh() -> Mesh:
    devices = jax.devices()
    if len(devices) < 8:
        raise SystemExit(f"expected 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count"
                         f"=8), found {len(devices)}")
    return Mesh(np.array(devices[:8]).reshape(2, 4), AXES)


def _spmd(mesh: Mesh, body, *locals_: np.ndarray) -> float:
    """Seconds of one repetition of `body` run by every device on its own copy of the arrays."""
    fn = jax.shard_map(body, mesh=mesh, in_specs=(SPEC,) * len(locals_),
                       out_specs=(SPEC,) * len(locals_), check_vma=False)
    sharding = NamedSharding(mesh, SPEC)
    carry = tuple(jax.device_put(np.concatenate([a] * mesh.size), sharding) for a in locals_)
    return time_loop(lambda c: fn(*c), carry, OPTIONS).seconds


def _alone(body, *arrays: np.ndarray) -> float:
    device = jax.devices()[0]
    return time_loop(lambda c: body(*c), tuple(jax.device_put(a, device) for a in arrays),
                     OPTIONS).seconds


def kernels(mesh: Mesh, K: int = 10) -> None:
    print("kernel                    alone us   8 at once     + 1 KB all-reduce after each")

    def probe(label, kernel, shape):
        x = np.random.default_rng(0).uniform(-1, 1, shape).astype(np.float32) / shape[-1]
        out = np.asarray(jax.jit(kernel)(x))

        def plain(a, o):
            for _ in range(K):
                o = kernel(a)
                a = kick(a, o.ravel()[0])
            return a, o

        def with_coll(a, o):
            for _ in range(K):
                o = kernel(a)
                s = lax.psum(o.ravel()[:256], AXES)
                a = kick(a, s[0])
            return a, o

        def coll_only(a, o):
            for _ in range(K):
                s = lax.psum(a.ravel()[:256], AXES)
                a = kick(a, s[0])
            return a, o

        alone = _alone(plain, x, out) / K
        together = _spmd(mesh, plain, x, out) / K
        inter = (_spmd(mesh, with_coll, x, out) - _spmd(mesh, coll_only, x, out)) / K
        print(f"{label:<24}{alone * 1e6:9.1f}{together * 1e6:10.1f} ({together / alone:4.1f}x)"
              f"{inter * 1e6:12.1f} ({inter / alone:5.1f}x)", flush=True)

    for n in (1024, 16384, 262144):
        probe(f"tanh f32[{n}]", lambda a: jnp.tanh(a) * 0.5, (n,))
        probe(f"4 x tanh f32[{n}]", lambda a: jnp.tanh(jnp.tanh(jnp.tanh(jnp.tanh(a)))), (n,))
    for k in (32, 128, 512):
        probe(f"matmul {k}x{k}", lambda a: a @ a, (k, k))


def collectives(mesh: Mesh) -> None:
    print("\nall-reduce over data x model   chain us/collective   tuple us/operand")
    for elems in (256, 16384, 262144):
        for K in (1, 10, 38):
            def chain(x, y):
                for _ in range(K):
                    y = lax.psum(y, AXES)
                return kick(x, y[0]), y

            def tupled(x, y):
                ys = lax.psum([x * (i + 1) for i in range(K)], AXES)
                y = sum(ys)
                return kick(x, y[0]), y

            x = np.full(elems, 0.01, np.float32)
            a, b = _spmd(mesh, chain, x, x) / K, _spmd(mesh, tupled, x, x) / K
            print(f"{elems * 4:>9} B  K={K:<3}{a * 1e6:18.1f}{b * 1e6:20.1f}", flush=True)


def repeat(mesh: Mesh, times: int = 5) -> None:
    def chain(x, y):
        for _ in range(10):
            y = lax.psum(y, AXES)
        return kick(x, y[0]), y

    x = np.full(16384, 0.01, np.float32)
    runs = [_spmd(mesh, chain, x, x) / 10 * 1e6 for _ in range(times)]
    print(f"\n64 KB all-reduce, {times} runs (us): " + " ".join(f"{r:.0f}" for r in runs)
          + f"   max/min {max(runs) / min(runs):.2f}")


def link_sweeps(_: Mesh, sweeps: int = 2) -> None:
    """On cpu8's mesh as `make_mesh` builds it, the one calibrate measures on (not the probes'
    mesh)."""
    from soapjax.measure import links
    from soapjax.topology.cluster import load_topology, make_mesh

    topo = load_topology("cpu8")
    mesh = make_mesh(topo)
    keys = [(axes, kind) for axes in links.axis_sets(topo) for kind in links.MEASURED_KINDS]
    runs = []
    for s in range(sweeps):
        runs.append({k: ([links.Sample(n, links.time_collective(mesh, k[1], k[0], n))
                          for n in links.FIT_SIZES],
                         [links.Sample(n, links.time_collective(mesh, k[1], k[0], n))
                          for n in links.HELD_SIZES]) for k in keys})
        print(f"links: sweep {s + 1} of {sweeps} measured", file=sys.stderr, flush=True)
    first, second = runs[0], runs[-1]

    def line(label, errors):
        e = np.abs(np.array(errors))
        print(f"  {label:<44} max {e.max():5.0%}  mean {e.mean():4.0%}  "
              f"within 20% {np.mean(e <= 0.2):4.0%}  ({len(e)} sizes)")

    print(f"\ncalibrate --links on cpu8, {len(keys)} collectives, {sweeps} sweeps:")
    line("held-back sizes, sweep 2 / sweep 1 - 1",
         [b.seconds / a.seconds - 1 for k in keys for a, b in zip(first[k][1], second[k][1])])
    line("fitted sizes, sweep 2 / sweep 1 - 1",
         [b.seconds / a.seconds - 1 for k in keys for a, b in zip(first[k][0], second[k][0])])
    line("fit of sweep 1 on its held-back sizes",
         [e for k in keys for _, e in links.fit_samples(k[1], k[0], *first[k]).held_out])
    line("fit of sweep 1 on sweep 2's held-back sizes",
         [e for k in keys for _, e in links.fit_samples(
             k[1], k[0], first[k][0], second[k][1]).held_out])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", choices=("kernels", "collectives", "repeat", "links"),
                    help="run one probe (default: all four)")
    args = ap.parse_args(argv)
    mesh = _mesh()
    for name, probe in (("kernels", kernels), ("collectives", collectives),
                        ("repeat", repeat), ("links", link_sweeps)):
        if args.only in (None, name):
            probe(mesh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
