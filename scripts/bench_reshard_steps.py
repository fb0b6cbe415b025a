"""Layout changes made in one go against the same changes made in permute-free steps.

For random layout changes of 2- to 4-dim tensors on 8 CPU devices (meshes ``2 x 2 x 2`` and
``2 x 4``), compiles each change as one sharding constraint and, where
`soapjax.cost.reshard_steps.steps` finds a chain, as the chain's constraints one after another,
and reads XLA's collectives from the compiled HLO; sets their bytes beside the ideal model's
(`soapjax.cost.reshard.ideal_collectives`). Prints how many changes XLA makes as the ideal
model prices them, in one go and in steps, and the bytes each way.

    python scripts/bench_reshard_steps.py                 # 200 changes per mesh, seed 0
    python scripts/bench_reshard_steps.py --count 50 --seed 3
"""

from __future__ import annotations

import argparse
import os
import sys
import time

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

from soapjax.cost.reshard import ideal_collectives, permute_free  # noqa: E402
from soapjax.cost.reshard_steps import steps  # noqa: E402
from soapjax.measure import hlo  # noqa: E402
from soapjax.strategy.space import MeshShape  # noqa: E402

MESHES = {"2x2x2": (("node", "data", "model"), (2, 2, 2)), "2x4": (("data", "model"), (2, 4))}


def random_layout(rng, rank: int, names: tuple[str, ...]) -> tuple[tuple[str, ...], ...]:
    """Each axis in a random dim or none, in a random order within its dim."""
    out = [[] for _ in range(rank)]
    for a in rng.permutation(names):
        d = int(rng.integers(-1, rank))
        if d >= 0:
            out[d].append(str(a))
    return tuple(tuple(x) for x in out)


def compiled(mesh: Mesh, shape, layouts) -> list:
    """XLA's collectives for a value held to each of `layouts` in turn (the first its input's)."""
    def spec(layout):
        return PartitionSpec(*(axes or None for axes in layout))

    def f(x):
        for layout in layouts[1:]:
            x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec(layout)))
        return x
    x = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, spec(layouts[0])))
    text = jax.jit(f).lower(x).compile().as_text()
    return hlo.collectives(text, MeshShape(mesh.axis_names, tuple(mesh.devices.shape)))


def nbytes(collectives) -> float:
    return float(sum(c.nbytes for c in collectives))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--count", type=int, default=200, help="layout changes per mesh")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    t0 = time.perf_counter()
    print("| mesh | changes | permute-free | XLA as ideal, in one go | chain found | XLA as "
          "ideal, in steps | chain's ideal / one go's ideal | XLA bytes: in one go | in steps | "
          "in steps, fewer / more bytes |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for label, (names, sizes) in MESHES.items():
        mesh = Mesh(np.array(jax.devices()[:8]).reshape(sizes), names)
        shape_of = MeshShape(names, sizes)
        counts = dict(changes=0, free=0, direct_ok=0, chained=0, chain_ok=0, fewer=0, more=0)
        ideal_ratio, xla_direct, xla_steps = [], 0.0, 0.0
        while counts["changes"] < args.count:
            rank = int(rng.integers(2, 5))
            shape = tuple(int(rng.choice([8, 16, 32])) for _ in range(rank))
            src, dst = (random_layout(rng, rank, names) for _ in range(2))
            if src == dst:
                continue
            counts["changes"] += 1
            ideal = nbytes(ideal_collectives(shape, "float32", src, dst, shape_of))
            direct = nbytes(compiled(mesh, shape, [src, dst]))
            counts["free"] += permute_free(src, dst, shape_of)
            counts["direct_ok"] += abs(direct - ideal) <= 0.01 * max(ideal, 1)
            chain = steps(shape, "float32", src, dst, shape_of)
            if chain is None:
                xla_direct += direct
                xla_steps += direct
                continue
            counts["chained"] += 1
            layouts = [src, *chain, dst]
            stepped = nbytes(compiled(mesh, shape, layouts))
            chain_ideal = sum(nbytes(ideal_collectives(shape, "float32", a, b, shape_of))
                              for a, b in zip(layouts, layouts[1:]))
            counts["chain_ok"] += abs(stepped - chain_ideal) <= 0.01 * max(chain_ideal, 1)
            if chain:
                counts["fewer"] += stepped < direct * 0.99
                counts["more"] += stepped > direct * 1.01
            ideal_ratio.append(chain_ideal / ideal if ideal else 1.0)
            xla_direct += direct
            xla_steps += stepped
        print(f"| {label} | {counts['changes']} | {counts['free']} | {counts['direct_ok']} | "
              f"{counts['chained']} | {counts['chain_ok']} | "
              f"{np.mean(ideal_ratio):.3f} (max {np.max(ideal_ratio):.2f}) | "
              f"{xla_direct:,.0f} | {xla_steps:,.0f} | {counts['fewer']} / {counts['more']} |",
              flush=True)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
