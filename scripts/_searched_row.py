"""What the plan-against-hand-grid benches (scripts/bench_moe.py, scripts/bench_long_context.py)
share: Megatron-LM's hand grid (`megatron_points`), a strategy's pipeline-level words
(`strategy_words`), and the search half (`search_into`): one `find_plan` at a budget, timed, and
its plan recorded as the bench records a grid point."""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable
from typing import Any

from soapjax.base.errors import PlanError
from soapjax.graph.opgraph import OpGraph
from soapjax.search import SearchSettings, find_plan
from soapjax.strategy import baselines
from soapjax.strategy.memory import recomputes
from soapjax.strategy.space import RECOMPUTE_POLICIES, MeshShape, Strategy
from soapjax.topology.cluster import stage_topology


def attention_kept(g: OpGraph, s: Strategy) -> Strategy:
    """`s` recomputing every layer operator in full but the attention block's (those named
    ``attn`` or ``attn/...`` within the layer: projections, core, output), which keep their
    outputs: Megatron-Core's ``--recompute-granularity selective --recompute-modules mlp
    layernorm`` (``moe`` for an MoE layer), MaxText's ``remat_policy: save_dot_except_mlp``.
    The hand grids' ``mlp`` recomputation, without pipeline stages only (with stages
    `soapjax.apply` runs one policy for a chunk's layers)."""
    def kept(name: str) -> bool:
        part = name.split("/", 1)[1] if "/" in name else name
        return part == "attn" or part.startswith("attn/")

    return dataclasses.replace(s, recompute=tuple(
        "full" if op.block_position and not kept(op.name) else "none" for op in g.operators))


def megatron_selective(g: OpGraph, s: Strategy) -> Strategy:
    """`s` (selective recomputation) as Megatron-LM runs it on a mixture-of-experts layer:
    its selective recomputation runs the attention core again (``core_attn``) and nothing of
    the MoE layer, which moves its tokens by permutation, not by GShard's dispatch and combine
    einsums (matmuls of two activations, which `soapjax.strategy.memory`'s selective rule, and
    MaxText's ``minimal`` remat policy, recompute): the MoE layer's operators keep their
    outputs (policy none; `soapjax.apply` runs that, `kept_positions`). The same strategy
    where no layer operator under ``moe`` recomputes."""
    def moe(name: str) -> bool:
        return "/moe/" in name or name.endswith("/moe")

    return dataclasses.replace(s, recompute=tuple(
        "none" if op.block_position and moe(op.name) and s.recompute_of(j) == "selective"
        else s.recompute_of(j) for j, op in enumerate(g.operators)))


def megatron_points(g: OpGraph, topo, grid: dict, label: str) -> dict[str, Strategy]:
    """The Megatron-LM configurations of `grid` (``tp``, ``pp``, ``mb`` and ``ep`` or ``cp``;
    an absent degree is 1) that `baselines.megatron_3d` can build, each with and without the
    distributed optimizer, by name: `label` formatted with ``tp, ep, cp, pp, mb, rec``, then
    ``" do"`` with the distributed optimizer. ``rec`` is a policy of `RECOMPUTE_POLICIES` or,
    without pipeline stages, ``mlp`` (`attention_kept`: Megatron-Core's MLP and norms
    recomputed)."""
    out = {}
    for tp, ep, cp, pp, mb, rec, do in itertools.product(
            grid["tp"], grid.get("ep", (1,)), grid.get("cp", (1,)), grid["pp"], grid["mb"],
            RECOMPUTE_POLICIES + ("mlp",), (False, True)):
        if rec == "mlp" and pp > 1:
            continue
        try:
            s = baselines.megatron_3d(g, topo, tp=tp, pp=pp, ep=ep, cp=cp, microbatch_size=mb,
                                      recompute="full" if rec == "mlp" else rec,
                                      sequence_parallel=tp > 1, distributed_optimizer=do)
        except PlanError:
            continue
        name = label.format(tp=tp, ep=ep, cp=cp, pp=pp, mb=mb, rec=rec)
        out[name + (" do" if do else "")] = (attention_kept(g, s) if rec == "mlp" else
                                             megatron_selective(g, s) if rec == "selective"
                                             else s)
    return out


def recompute_words(strategy: Strategy, graph: OpGraph | None = None) -> str:
    """The policies a strategy recomputes under ("full", "full+selective", "none"); with
    `graph`, which of a layer's operators keep their outputs, by their name within the layer
    (`soapjax.search.recompute`): under full recomputation those it does not recompute
    (`soapjax.strategy.memory.recomputes`; "full, kept: attn, attn/o"), not for a pipeline,
    whose chunks recomputed in full keep their input alone; under selective recomputation
    the attention-core operators kept ("selective, kept: moe/dot_general_4", a pipeline's
    too: `soapjax.apply._pipeline_layout.kept_positions`)."""
    words = "+".join(sorted({p for p in strategy.recompute if p != "none"})) or "none"
    if graph is None or words == "none":
        return words
    layer = [(op, strategy.recompute_of(j)) for j, op in enumerate(graph.operators)
             if op.block_position and "/" in op.name]
    if "full" in words:
        if strategy.stages > 1 or not any(recomputes(op, policy) for op, policy in layer):
            return words
        kept = {op.name for op, policy in layer if not recomputes(op, policy)}
    else:
        kept = {op.name for op, policy in layer
                if policy == "none" and recomputes(op, "selective")}
    kept_words = sorted({name.split("/", 1)[1] for name in kept})
    return f"{words}, kept: {', '.join(kept_words)}" if kept_words else words


def strategy_words(strategy: Strategy, topo, graph: OpGraph | None = None) -> dict[str, str]:
    """A strategy's microbatches, recomputation (`recompute_words`), ZeRO and optimizer-state
    axes, pipeline stages and (stage) mesh, in words."""
    mesh = MeshShape.of(stage_topology(topo, strategy.stages) if strategy.stages > 1 else topo)
    return {
        "microbatches": str(strategy.microbatches),
        "recompute": recompute_words(strategy, graph),
        "zero": "x".join(strategy.zero_axes) or "none",
        "optimizer": "x".join(strategy.optimizer_axes) or "none",
        "stages": f"{strategy.stages} ({strategy.schedule}, v{strategy.virtual_stages})"
        if strategy.stages > 1 else "1",
        "mesh": " x ".join(f"{a}={mesh.axis_size(a)}" for a in mesh.axis_names),
    }


def search_into(row: dict, g: OpGraph, topo, w: Any, model_config: str, costs, budget: float,
                pipelines: bool | None, point: Callable[..., Any],
                describe: Callable[..., dict], progress=None,
                proposals: int | None = None, processes: int | None = None) -> dict:
    """Searches `g` on `topo` (seed 0, `budget` seconds, or `proposals` per chain whatever
    the time: the same plan on a busy machine; its chains in `processes`, None: one per core)
    and fills `row`: ``search_s`` and either
    ``error`` (the PlanError's first line) or ``searched`` (``point("searched", ...)`` as a
    dict, with the plan's `describe` words, the grid point it started from and its
    proposals). Returns `row`."""
    t0 = time.perf_counter()
    try:
        # check_reshardings off: the hand grid is priced with the ideal resharding model,
        # so the searched plan is chosen and priced with it too (docs/checks.md,
        # "Reshardings checked against XLA", for what XLA makes of searched plans)
        plan = find_plan(g, topo, settings=SearchSettings(budget_s=budget, seed=0,
                                                          pipelines=pipelines,
                                                          max_proposals=proposals,
                                                          processes=processes,
                                                          check_reshardings=False),
                         costs=costs, optimizer=w.optimizer, family=w.family,
                         model_config=model_config, progress=progress)
    except PlanError as e:
        row["search_s"], row["error"] = time.perf_counter() - t0, str(e).splitlines()[0]
        return row
    row["search_s"] = time.perf_counter() - t0
    s = plan.strategy(g, topo)
    info = plan.to_json()["search"]
    row["searched"] = point(s)._asdict() | {
        "words": describe(g, s, topo), "best_from": info.get("best_from"),
        "proposals": info.get("proposals")}
    return row
