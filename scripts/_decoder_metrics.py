"""What bench_scaling.py and bench_pipeline.py both report of a decoder plan: the model's FLOPs
and the TP / DP degrees its layers' matmuls run at. Both import it from here, so neither script
imports the other's helpers (bench_scaling.py runs bench_pipeline.run_case, one way)."""

from __future__ import annotations

import math

from soapjax.strategy.space import MeshShape
from soapjax_zoo.gpt import GPT_SIZES
from soapjax_zoo.llama import LLAMA_SIZES


def model_flops(model: str, size: str, batch: int, params: int) -> tuple[float, float]:
    """(FLOPs of a step without recomputation, FLOPs of one forward of the layers)."""
    cfg = (GPT_SIZES if model == "gpt" else LLAMA_SIZES)[size]
    tokens = batch * cfg.seq_len
    attention = 12 * cfg.num_layers * batch * cfg.seq_len ** 2 * cfg.d_model
    step = 6 * params * tokens + attention
    return step, step / 3


def matmul_degrees(graph, strategy, mesh: MeshShape) -> tuple[int, int, str]:
    """(TP, DP, note) of a strategy, read from the layers' matmuls: each matmul's TP degree
    is the product of the axes splitting its non-sample dims, its DP degree that of the axes
    splitting its sample dims. The pair most matmuls share is reported; where some differ, the
    note says how many follow it (a searched plan need not give every matmul the same
    split)."""
    pairs: dict[tuple[int, int], int] = {}
    for op, c in zip(graph.operators, strategy.configs):
        if op.anchor != "dot_general" or not op.block_position:
            continue
        tp = math.prod(mesh.degree(a) for d, a in enumerate(c.axes) if op.roles[d:d + 1] != ("S",))
        dp = math.prod(mesh.degree(a) for d, a in enumerate(c.axes) if op.roles[d:d + 1] == ("S",))
        pairs[tp, dp] = pairs.get((tp, dp), 0) + 1
    if not pairs:
        return 1, 1, ""
    (tp, dp), k = max(pairs.items(), key=lambda kv: (kv[1], -kv[0][0]))
    total = sum(pairs.values())
    return tp, dp, "" if k == total else f"({k}/{total} matmuls)"
