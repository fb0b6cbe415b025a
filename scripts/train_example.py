#!/usr/bin/env python
"""Trains a zoo model sharded over a mesh with `soapjax.training`, printing loss and step time.

One process (8 virtual CPU devices, the ``cpu8`` topology)::

    python scripts/train_example.py --model gpt2 --steps 5
    python scripts/train_example.py --model mlp --strategy megatron

Two processes of four CPU devices each, one global mesh (jax.distributed, gloo)::

    python scripts/launch_local.py --processes 2 --devices-per-process 4 -- \\
        scripts/train_example.py --model mlp --strategy megatron

With ``--json`` the last line is a JSON record (losses, and a checksum of the updated
parameters: the sum and the sum of squares of every leaf), used by the multi-host test.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="mlp", help="a zoo model (default: %(default)s)")
    p.add_argument("--size", "--config", dest="size", default="tiny",
                   help="zoo model size, as `soapjax --size` (default: %(default)s); --config is "
                   "a deprecated alias")
    p.add_argument("--api", default="linen", choices=("linen", "nnx"))
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--mesh", "--topology", dest="mesh", default="cpu8",
                   help="topology name or .toml path, as `soapjax --mesh` (default: %(default)s); "
                   "--topology is a deprecated alias")
    p.add_argument("--strategy", default="data-parallel",
                   choices=("plan", "data-parallel", "megatron", "fsdp", "expert-cnn",
                            "expert-rnn"),
                   help="a name in soapjax.training.PLANNERS: plan (search, or reuse the cached "
                   "plan), or a baseline; megatron: tensor parallel over 'model', data parallel "
                   "over 'data' (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="end with one JSON line of results")
    p.add_argument("--collectives", action="store_true",
                   help="count the collectives in the compiled step (compiles it once more)")
    return p.parse_args(argv)


def describe_collectives(hlo_text: str, mesh) -> list[dict]:
    """Each collective of a compiled step: kind, shapes, mesh axes, and whether it crosses
    processes (some group has devices of two processes), read with `soapjax.measure.hlo`."""
    from soapjax.measure import hlo

    process = [d.process_index for d in mesh.devices.flat]  # HLO device id = mesh position
    out = []
    for c in hlo.collectives(hlo_text, mesh):
        groups = c.replica_groups or tuple(map(tuple, c.source_target_pairs))
        out.append({"kind": c.kind, "shapes": list(c.shapes), "axes": list(c.axes or ()),
                    "cross_process": any(len({process[i] for i in g}) > 1 for g in groups)})
    return out


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.mesh.startswith("cpu"):  # virtual CPU devices; set before jax is imported
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
            os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                       + " --xla_force_host_platform_device_count=8").strip()
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

    from soapjax import training

    distributed = training.initialize_distributed()

    import jax
    import jax.numpy as jnp

    import soapjax_zoo as zoo

    w = zoo.get(args.model, args.size, api=args.api)
    params = w.init_params(jax.random.key(args.seed))
    batches = [w.make_batch(jax.random.key(args.seed + 1 + i)) for i in range(args.steps)]
    run = training.shard_training(w.loss_fn, params, batches[0], w.optimizer,
                                  mesh=args.mesh, strategy=args.strategy, name=args.model)
    print(f"{args.model} ({args.size}, {args.api}) on {dict(run.mesh.shape)}: "
          f"{len(run.graph.operators)} operators, strategy {args.strategy}, "
          f"{jax.process_count()} process(es), {jax.device_count()} devices"
          + (" (jax.distributed)" if distributed else ""), flush=True)

    params, opt_state = run.params, run.opt_state
    record = {"model": args.model, "strategy": args.strategy}
    if args.collectives:
        hlo = run.step.lower(params, opt_state, run.shard_batch(batches[0])).compile().as_text()
        record["collectives"] = describe_collectives(hlo, run.mesh)
        record["mesh_processes"] = [[d.process_index for d in row] for row in run.mesh.devices]
        print(f"mesh rows by process: {record['mesh_processes']}", flush=True)
        for c in record["collectives"]:
            print(f"  {c['kind']} {' '.join(c['shapes'])} over {c['axes']}"
                  + (" (across processes)" if c["cross_process"] else ""), flush=True)
    losses = []
    for i, batch in enumerate(batches):
        start = time.perf_counter()
        params, opt_state, loss = run.step(params, opt_state, run.shard_batch(batch))
        loss = float(loss)  # replicated: readable on every process
        elapsed = time.perf_counter() - start
        losses.append(loss)
        note = "  (includes compilation)" if i == 0 else ""
        print(f"step {i + 1:3d}  loss {loss:.6f}  time {elapsed * 1e3:8.1f} ms{note}", flush=True)

    replicated = run.shardings.loss
    checksum = jax.jit(lambda p: jnp.stack([f(x.astype(jnp.float32)) for x in jax.tree.leaves(p)
                                            for f in (jnp.sum, lambda y: jnp.sum(y * y))]),
                       out_shardings=replicated)(params)
    if args.json:
        record.update(losses=losses, checksum=[float(x) for x in jax.device_get(checksum)],
                      processes=jax.process_count(), devices=jax.device_count())
        print(json.dumps(record), flush=True)
    if distributed:
        jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
