"""scripts/bench_moe.py on the tiny MoE (4 experts, 16 tokens) on cpu8: the hand grid, the
search, the table."""

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

import bench_moe  # noqa: E402

GRID = {"tp": (1, 2), "ep": (1, 2), "pp": (1,), "mb": (1, 2)}


@pytest.fixture(scope="module")
def row():
    # 100 proposals per chain, not a wall-clock budget: on a machine whose other core runs
    # another test file, a 4 s budget once left the chains too few proposals to reach the
    # grid's best point (0.0183 s against 0.0179; 30 proposals reach 0.0170)
    return bench_moe.run_case(bench_moe.Case("tiny", "cpu8", 8), budget=4.0, pipelines=False,
                              grid=GRID, proposals=100)


def test_grid_has_expert_parallel_points_with_all_to_alls(row):
    names = {p["name"]: p for p in row["grid"]}
    # 8 sequences: tp1 (8 replicas of one sequence, microbatch size 1) with ep 1 or 2; tp2 (4
    # replicas of two, microbatch size 1 or 2) with ep 1 (TP takes data=2, leaving model=4: no
    # ep 2); each under 3 recomputations and Megatron-Core's MLP-only one ("mlp", without
    # stages), with and without the distributed optimizer;
    # MaxText's rules with the experts over the in-node axes (ep4) and over the node axis
    # (cpu8 has one node: ep1, FSDP alone), 4 recomputations each (save_dot_except_mlp too)
    assert sum(n.startswith("megatron") for n in names) == 32
    assert sum(n.startswith("megatron") and n.endswith(" do") for n in names) == 16
    assert sum(n.startswith("megatron") and " mlp" in n for n in names) == 8
    assert sum(n.startswith("maxtext-moe") for n in names) == 8
    a2a = {n: p["all_to_all"] for n, p in names.items() if n.startswith("megatron")}
    # without expert parallelism or TP no all-to-all; experts over 2 devices add them (TP's
    # sequence-parallel layouts move some by all-to-all too); recomputing the expert layers
    # (full, "mlp") dispatches the tokens again in the backward: half as many bytes more
    assert all(v == 0 for n, v in a2a.items() if "tp1 ep1 " in n)
    assert all(v == (12288 if n.split()[5] in ("full", "mlp") else 8192)
               for n, v in a2a.items() if "tp1 ep2 " in n)


def test_searched_plan_fits_and_is_never_slower_than_megatrons_points(row):
    s = row["searched"]
    assert s["fits"] and s["step_s"] > 0
    best = bench_moe.best_hand(row, "megatron")
    assert best is not None and s["step_s"] <= best["step_s"] * (1 + 1e-12)
    assert row["search_s"] < 15
    assert set(s["words"]) >= {"moe/experts/gate", "attn/q", "microbatches", "recompute"}


def test_render_says_the_ratio(row):
    text = bench_moe.render([row], argparse.Namespace(budget=4.0, pipelines=False))
    line = next(t for t in text.splitlines() if t.startswith("| tiny |"))
    ratio = float(line.rsplit("|", 2)[1].strip().rstrip("x"))
    best = min(bench_moe.best_hand(row, p)["step_s"] for p in ("megatron", "maxtext")
               if bench_moe.best_hand(row, p))
    assert ratio == pytest.approx(best / row["searched"]["step_s"], abs=0.005)


def test_megatrons_selective_recomputation_runs_the_attention_core_again_alone():
    """Megatron-LM's selective recomputation of an MoE model (`_searched_row.megatron_selective`)
    runs the attention core again and nothing of the MoE layer: the layer's dispatch and
    combine einsums (matmuls of two activations, which soapjax's selective rule recomputes)
    keep their outputs, and apply keeps them too (`kept_positions`)."""
    from _searched_row import megatron_selective

    import soapjax_zoo
    from soapjax.apply._pipeline_layout import kept_positions
    from soapjax.graph.opgraph import trace
    from soapjax.strategy.baselines import megatron_3d
    from soapjax.strategy.memory import recomputes
    from soapjax.topology.cluster import load_topology

    w = soapjax_zoo.get("moe", "tiny", batch_size=8)
    g = trace(w.loss_fn, w.abstract_params(), w.abstract_batch(), name=w.name)
    s = megatron_3d(g, load_topology("cpu8"), tp=2, microbatch_size=1, recompute="selective",
                    sequence_parallel=True)
    m = megatron_selective(g, s)

    def again(strategy):
        return {op.name.split("/", 1)[1] for j, op in enumerate(g.operators)
                if op.name.startswith("layers_0/") and recomputes(op, strategy.recompute_of(j))}

    assert any(n.startswith("moe/") for n in again(s))
    assert again(m) and all(n.startswith("attn") for n in again(m))
    assert again(m) == {n for n in again(s) if not n.startswith("moe/")}
    assert set(kept_positions(g, m.with_pipeline(2))) == {
        f"layers_*/{n}" for n in again(s) - again(m)}
    names = bench_moe.megatron_points(g, load_topology("cpu8"), GRID)
    assert all(again(st) == again(m) for n, st in names.items() if n.endswith("selective"))
