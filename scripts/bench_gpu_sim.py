"""GPU simulator against Megatron-LM's published A100 iteration times (issue 31).

Every row of Narayanan et al., SC'21, Table 1 (weak scaling, GPT 1.7B to 1T on 32 to 3072
A100s; Megatron-LM, Narayanan et al. 2021, Table 1) is simulated in the configuration
as published and its predicted iteration time set beside the published one:

* published time: ``F / (GPUs x achieved FLOP/s per GPU)`` with the paper's count
  ``F = 96 B s l h^2 (1 + s / (6 h) + V / (16 l h))`` (four passes over the layers: forward,
  recomputed forward, backward's two; three over the head), B the global batch, s = 2048,
  V = 51200. The traced graph's own count of the matmuls' FLOPs, four times the layers' and
  three times the head's, is printed beside it as a check of the formula;
* predicted time: the zoo's ``gpt`` at the row's size traced from shapes (nothing allocated),
  `soapjax.strategy.baselines.megatron_3d` (TP, PP, microbatch size, virtual stages, recomputation,
  sequence parallelism as below) on ``dgx-a100x3072`` cut to the row's GPUs
  (`soapjax.topology.cluster.scaled_topology`), simulated by `soapjax.simulate.front.simulate` with
  analytic costs and the ideal resharding model, as `scripts/bench_scaling.py` and
  `scripts/bench_pipeline.py` do;
* the error ``(predicted - published) / published`` and the FLOP utilisation each implies
  (the paper's F over time x GPUs x 312 TFLOP/s, the table's "% of peak").

The configuration as published. From the table: TP, PP, GPUs, global batch, the shapes. From
Megatron-LM's own script for the table (NVIDIA/Megatron-LM, examples/sc21/run_table_1.sh):
the microbatch size (16, 16, 16, 8, 4, 2, 2, 1, 1, 1) and the interleaved schedule's layers per
virtual stage (76B: 5, 145B: 5, 310B: 3, 530B: 1, so 3, 2, 2 and 3 virtual stages per device;
none for 1T, which the script runs with plain 1F1B, whatever the paper's text says of the
interleaved schedule (not checked here); none where PP = 1 or 2), ``--recompute-method
uniform`` on every row (full activation recomputation of every layer, which is what the
four-pass F counts), and PyTorch DDP for the rows without pipeline stages, Megatron's "local"
DDP for the others.
Megatron keeps each stage's layers as its chunks run them (``layer_layout="chunks"``), where
`soapjax.apply.step` keeps them in the model's layout and moves them every step under the
interleaved schedule (`soapjax.simulate.pipesim`, module doc, 4: that would add 0.3-0.6 s and 8-9 GB
per GPU to the four interleaved rows).
Assumed: no sequence parallelism (it came later, Korthikanti et al. 2022); the paper's
scatter/gather of stage-to-stage sends, as `soapjax.simulate.pipesim` prices them (each of the TP
devices sends 1/TP of the boundary activations over its own NIC, the receiver all-gathers them
over NVLink); gradient synchronisation, overlap and fp16 as the simulator does them, whatever
DDP flavour the row used; Megatron's dropout (0.1 on the embeddings, the attention
probabilities and both hidden outputs: the zoo's ``gpt`` default), its masks recomputed from
per-sequence seeds in the backward where Megatron stores them; float32 master parameters and
Adam state (the zoo's, which Megatron's fp16 training with fp32 master weights matches in
bytes). The table's achieved TFLOP/s were copied into the reference note by hand and have not
been checked against the paper here; the shapes, TP, PP, batches and node counts agree with
run_table_1.sh.

The device model is the GPU kernel model (`soapjax.cost.kernels`) of the topology file's
``[device.kernels]`` table: GEMMs with tile and wave quantisation over the A100's 108 SMs,
fused memory-bound kernels cut at reductions, 3 us per kernel; collectives at NCCL's 0.8 of
the links' line rates (the links' ``efficiency``, cited in the file). Two parameters are
fitted, nothing else (`FITTED`): the fraction of the fp16 peak the GEMMs' tiles reach and the
fraction of the memory bandwidth the fused kernels reach. `kernel_fit` finds them: each row is
simulated at 3 x 3 design points and its time fitted as ``a + b / gemm + c / memory``
(`surrogate`), the pair minimising the rows' mean absolute error is searched on a grid, and
the figures printed are the real simulation's at that pair. ``--leave-one-out`` refits on
nine rows and predicts the tenth, for each row. The first table is the file as shipped
(whose two efficiencies are this fit's, written there by hand).

Held out, never fitted (the reference note's rule): Korthikanti et al. 2022 ("Reducing
Activation Recomputation in Large Transformer Models", arXiv 2205.05198), GPT 22B, 175B, 530B
and 1T on 8, 64, 280 and 512 A100s at TP8 with data parallel size one, sequence parallelism and
selective recomputation (`KORTHIKANTI`: published times from the MFUs of Megatron-LM's README,
which give 1.10, 13.75, 37.86 and 71.45 s), and the same configurations with full
recomputation, the paper's baseline (`KORTHIKANTI_FULL`). Assumed there: microbatch size 1;
the interleaved schedule at one layer per virtual stage for 175B (v12) and 530B (v3), plain
1F1B for 1T (v2 does not fit in 80 GB in the simulator); the paper gives neither per row. Every
pipelined row is also printed term by term (`pipeline_terms`: compute, in-stage
communication, bubble, stage imbalance, sends, prologue, layout moves, tail), beside Megatron's
own bubble formula.

Usage::

    .venv/bin/python scripts/bench_gpu_sim.py [--rows 1.7b,1t] [--leave-one-out] [--json F]
        [--held-out korthikanti22,korthikanti22-full]

All ten rows with the fit and the leave-one-out take about 100 s on the 2-core development
machine (tracing 1-5 s a row, once; 9 design points x 10 rows of simulation).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np

import soapjax_zoo
from soapjax.base.errors import SoapjaxError
from soapjax.cost.operators import cost_model
from soapjax.graph.opgraph import OpGraph, trace
from soapjax.simulate.front import opt_state_factor, simulate
from soapjax.strategy import baselines
from soapjax.strategy.pipeline import ChunkTimes, time_schedule
from soapjax.topology.cluster import KernelSpec, Topology, load_topology, scaled_topology
from soapjax_zoo.gpt import GPT_SIZES

MESH = "dgx-a100x3072"
A100_PEAK = 312e12  # dense fp16 tensor-core FLOP/s
SEQ, VOCAB = 2048, 51200


class Row(NamedTuple):
    """One row of Narayanan et al. 2021, Table 1, with Megatron-LM's run settings for it.

    Attributes:
      size: the zoo's ``gpt`` size of the row's shape.
      label: the table's parameter count.
      heads, hidden, layers, tp, pp, gpus, batch: the table's columns (batch in sequences).
      tflops: achieved TFLOP/s per GPU (the table's).
      microbatch_size: sequences per microbatch (run_table_1.sh's ``MBS``).
      interleave: virtual stages per device (layers per stage / run_table_1.sh's
        ``--num-layers-per-virtual-pipeline-stage``; 1 without it).
      ddp: run_table_1.sh's ``DDP``: ``torch`` (overlapped with the backward) or ``local``.
      table: the published table the row is from (a key of `TABLES`).
      recompute: the row's activation recomputation (``"full"``: every layer;
        ``"selective"``: Megatron's, the attention core only).
      sequence_parallel: Megatron's sequence parallelism (Korthikanti et al. 2022).
      passes: how many passes over the layers the table's FLOP count takes (4: forward,
        recomputed forward and the backward's two, Table 1's hardware count; 3: the model
        FLOPs of an MFU).
      seconds: the published iteration time where the table gives it in seconds (then
        `tflops` is unused); None: ``F / (GPUs x tflops)``.
    """

    size: str
    label: str
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int
    tflops: float
    microbatch_size: int
    interleave: int
    ddp: str
    table: str = "narayanan21"
    recompute: str = "full"
    sequence_parallel: bool = False
    passes: int = 4
    seconds: float | None = None


ROWS = (
    Row("1.7b", "1.7B", 24, 2304, 24, 1, 1, 32, 512, 137, 16, 1, "torch"),
    Row("3.6b", "3.6B", 32, 3072, 30, 2, 1, 64, 512, 138, 16, 1, "torch"),
    Row("7.5b", "7.5B", 32, 4096, 36, 4, 1, 128, 512, 142, 16, 1, "torch"),
    Row("18.4b", "18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135, 8, 1, "torch"),
    Row("39.1b", "39.1B", 64, 8192, 48, 8, 2, 512, 1536, 138, 4, 1, "local"),
    Row("76.1b", "76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 140, 2, 3, "local"),
    Row("145.6b", "145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 148, 2, 2, "local"),
    Row("310.1b", "310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 155, 1, 2, "local"),
    Row("530b", "529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 163, 1, 3, "local"),
    Row("1t", "1008.0B", 160, 25600, 128, 8, 64, 3072, 3072, 163, 1, 1, "local"),
)

# Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models",
# arXiv 2205.05198), the end-to-end rows: GPT 22B to 1T on A100 80GB (Selene), TP8, data
# parallel size one, sequence parallelism with selective recomputation. Shapes, GPUs and
# global batches are the paper's Table 3; the achieved figures its model FLOPs utilisation
# (41.5, 51.4, 56.0 and 56.3 %, also in Megatron-LM's README), so ``tflops`` is model TFLOP/s
# per GPU (MFU x 312) and ``passes`` 3. The microbatch size (1) and the schedules (the
# interleaved one at one layer per virtual stage for 175B and 530B, plain 1F1B for 1T) are
# assumptions: the paper's text does not give them per row (module doc).
KORTHIKANTI = tuple(
    Row(size, label, heads, hidden, layers, 8, pp, gpus, batch, round(mfu * 312, 2), 1, v,
        "local", table="korthikanti22", recompute="selective", sequence_parallel=True,
        passes=3)
    for size, label, heads, hidden, layers, pp, gpus, batch, mfu, v in (
        ("22b", "22B", 64, 6144, 48, 1, 8, 4, 0.415, 1),
        ("175b", "175B", 96, 12288, 96, 8, 64, 64, 0.514, 12),
        ("530b", "530B", 128, 20480, 105, 35, 280, 280, 0.560, 3),
        ("1t", "1T", 160, 25600, 128, 64, 512, 512, 0.563, 1),
    ))

# The same paper's baseline: the same four configurations with full recomputation and no
# sequence parallelism, run on the same software (its end-to-end table: 1.42, 18.13, 49.05 and
# 94.42 s; the paper is not in the reference folder, so these were taken from its text by hand
# and not checked here: module doc). Beside the rows above they measure what selective
# recomputation with sequence parallelism saves (29-32 %), and beside Table 1's 530B and 1T
# rows (same configurations, more data parallelism) how much faster this software was.
KORTHIKANTI_FULL = tuple(
    r._replace(label=f"{r.label} full", recompute="full", sequence_parallel=False, passes=4,
               seconds=seconds, table="korthikanti22-full")
    for r, seconds in zip(KORTHIKANTI, (1.42, 18.13, 49.05, 94.42)))

# Every table the script prints: its title and rows. Only Table 1 is fitted (the reference
# note's rule: fit what it holds, check on the rest), so every other table is held out whole.
TABLES = {
    "narayanan21": ("Narayanan et al., SC'21, Table 1 (fitted)", ROWS),
    "korthikanti22": ("Korthikanti et al. 2022, end-to-end rows (held out)", KORTHIKANTI),
    "korthikanti22-full": ("Korthikanti et al. 2022, its full-recompute baseline (held out)",
                           KORTHIKANTI_FULL),
}


def paper_flops(row: Row) -> float:
    """The table's FLOPs per iteration: ``24 p B s l h^2 (1 + s / (6 h)) + 6 B s h V`` with p
    the row's `passes` over the layers (three over the head): Table 1's ``96 B s l h^2 (1 +
    s / (6 h) + V / (16 l h))`` at p = 4, Korthikanti et al.'s model FLOPs ``72 B s l h^2 (1 +
    s / (6 h) + V / (12 l h))`` at p = 3.

    >>> f"{paper_flops(ROWS[-1]):.3e}"
    '5.139e+19'
    >>> f"{paper_flops(KORTHIKANTI[1]):.3e}"
    '1.411e+17'
    """
    b, layers, h = row.batch, row.layers, row.hidden
    return (24 * row.passes * b * SEQ * layers * h * h * (1 + SEQ / (6 * h))
            + 6 * b * SEQ * h * VOCAB)


def published_time(row: Row) -> float:
    """The published iteration time in seconds: the paper's FLOPs over GPUs x achieved FLOP/s.

    >>> round(published_time(ROWS[-1]), 1)
    102.6
    """
    if row.seconds is not None:
        return row.seconds
    return paper_flops(row) / (row.gpus * row.tflops * 1e12)


def graph_flops(graph: OpGraph, passes: int = 4) -> float:
    """The graph's matmul FLOPs of one iteration counted as the paper counts them: the layers'
    forward `passes` times (4: forward, recomputed forward, two in the backward), the rest
    three."""
    mm = [op for op in graph.operators if op.anchor == "dot_general"]
    layers = sum(op.flops for op in mm if op.block_position)
    return passes * layers + 3 * sum(op.flops for op in mm if not op.block_position)


class Prediction(NamedTuple):
    """A row's published and predicted figures (`predicted_s` None where it could not be
    built: `note` says why)."""

    row: Row
    published_s: float
    predicted_s: float | None
    fits: bool | None
    memory_gb: float | None
    bubble: float | None
    flops_ratio: float | None
    note: str
    run_s: float
    terms: Mapping[str, float] | None = None

    @property
    def error(self) -> float | None:
        """``(predicted - published) / published``."""
        if self.predicted_s is None:
            return None
        return (self.predicted_s - self.published_s) / self.published_s


def row_topology(row: Row, params: Mapping[str, Any] | None) -> Topology:
    """``dgx-a100x3072`` cut to the row's GPUs, with fitted parameters applied (None: as
    shipped). Parameters: ``"efficiency"``, a `soapjax.topology.cluster.Efficiency` (the file's
    ``[device.efficiency]``), and any field of its ``[device.kernels]`` table
    (`soapjax.topology.cluster.KernelSpec`: ``gemm_efficiency``, ``memory_efficiency``,
    ``launch``)."""
    topo = scaled_topology(load_topology(MESH), row.gpus)
    if not params:
        return topo
    kernel_fields = {f.name for f in dataclasses.fields(KernelSpec)}
    unknown = set(params) - {"efficiency"} - kernel_fields
    if unknown:
        raise ValueError(f"fitted parameters {sorted(unknown)} are not applied by row_topology;"
                         f" expected 'efficiency' or fields of KernelSpec "
                         f"({sorted(kernel_fields)})")
    device = topo.device
    if "efficiency" in params:
        device = dataclasses.replace(device, efficiency=params["efficiency"])
    kernels = {k: v for k, v in params.items() if k in kernel_fields}
    if kernels:
        if device.kernels is None:
            raise ValueError(f"{MESH} has no [device.kernels] table to apply {sorted(kernels)} to")
        device = dataclasses.replace(device, kernels=dataclasses.replace(device.kernels,
                                                                         **kernels))
    return dataclasses.replace(topo, device=device)


@functools.cache
def row_graph(size: str, batch: int) -> tuple[Any, OpGraph]:
    """The zoo's ``gpt`` at `size` with `batch` sequences, traced from shapes (cached: a fit
    simulates every row many times)."""
    w = soapjax_zoo.get("gpt", size, batch_size=batch)
    return w, trace(w.loss_fn, w.abstract_params(), w.abstract_batch(), name=w.name)


def predict(row: Row, params: Mapping[str, Any] | None = None) -> Prediction:
    """The row simulated in its published configuration; errors that stop it are in ``note``."""
    t0 = time.perf_counter()
    cfg = GPT_SIZES[row.size]
    assert (cfg.num_heads, cfg.d_model, cfg.num_layers, cfg.seq_len, cfg.vocab_size) == (
        row.heads, row.hidden, row.layers, SEQ, VOCAB), (row, cfg)
    published = published_time(row)
    w, g = row_graph(row.size, row.batch)
    ratio = graph_flops(g, row.passes) / paper_flops(row)
    try:
        topo = row_topology(row, params)
        strategy = baselines.megatron_3d(
            g, topo, tp=row.tp, pp=row.pp, microbatch_size=row.microbatch_size,
            interleave=row.interleave, recompute=row.recompute,
            sequence_parallel=row.sequence_parallel)
        costs = cost_model(g, topo, mode="analytic", optimizer=w.optimizer)
        r = simulate(g, topo, strategy, cost_model=costs, resharder="ideal",
                     opt_state_factor=opt_state_factor(w.optimizer, w.abstract_params()),
                     layer_layout="chunks")
    except SoapjaxError as e:
        return Prediction(row, published, None, None, None, None, ratio,
                          f"not built: {str(e).splitlines()[0]}", time.perf_counter() - t0)
    note = "" if r.fits_in_memory else "does not fit in 80 GB"
    bubble = r.pipeline.bubble_fraction if r.pipeline is not None else None
    terms = pipeline_terms(r.pipeline, r.compute_s) if r.pipeline is not None else None
    return Prediction(row, published, r.step_time_s, r.fits_in_memory,
                      max(r.peak_memory_bytes) / 1e9, bubble, ratio, note,
                      time.perf_counter() - t0, terms)


TERMS = ("compute", "in-stage communication", "bubble", "stage imbalance", "sends",
         "prologue", "layout moves", "tail")


def pipeline_terms(p: Any, stages_compute_s: float) -> dict[str, float]:
    """A pipelined step cut into `TERMS` (seconds, summing to the step), each what the step
    grows by when the simulator adds it to what came before:

    * compute: the devices' own compute of one stage's share of the layers (the one-stage
      simulation's compute over all the layers, over the stages), recomputation included;
    * in-stage communication: the rest of the chunk times at even stages (tensor-parallel
      collectives the chunks wait for), so that compute + this = M v (mean forward + backward);
    * bubble: the schedule's idle time with every chunk at the mean time and free sends;
    * stage imbalance: the chunks at their own times (the head on the last stage, the
      embedding's split), sends still free;
    * sends: the stage-to-stage sends at their priced times;
    * prologue: the embedding's SPMD forward before the pipeline and its backward after;
    * layout moves: stacked parameters moved to the chunks' layout and back (0 under
      Megatron's layout, which the rows use);
    * tail: what the step ends after the last backward (the gradient synchronisation and
      update of the slowest stage) and the call's overhead."""
    tl, ct = p.timeline, p.chunk_times
    n = ct.chunks
    mean_f, mean_b = sum(ct.forward_s) / n, sum(ct.backward_s) / n
    even = time_schedule(tl.schedule, tl.stages, tl.microbatches, tl.virtual,
                         ChunkTimes.uniform(n, mean_f, mean_b)).step_s
    free = time_schedule(tl.schedule, tl.stages, tl.microbatches, tl.virtual,
                         ChunkTimes(ct.forward_s, ct.backward_s, (0.0,) * (n - 1))).step_s
    chunks = tl.microbatches * tl.virtual * (mean_f + mean_b)
    compute = min(chunks, stages_compute_s / tl.stages)
    before, after = p.prologue_s
    moves = sum(p.layout_move_s)
    pipeline = tl.step_s + after
    return {"compute": compute, "in-stage communication": chunks - compute,
            "bubble": even - chunks, "stage imbalance": free - even, "sends": tl.step_s - free,
            "prologue": before + after, "layout moves": moves,
            "tail": p.step_time_s - before - moves - pipeline}


Params = Mapping[str, Any] | None
Fit = Callable[[Sequence[Row]], Params]


def no_fit(rows: Sequence[Row]) -> Params:
    """No parameters to fit yet: the simulator's device model as shipped."""
    return None


# The two parameters fitted, their design points and the grid the fit searches. Everything
# else in the device model is the topology file's: datasheet peaks and bandwidths, 108 SMs,
# 128 x 128 tiles, 3 us per kernel, and NCCL's 0.8 of the line rate (cited there).
FITTED = ("gemm_efficiency", "memory_efficiency")
DESIGN = ((0.6, 0.8, 1.0), (0.4, 0.7, 1.0))
GRID = (np.linspace(0.4, 1.0, 121), np.linspace(0.2, 1.0, 161))


@functools.cache
def surrogate(row: Row) -> tuple[float, float, float]:
    """``(a, b, c)`` with the row's predicted time ``~ a + b / gemm_efficiency + c /
    memory_efficiency``: least squares through the row simulated at the 3 x 3 `DESIGN`
    points (GEMM time scales with the first's inverse, fused kernels' with the second's; the
    communication and everything else is ``a``). Cached: a leave-one-out reuses it."""
    xs, ys = [], []
    for g in DESIGN[0]:
        for m in DESIGN[1]:
            t = predict(row, {"gemm_efficiency": g, "memory_efficiency": m}).predicted_s
            if t is None:
                raise SoapjaxError(f"row {row.label} cannot be simulated for the fit")
            xs.append((1.0, 1 / g, 1 / m))
            ys.append(t)
    coef, *_ = np.linalg.lstsq(np.array(xs), np.array(ys), rcond=None)
    return float(coef[0]), float(coef[1]), float(coef[2])


def kernel_fit(rows: Sequence[Row]) -> Params:
    """The A100's GEMM and memory efficiencies that minimise the rows' mean absolute relative
    error (ties: the smaller maximum), searched on `GRID` through each row's `surrogate`; the
    reported errors are those of the real simulation at the point found."""
    g, m = np.meshgrid(*GRID, indexing="ij")
    errors = []
    for row in rows:
        a, b, c = surrogate(row)
        published = published_time(row)
        errors.append(np.abs((a + b / g + c / m) - published) / published)
    stack = np.stack(errors)
    score = stack.mean(axis=0) + 1e-6 * stack.max(axis=0)
    i, j = np.unravel_index(np.argmin(score), score.shape)
    return {"gemm_efficiency": round(float(GRID[0][i]), 3),
            "memory_efficiency": round(float(GRID[1][j]), 3)}


FIT: Fit = kernel_fit  # the fit the script runs (no_fit: the topology file as shipped)


def leave_one_out(rows: Sequence[Row], fit: Fit = no_fit,
                  predict: Callable[[Row, Params], Prediction] = predict) -> list[Prediction]:
    """Each row predicted with the parameters `fit` finds on the other rows."""
    return [predict(row, fit([r for r in rows if r is not row])) for row in rows]


def leave_tables_out(tables: Mapping[str, tuple[str, Sequence[Row]]] = TABLES,
                     fit: Fit | None = None) -> str:
    """The protocol of issue 47: each table predicted with the parameters fitted on the
    other tables' rows (one parameter set for the A100, never per table), then the 2022
    software's tables (Korthikanti et al.: selective and full recomputation) each predicted
    with the fit on the other alone, then fitted together and the 2021 software's Table 1
    predicted apart (measured slower on the same configurations: docs/accuracy.md), each
    row's error and each table's mean and max."""
    fit = fit or FIT
    out = []
    for held, (title, rows) in tables.items():
        params = fit([r for name, (_, rs) in tables.items() if name != held for r in rs])
        out.append(render([predict(r, params) for r in rows],
                          f"Leave one table out: {title}, predicted with the fit on the other "
                          f"tables {params}"))
    newer = [n for n in tables if n.startswith("korthikanti22")]
    for held in newer if len(newer) > 1 else ():  # within the 2022 software alone
        params = fit([r for n in newer if n != held for r in tables[n][1]])
        title, rows = tables[held]
        out.append(render([predict(r, params) for r in rows],
                          f"Within the 2022 software, leave one table out: {title}, predicted "
                          f"with the fit on its other table {params}"))
    if newer and "narayanan21" in tables:
        params = fit([r for n in newer for r in tables[n][1]])
        for name in newer + ["narayanan21"]:
            title, rows = tables[name]
            out.append(render([predict(r, params) for r in rows],
                              f"The 2022 software's tables fitted together {params}: {title}"
                              + (" (the 2021 software, apart)" if name == "narayanan21"
                                 else "")))
    return "\n\n".join(out)


def summary(preds: Sequence[Prediction]) -> tuple[float, float] | None:
    """(mean, max) absolute error over the rows that were built."""
    errors = [abs(p.error) for p in preds if p.error is not None]
    return (statistics.fmean(errors), max(errors)) if errors else None


def config_words(row: Row) -> str:
    pipe = f" PP{row.pp}" + (f" v{row.interleave}" if row.interleave > 1 else "")
    sched = (" interleaved" if row.interleave > 1 else " 1F1B") if row.pp > 1 else ""
    dp = row.gpus // (row.tp * row.pp)
    extra = f" {row.recompute} recompute" + (" SP" if row.sequence_parallel else "")
    return (f"TP{row.tp}{pipe if row.pp > 1 else ''} DP{dp} mb{row.microbatch_size}{sched}"
            f"{extra}")


def render_terms(preds: Sequence[Prediction]) -> str:
    """The pipelined rows' steps cut into `TERMS` (`pipeline_terms`), in seconds and as a share
    of the step, beside the published time."""
    rows = [p for p in preds if p.terms]
    if not rows:
        return ""
    lines = ["| row | config | published (s) | predicted (s) | "
             + " | ".join(TERMS) + " | Megatron's bubble (p - 1) / (v m) |",
             "|---|---|---:|---:|" + "---:|" * len(TERMS) + "---:|"]
    for p in rows:
        r = p.row
        m = r.batch // (r.gpus // (r.tp * r.pp)) // r.microbatch_size
        cells = " | ".join(f"{p.terms[t]:.2f} ({100 * p.terms[t] / p.predicted_s:.1f}%)"
                           for t in TERMS)
        lines.append(f"| {r.label} | {config_words(r)} | {p.published_s:.2f} | "
                     f"{p.predicted_s:.2f} | {cells} | "
                     f"{100 * (r.pp - 1) / (r.interleave * m):.1f}% |")
    return "\n".join(lines)


def render(preds: Sequence[Prediction], title: str) -> str:
    lines = [
        f"{title}",
        "",
        ("| row | GPUs | batch | config | published (s) | predicted (s) "
         "| error | % of peak: published | predicted | bubble | memory/GPU (GB) "
         "| graph F / paper F | note |"),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in preds:
        r = p.row
        pct = 100 * paper_flops(r) / (p.published_s * r.gpus * A100_PEAK)
        if p.predicted_s is None:
            pred = err = mfu = mem = bubble = "-"
        else:
            pred, err = f"{p.predicted_s:.2f}", f"{100 * p.error:+.1f}%"
            mfu = f"{100 * paper_flops(r) / (p.predicted_s * r.gpus * A100_PEAK):.0f}%"
            mem = f"{p.memory_gb:.1f}"
            bubble = "-" if p.bubble is None else f"{100 * p.bubble:.1f}%"
        lines.append(f"| {r.label} | {r.gpus} | {r.batch} | {config_words(r)} | "
                     f"{p.published_s:.2f} | {pred} | {err} | {pct:.0f}% | {mfu} | {bubble} | "
                     f"{mem} | {p.flops_ratio:.4f} | {p.note} |")
    s = summary(preds)
    built = sum(p.error is not None for p in preds)
    lines += ["", f"mean |error| {100 * s[0]:.1f}%, max |error| {100 * s[1]:.1f}% over {built} "
              "rows" if s else "no row was built"]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default=None,
                   help="comma-separated zoo sizes to run, e.g. '1.7b,1t' (default: all ten: "
                   + ", ".join(r.size for r in ROWS) + ")")
    p.add_argument("--leave-one-out", action="store_true",
                   help="also predict each row with parameters fitted on the others")
    p.add_argument("--json", default=None, help="also write the rows as JSON")
    p.add_argument("--tables-out", action="store_true",
                   help="instead: leave one table out. Each Megatron-LM A100 table predicted "
                   "with the parameters fitted on the others' rows, then the 2022 software's "
                   "two tables fitted alone and Table 1 (the 2021 software) predicted apart "
                   "(every row simulated at the fit's design points once; ~30-60 min)")
    p.add_argument("--held-out", default=",".join(t for t in TABLES if t != "narayanan21"),
                   help="comma-separated tables to predict with Table 1's fit, none fitted "
                   "(default: every other table: "
                   + ", ".join(t for t in TABLES if t != "narayanan21") + "; '' for none)")
    args = p.parse_args()
    held_out = [t.strip() for t in args.held_out.split(",") if t.strip()]
    unknown = [t for t in held_out if t not in TABLES or t == "narayanan21"]
    if unknown:
        p.error(f"unknown held-out tables {unknown}; expected some of "
                + ", ".join(t for t in TABLES if t != "narayanan21"))
    rows = list(ROWS)
    if args.rows:
        wanted = [s.strip() for s in args.rows.split(",")]
        unknown = [s for s in wanted if s not in {r.size for r in ROWS}]
        if unknown:
            p.error(f"unknown rows {unknown}; expected some of "
                    + ", ".join(r.size for r in ROWS))
        rows = [r for r in ROWS if r.size in wanted]
    t0 = time.perf_counter()
    if args.tables_out:
        print(leave_tables_out())
        print(f"\nrun time: {time.perf_counter() - t0:.0f} s")
        return 0
    setup = next(q for q in __doc__.split("\n\n") if q.startswith("The configuration as"))
    print(setup.replace("\n", " "), "\n", flush=True)
    shipped = [predict(row, None) for row in rows]
    print(render(shipped, f"As shipped: {MESH}'s own device model (its [device.kernels] "
                 "table)") + "\n", flush=True)
    if FIT is not no_fit:
        print(f"fitting {', '.join(FITTED)}: every row at {len(DESIGN[0]) * len(DESIGN[1])} "
              "design points ...", file=sys.stderr, flush=True)
    params = FIT(ROWS)
    preds = []
    for row in rows:
        preds.append(predict(row, params))
        q = preds[-1]
        print(f"{row.label}: published {q.published_s:.2f} s, predicted "
              f"{q.predicted_s if q.predicted_s is None else round(q.predicted_s, 3)} s "
              f"({q.run_s:.1f} s) {q.note}", file=sys.stderr, flush=True)
    one = ROWS[-1]
    print(render(preds, "Before fitting: the device model as shipped (analytic roofline, "
                 "100 % of peak, ideal resharding)" if params is None else f"Fitted: {params}"))
    print(f"\nFLOP formula check: {one.label}: F = {paper_flops(one):.3e} FLOPs, over "
          f"{one.gpus} x {one.tflops:.0f} TFLOP/s = {published_time(one):.1f} s per iteration "
          f"(the reference note's 5.14e19 and about 103 s); the column 'graph F / paper F' is "
          "the traced graph's own matmul count (layers x4, head x3) over the formula's.")
    if args.leave_one_out:
        if FIT is no_fit:
            print("\nleave-one-out: no parameters to fit yet (no_fit); each row's prediction "
                  "is the one above, so the leave-one-out error equals the error above.")
        else:  # each row predicted from the parameters fitted on the other nine
            loo = []
            for row in rows:
                fitted = FIT([r for r in ROWS if r is not row])
                loo.append(predict(row, fitted))
                print(f"leave-one-out {row.label}: {fitted}", file=sys.stderr, flush=True)
            print("\n" + render(loo, "Leave-one-out: each row predicted with the parameters "
                                 "fitted on the other nine"))
    held = []
    for name in held_out:
        title, table = TABLES[name]
        out = []
        for row in table:
            out.append(predict(row, params))
            print(f"{title}: {row.label}: published {out[-1].published_s:.2f} s, predicted "
                  f"{out[-1].predicted_s} s ({out[-1].run_s:.1f} s) {out[-1].note}",
                  file=sys.stderr, flush=True)
        print("\n" + render(out, f"{title}, predicted with Table 1's fit {params}"))
        held += out
    terms = render_terms(preds + held)
    if terms:
        print("\nThe pipelined rows' predicted steps, term by term (`pipeline_terms`: each term"
              " is what the step grows by when the simulator adds it):\n\n" + terms)
    print(f"\nrun time: {time.perf_counter() - t0:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(
            [{**p.row._asdict(), "published_s": p.published_s, "predicted_s": p.predicted_s,
              "error": p.error, "fits": p.fits, "memory_gb": p.memory_gb, "bubble": p.bubble,
              "graph_flops_ratio": p.flops_ratio, "note": p.note, "terms": p.terms}
             for p in preds + held], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
