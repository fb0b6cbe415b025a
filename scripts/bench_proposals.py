"""Benchmark: the search's proposal rate on pipelined strategies at scale, and its set-up.

For GPT models of Megatron-LM's sizes on A100s (analytic costs; nothing is attached), times
what a search of a pipelined strategy pays: Megatron's pipeline grids (`pipeline_grid`: every
stage count, virtual stages and microbatch size the search scores), every operator's configs
(`space.configs`), and proposals on one Megatron point (TP8, pipelined, selective
recomputation, sequence parallelism, microbatches of 1): random configs proposed, priced (step
time and whether it fits) and rejected, each for the operator at one position of every layer
at once, as a chain proposes (`--single`: for one operator of one layer), on the stage
simulated on a few of its layers as the search's pipelines are (`--whole`: every layer).
Every proposal is made once untimed first (what it prices for the first time, its kernels
and layouts, is memoised, as in a search that has run a while; the schedule's kept timelines
are dropped after), then timed; the garbage collector is set as the search sets it. Issue 46's
goal is 10x the proposals per second of the 2026-11-28 code for GPT 175B, 530B and 1T.

Time ratios are machine-dependent: compare two revisions in one run on one machine
(run this script at each revision back to back).

    python scripts/bench_proposals.py                         # GPT 175B on 64 A100s
    python scripts/bench_proposals.py --size 530b --gpus 280 --stages 35 --virtual 3 \
        --batch-size 280
"""

from __future__ import annotations

import argparse
import random
import sys
import time

import soapjax_zoo as zoo
from soapjax.cost import operators as cost
from soapjax.graph.opgraph import trace
from soapjax.search import sparse_gc
from soapjax.search.pipelines import pipeline_grid
from soapjax.simulate import front
from soapjax.strategy import pipeline, space
from soapjax.strategy.baselines import megatron_3d
from soapjax.strategy.memory import microbatch_error
from soapjax.strategy.space import MeshShape
from soapjax.topology.cluster import load_topology, stage_topology


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="175b", help="GPT size (default: %(default)s)")
    ap.add_argument("--gpus", type=int, default=64, help="A100s, whole DGX nodes (default: 64)")
    ap.add_argument("--batch-size", type=int, default=64, help="global batch (default: 64)")
    ap.add_argument("--stages", type=int, default=8, help="pipeline stages (default: 8)")
    ap.add_argument("--virtual", type=int, default=12,
                    help="virtual stages per device (default: 12)")
    ap.add_argument("--proposals", type=int, default=60, help="proposals timed (default: 60)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--whole", action="store_true",
                    help="simulate the stage's every layer (default: on a few of its layers, "
                         "as the search does: soapjax.simulate._pipe_fold; --single is whole: "
                         "a fold needs the layers tied)")
    ap.add_argument("--single", action="store_true",
                    help="propose one operator of one layer at a time (default: an operator "
                         "at the same position of every layer at once, as a chain proposes)")
    args = ap.parse_args(argv)

    t = time.perf_counter()
    w = zoo.load("gpt", args.size, batch_size=args.batch_size)
    g = trace(w.loss_fn, w.abstract_params(), w.abstract_batch(), name=w.name)
    print(f"GPT {args.size}: {len(g.operators)} operators, traced in "
          f"{time.perf_counter() - t:.1f} s", flush=True)
    topo = load_topology(f"dgx-a100x3072-{args.gpus}")

    t = time.perf_counter()
    points = sum(len(p) for p in pipeline_grid(g, topo, args.stages).values())
    print(f"pipeline grid at {args.stages} stages: {points} points in "
          f"{time.perf_counter() - t:.2f} s", flush=True)
    stage_mesh = MeshShape.of(stage_topology(topo, args.stages))
    t = time.perf_counter()
    choices = [space.configs(op, stage_mesh) for op in g.operators]
    print(f"every operator's configs: {time.perf_counter() - t:.2f} s", flush=True)

    strategy = megatron_3d(g, topo, tp=8, pp=args.stages, microbatch_size=1,
                           interleave=args.virtual, recompute="selective",
                           sequence_parallel=True)
    m = strategy.microbatches
    choices = [[c for c in cs if not microbatch_error(op, c, stage_mesh, m)]
               for op, cs in zip(g.operators, choices)]
    costs = cost.cost_model(g, topo, mode="analytic", optimizer=w.optimizer)
    rng = random.Random(args.seed)
    # a chain moves the operators at one position of every layer together (`_Searcher.tied`)
    tied = {} if args.single else {i: blk for blk in g.repeated_blocks() for i in blk}
    proposals = []
    for _ in range(args.proposals):
        i = rng.randrange(len(g.operators))
        config = rng.choice(choices[i])
        proposals.append([(j, config, None) for j in tied.get(i, [i])])
    # the garbage collector as the search sets it
    with sparse_gc(), front.open_simulation(g, topo, strategy, cost_model=costs,
                                            fold=not (args.whole or args.single)) as sim:
        start = sim.step_time()
        # every proposal once untimed: what it prices for the first time (its operators'
        # kernels, shard layouts) is memoised, as in a search that has run a while; the
        # schedule's kept timelines are then dropped, so that each is timed again
        for changes in proposals:
            sim.propose_many(changes)
            sim.step_time()
            sim.fits_in_memory()
            sim.reject()
        pipeline.forget_timelines()
        t = time.perf_counter()
        for changes in proposals:
            sim.propose_many(changes)
            sim.step_time()
            sim.fits_in_memory()
            sim.reject()
        dt = time.perf_counter() - t
        assert sim.step_time() == start  # every proposal rejected: back where it began
    what = "one operator" if args.single else "every layer's operator at a position"
    what += ", the stage whole" if args.whole or args.single else ", the stage folded"
    print(f"TP8 PP{args.stages} v{args.virtual}, {m} microbatches ({start:.3f} s a step), "
          f"{what} a proposal: {args.proposals / dt:.1f} proposals/s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
