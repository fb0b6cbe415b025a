"""What the cost stage's measured times should order, measured: the timing facts `make test`
no longer asserts (a loaded 2-core host reorders them now and then; a benchmark reports them).

    python scripts/bench_timing_order.py              # about a minute on 2 cores

1. A matmul's measured forward and backward grow with its FLOPs (n = 64 .. 512, 8x FLOPs a
   step), and the largest one's backward (two matmuls of the forward's size) is about twice
   its forward.
2. A batch split over ``data`` (2 devices of ``cpu8``) makes the shard's forward about half
   the whole operator's.

Each figure is the cost stage's own measurement (`soapjax.cost.operators`, measured costs on the
local CPU, a fresh cache), printed with the ratio the test suite used to hold it to; the load
average is printed too, since other processes on the host only ever make times slower.
"""

from __future__ import annotations

import os
import sys
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from soapjax.cost.operators import TimingOptions, cost_model  # noqa: E402
from soapjax.graph.opgraph import trace  # noqa: E402
from soapjax.strategy.space import Config  # noqa: E402
from soapjax.topology.cluster import load_topology  # noqa: E402


class _Dense(nn.Module):
    width: int

    @nn.compact
    def __call__(self, x):
        return nn.Dense(self.width, name="b")(x)


def _graph(batch: int, width: int):
    m = _Dense(width)
    x = jax.ShapeDtypeStruct((batch, width), jnp.float32)
    params = jax.eval_shape(m.init, jax.random.key(0), x)
    return trace(lambda p, b: jnp.mean(m.apply(p, b["x"]) ** 2), params, {"x": x},
                 name=f"dense{batch}x{width}")


def main() -> int:
    topo = load_topology("cpu8")
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    with tempfile.TemporaryDirectory() as cache:
        options = TimingOptions(target_trial_s=0.025, trials=7)
        times = []
        for n in (64, 128, 256, 512):
            g = _graph(n, n)
            i = g.index("b")
            t = cost_model(g, topo, mode="measured", cache_dir=cache,
                           options=options).op_time(i, Config.replicated(g.operators[i]))
            times.append(t)
            ratio = t.backward_s / t.forward_s
            print(f"matmul {n:>3}: forward {t.forward_s * 1e3:8.3f} ms, backward "
                  f"{t.backward_s * 1e3:8.3f} ms, backward / forward {ratio:.2f}")
        grows = all(b.forward_s > a.forward_s and b.backward_s > a.backward_s
                    for a, b in zip(times, times[1:]))
        print(f"grows with its FLOPs: {grows}; largest backward / forward "
              f"{times[-1].backward_s / times[-1].forward_s:.2f} (about 2 expected)")
        g = _graph(512, 1024)
        i = g.index("b")
        costs = cost_model(g, topo, mode="measured", cache_dir=cache, options=options)
        whole = costs.op_time(i, Config.replicated(g.operators[i]))
        half = costs.op_time(i, Config((("data",), (), ())))
        ratio = half.forward_s / whole.forward_s
        print(f"batch split over data=2: shard forward / whole {ratio:.2f} (about 0.5 "
              "expected; the suite held it under 0.8)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
