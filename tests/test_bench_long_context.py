"""scripts/bench_long_context.py on the tiny llama (8 sequences of 8 tokens) on cpu8: the hand
grid with context parallelism, the search, the table."""

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

import bench_long_context  # noqa: E402

GRID = {"tp": (1, 4), "cp": (1, 2), "pp": (1,), "mb": (1,)}


@pytest.fixture(scope="module")
def row():
    # proposals per chain, not a wall-clock budget: the search must reach the grid's best
    # point on a busy machine too (test_bench_moe.py's search once did not, in 4 s)
    return bench_long_context.run_case("tiny", bench_long_context.Case("tiny", "cpu8"),
                                       budget=3.0, pipelines=False, grid=GRID, proposals=100)


def test_grid_has_context_parallel_points_that_gather_keys_and_values(row):
    names = {p["name"]: p for p in row["grid"]}
    # cpu8 is data=2 x model=4: tp1 cp1 (dp 8), tp1 cp2 (CP over data, dp 4), tp4 cp1 (TP
    # over model, dp 2), tp4 cp2 (CP over data, no replicas); each under 3 recomputations
    # and Megatron-Core's MLP-only one ("mlp", without stages), with and without the
    # distributed optimizer
    assert len(names) == 4 * 4 * 2 and sum(n.split()[4] == "mlp" for n in names) == 8
    assert {n.rsplit(" mb1", 1)[0] for n in names} == {"tp1 cp1 pp1", "tp1 cp2 pp1",
                                                       "tp4 cp1 pp1", "tp4 cp2 pp1"}
    kv = {n: p["kv_bytes"] for n, p in names.items()}
    # data parallel alone moves no keys or values. CP 2 over data (dp 4 over model: 2
    # sequences a replica) gathers each layer's keys and values, [2, 4 of 8 tokens, 4 kv
    # heads, 4] float32 (512 bytes sent each), and reduce-scatters their cotangents at the
    # dots' operands, after GQA's repeat: [2, 8, 8 heads, 4], 1024 bytes sent each; 2 layers.
    # Recomputing the attention core (selective, full) gathers them again in the backward
    # (its checkpoint keeps them split); keeping the attention block ("mlp") does not
    assert all(v == 0 for n, v in kv.items() if n.startswith("tp1 cp1 "))
    again = {n.split()[4]: 2 * 2 * 512 if n.split()[4] in ("selective", "full") else 0
             for n in kv}
    assert all(v == 2 * (2 * 512 + 2 * 1024) + again[n.split()[4]]
               for n, v in kv.items() if n.startswith("tp1 cp2 "))
    # one layer's probabilities [B, N, T, S] in float32 on one device, one microbatch of one
    # sequence: [1, 8, 8, 8]; under CP 2 half the queries, [1, 8, 4, 8]
    assert names["tp1 cp1 pp1 mb1 full"]["scores"] == 1 * 8 * 8 * 8 * 4
    assert names["tp1 cp2 pp1 mb1 full"]["scores"] == 1 * 8 * 4 * 8 * 4
    assert all(set(p["breakdown"]) == {"params", "grads", "opt_state", "activations",
                                       "comm_buffers", "constants"} for p in names.values())


def test_searched_plan_fits_and_is_never_slower_than_the_grid(row):
    s = row["searched"]
    assert s["fits"] and s["step_s"] > 0
    best = bench_long_context.best_hand(row)
    assert best is not None and s["step_s"] <= best["step_s"] * (1 + 1e-12)
    assert row["search_s"] < 10
    assert set(s["words"]) >= {"attn/q", "attn/dot_general", "microbatches", "recompute"}


def test_render_says_the_ratio_and_what_fills_memory_where_nothing_fits(row):
    args = argparse.Namespace(budget=3.0, pipelines=False)
    text = bench_long_context.render([row], args)
    line = next(t for t in text.splitlines() if t.startswith("| tiny (8 x 8) | 8 |"))
    ratio = float(line.rsplit("|", 2)[1].strip().rstrip("x"))
    assert ratio == pytest.approx(bench_long_context.best_hand(row)["step_s"]
                                  / row["searched"]["step_s"], abs=0.005)
    # with every point over capacity the page says so, and names the smallest's parts
    full = dict(row, grid=[dict(p, fits=False) for p in row["grid"]], memory_capacity=1)
    text = bench_long_context.render([full], args)
    least = bench_long_context.least_memory(full)
    assert f"The point of least memory, `{least['name']}`" in text
    assert "s x s probabilities" in text and "none of 32 fits" in text


def test_the_searched_plan_says_which_layer_operators_keep_their_outputs():
    """`_searched_row.recompute_words`: the policies, and where some of a layer's operators
    recompute and others do not, the ones kept (under selective recomputation, the attention
    core's, a pipeline's too); a policy that recomputes nothing of a layer (selective beside
    flash attention, which has no separate attention core) lists none."""
    from _searched_row import recompute_words

    import soapjax_zoo
    from soapjax.graph.opgraph import trace
    from soapjax.strategy.space import MeshShape, Strategy, data_parallel
    from soapjax.topology.cluster import load_topology

    w = soapjax_zoo.get("llama", "tiny-flash")
    g = trace(w.loss_fn, w.abstract_params(), w.abstract_batch(), name="llama")
    base = data_parallel(g, MeshShape.of(load_topology("cpu8")))

    def policies(rule) -> Strategy:
        return Strategy(base.configs, recompute=tuple(rule(op) for op in g.operators))

    kept = policies(lambda op: "none" if not op.block_position
                    or op.name.endswith(("/attn", "/attn/o")) else "full")
    assert recompute_words(kept, g) == "full, kept: attn, attn/o"
    assert recompute_words(kept) == "full"
    selective = policies(lambda op: "selective" if op.block_position else "none")
    assert recompute_words(selective, g) == "selective"
    assert recompute_words(Strategy(base.configs), g) == "none"
    assert recompute_words(kept.with_pipeline(2), g) == "full"
    # selective recomputation with an attention core's operator kept (LLaMA's own attention:
    # its scores and their product with the values, which selective recomputation runs again)
    w = soapjax_zoo.get("llama", "tiny")
    g = trace(w.loss_fn, w.abstract_params(), w.abstract_batch(), name="llama")
    core = Strategy(data_parallel(g, MeshShape.of(load_topology("cpu8"))).configs,
                    recompute=tuple("none" if not op.block_position
                                    or op.name.endswith("/attn/dot_general_1") else "selective"
                                    for op in g.operators))
    assert recompute_words(core.with_pipeline(2), g) == "selective, kept: attn/dot_general_1"
