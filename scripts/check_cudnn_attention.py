"""On a GPU: `soapjax.base.attention.flash_attention(..., implementation="cudnn")` runs cuDNN's
fused kernel, its bfloat16 loss and gradients match the blockwise attention's, and how much faster
it is. Prints one JSON line; exit status 1 where the numbers differ (2 without a GPU).

    PYTHONPATH=. python3 scripts/check_cudnn_attention.py            # ~30 s on an H100
    PYTHONPATH=. python3 scripts/check_cudnn_attention.py --shape 2 4096 32 8 128

The loss is ``<attention(q, k, v), g>`` in float32 for random ``q, k, v, g``; the gradients
are compared by the norm of their difference relative to the blockwise attention's
(tolerance 2e-2: bfloat16 inputs, two kernels' own rounding).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from soapjax.base.attention import flash_attention  # noqa: E402

TOLERANCE = 2e-2


def timed(fn, args, calls: int = 10) -> float:
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    for _ in range(calls):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / calls


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", type=int, nargs=5, default=(2, 2048, 16, 4, 128),
                   metavar=("B", "T", "N", "K", "H"),
                   help="batch, tokens, query heads, key/value heads, head dim "
                        "(default 2 2048 16 4 128)")
    args = p.parse_args(argv)
    if jax.default_backend() != "gpu":
        print(json.dumps({"backend": jax.default_backend(), "checked": False,
                          "why": "no GPU: cuDNN's kernel does not run here"}))
        return 2
    b, t, n, kv, h = args.shape
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (b, t, n, h), jnp.bfloat16)
    k = jax.random.normal(keys[1], (b, t, kv, h), jnp.bfloat16)
    v = jax.random.normal(keys[2], (b, t, kv, h), jnp.bfloat16)
    g = jax.random.normal(keys[3], (b, t, n, h), jnp.float32)

    def step(impl):
        def loss(q, k, v):
            return jnp.vdot(flash_attention(q, k, v, implementation=impl).astype(jnp.float32), g)
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))

    print(f"compiling and comparing at {b} x {t} x {n} ({kv} kv) x {h}...", file=sys.stderr,
          flush=True)
    cudnn, xla = step("cudnn"), step("xla")
    hlo = cudnn.lower(q, k, v).compile().as_text()
    (lc, gc), (lx, gx) = cudnn(q, k, v), xla(q, k, v)
    errors = [float(jnp.linalg.norm((a - c).astype(jnp.float32))
                    / jnp.linalg.norm(c.astype(jnp.float32))) for a, c in zip(gc, gx)]
    loss_error = abs(float(lc) - float(lx)) / abs(float(lx))
    print("timing both...", file=sys.stderr, flush=True)
    found = {"backend": "gpu", "device": jax.devices()[0].device_kind, "jax": jax.__version__,
             "shape": [b, t, n, kv, h], "cudnn_in_hlo": "cudnn" in hlo.lower(),
             "loss_error": loss_error, "grad_errors": {"q": errors[0], "k": errors[1],
                                                       "v": errors[2]},
             "cudnn_s": timed(cudnn, (q, k, v)), "xla_s": timed(xla, (q, k, v))}
    found["speedup"] = found["xla_s"] / found["cudnn_s"]
    found["checked"] = (found["cudnn_in_hlo"] and loss_error <= TOLERANCE
                        and max(errors) <= TOLERANCE)
    print(json.dumps(found))
    return 0 if found["checked"] else 1


if __name__ == "__main__":
    sys.exit(main())
