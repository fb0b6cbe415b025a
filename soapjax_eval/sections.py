"""What each section of the results doc says: its tables, and the reading of them computed
from the numbers (so the prose never disagrees with the run it describes)."""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

from soapjax_eval.modes import PAPER_FIG8B_GB, PAPER_TABLE4_SPEEDUP
from soapjax_eval.tables import (
    by_cluster,
    expert_name,
    fmt,
    gb,
    md_table,
    spearman,
    throughput,
)


def doc_throughput(res: dict) -> str:
    out = []
    for cluster, rows in by_cluster(res["rows"]).items():
        header = ["model", "GPUs", "batch", "data parallel", "expert", "Megatron", "FSDP",
                  "soapjax", "vs DP", "vs best baseline", "search CPU s"]
        body = []
        for row in rows:
            b = row["batch"]
            cells = []
            for bname in ("data-parallel", expert_name(row), "megatron", "fsdp"):
                e = row["baselines"].get(bname) if bname else None
                t = throughput(e, b)
                cells.append("-" if t is None else fmt(t, 4) + ("" if e["fits"] else " (OOM)"))
            if "error" in row:
                body.append([row["model"], row["devices"], b, *cells, "no plan fits", "-", "-",
                             "-"])
                continue
            s = row["soapjax"]["step_time_s"]
            dp = row["baselines"]["data-parallel"]["step_time_s"]
            fitting = [e["step_time_s"] for e in row["baselines"].values() if e["fits"]]
            vs_best = f"{min(fitting) / s:.2f}x" if fitting else "-"
            body.append([row["model"] if row["cluster"] != "h100" else row["topology"],
                         row["devices"], b, *cells, fmt(b / s, 4),
                         f"{dp / s:.2f}x", vs_best, f"{row['search']['cpu_s']:.1f}"])
        title = {"p100x16": "P100 cluster (4 nodes x 4 P100, NVLink, EDR InfiniBand)",
                 "k80x64": "K80 cluster (16 nodes x 4 K80, PCIe, FDR InfiniBand)",
                 "h100": "GPT-2 small on H100s (`dgx-h100x8`, `dgx-h100x32`, `h100x64`; "
                         "first column: the topology)"}.get(cluster, cluster)
        out.append(f"**{title}**: predicted samples per second (global batch / simulated step "
                   f"time)\n\n" + md_table(header, body))
    out.append(_throughput_findings(res["rows"]))
    return "\n\n".join(out)


def _throughput_findings(rows: list[dict]) -> str:
    """What the tables say, computed from them."""
    multi = [r for r in rows if r["devices"] > 1 and "soapjax" in r]
    if not multi:
        return ""

    def speedup(r: dict, base: str = "data-parallel") -> float:
        return r["baselines"][base]["step_time_s"] / r["soapjax"]["step_time_s"]

    best = max(multi, key=speedup)
    over = [r for r in multi if speedup(r) >= 1.3]
    ties = [r for r in multi if min(e["step_time_s"] for e in r["baselines"].values()
                                    if e["fits"]) <= r["soapjax"]["step_time_s"] * (1 + 1e-9)]
    per_model = {}
    for r in multi:
        per_model[r["model"]] = max(per_model.get(r["model"], 1.0), speedup(r))
    eff = _dp_efficiency(rows, multi)
    tied_to: dict[str, int] = {}
    for r in ties:
        t = r["soapjax"]["step_time_s"]
        for name, e in r["baselines"].items():
            if e["fits"] and e["step_time_s"] <= t * (1 + 1e-9):
                tied_to[name] = tied_to.get(name, 0) + 1
    cnn = [v for (m, _), (_, v) in eff.items()
           if any(r["model"] == m and r["family"] == "cnn" for r in multi)]
    lines = [
        "**Reading the tables.**",
        f"- soapjax's plan is faster than data parallelism by up to {speedup(best):.2f}x "
        f"({best['model']} on {best['devices']} GPUs of {best['cluster']}); per model, the best "
        "speed-up over data parallelism is "
        + ", ".join(f"{m} {v:.2f}x" for m, v in per_model.items())
        + f". It reaches the paper's 1.3x in {len(over)} of {len(multi)} multi-GPU cases.",
        "- It is never slower than the best baseline that fits (every baseline starts a chain "
        f"and the best strategy seen is returned); in {len(ties)} of {len(multi)} cases it only "
        "matches one (" + ", ".join(f"{k} in {v}" for k, v in sorted(tied_to.items())) + ").",
        "- Data-parallel scaling efficiency (throughput at the most GPUs over the one-GPU "
        "throughput times the GPUs): "
        + ", ".join(f"{m} on {n} {c} {v:.0%}" for (m, c), (n, v) in eff.items()) + "."
        + (f" For the CNNs data parallelism scales at {min(cnn):.1%} of ideal or better, so "
           "no plan can do much better." if cnn and min(cnn) >= 0.9 else ""),
        "",
    ]
    reproduced = [m for m, v in per_model.items() if v >= 1.3]
    if len(reproduced) == len([m for m in per_model if m not in ("resnet101", "gpt2")]):
        lines.append(f"The paper's 1.3x or more over data parallelism is reproduced for "
                     f"{', '.join(reproduced)}.")
        return "\n".join(lines)
    return "\n".join(lines + _throughput_gap(reproduced, multi))


def _dp_efficiency(rows: list[dict],
                   multi: list[dict]) -> dict[tuple[str, str], tuple[int, float]]:
    """(model, cluster) -> (GPUs, data parallelism's scaling efficiency there) at the most GPUs:
    throughput over the one-GPU throughput times the GPUs."""
    one = {(r["model"], r["cluster"]): r for r in rows if r["devices"] == 1}
    eff: dict[tuple[str, str], tuple[int, float]] = {}
    for r in multi:
        base = one.get((r["model"], r["cluster"]))
        if base and r["devices"] > eff.get((r["model"], r["cluster"]), (0, 0.0))[0]:
            dp = r["batch"] / r["baselines"]["data-parallel"]["step_time_s"]
            ideal = base["batch"] / base["baselines"]["data-parallel"]["step_time_s"]
            eff[(r["model"], r["cluster"])] = (r["devices"], dp / (ideal * r["devices"]))
    return eff


def _throughput_gap(reproduced: list[str], multi: list[dict]) -> list[str]:
    """Why the paper's speed-ups over data parallelism are not reproduced, where they are not."""
    return [
        "**Honest gap: the paper's 1.3x to 3.3x is not reproduced** (here: "
        + (", ".join(reproduced) + (" reaches" if len(reproduced) == 1 else " reach")
           + " it, the others do not" if reproduced else "no model reaches it")
        + "). FlexFlow reports 1.3x to "
        "3.3x over data parallelism and the expert strategies for every model but ResNet-101. "
        "Four differences between this setting and the paper's are the likely reasons; each "
        "says what would test or close it:",
        "1. *A stronger data-parallel baseline.* The simulator prices data parallelism as an "
        "NCCL-style ring or hierarchical all-reduce issued as each gradient is ready and "
        "overlapped with the rest of the backward pass; with "
        + "/".join(str(b) for b in sorted({r["batch"] // r["devices"] for r in multi
                                            if r["family"] in ("cnn", "rnn")}))
        + " samples per GPU the backward pass hides much of it (the efficiencies above). "
        "The paper's data parallelism (measured on its Legion runtime, which it found as fast "
        "as TensorFlow r1.7 and PyTorch 0.3) reached at most 1/1.3 = 77% of ideal scaling "
        "wherever FlexFlow beat it by 1.3x, since no plan scales better than ideal; that left "
        "the room other strategies filled. Measuring data parallelism on real P100/K80 "
        "clusters, or a smaller batch per GPU, would show whether this is the simulator being "
        "optimistic or the 2018 baselines being weak.",
        "2. *No inter-operator placement (the O of SOAP).* Under one SPMD program every "
        "operator runs on every device; the paper's best RNN strategies (its Figure 14) put "
        "different layers on different GPUs. Stages on sub-meshes, which docs/design.md plans "
        "after the SPMD path, would add that.",
        "3. *Analytic costs.* On the P100 and K80 clusters a roofline gives a config the same "
        "time whichever dim is split; the paper measured a 38% faster channel-split matmul in "
        "NMT (section 8.2.1) that only measured GPU costs (`cost_model(mode=\"measured\")` on "
        "the target GPUs) or a kernel model fitted to those GPUs (as the H100's is) can show.",
        "4. *A coarser RNN graph.* An LSTM layer is one operator (one `lax.scan` over 40 steps) "
        "here, 40 operators in the paper, so per-step choices do not exist.",
    ]


def doc_comm(res: dict) -> str:
    n = res["devices"]
    rows = []
    for name, e in res["strategies"].items():
        per = e["bytes_per_device"]
        classes = ", ".join(f"{k} {gb(v * n)}" for k, v in sorted(e["by_link_class"].items()))
        paper = PAPER_FIG8B_GB.get(name)
        rows.append([name, gb(per), gb(per * n), classes or "-",
                     "-" if paper is None else f"{paper}", f"{e['step_time_s'] * 1e3:.1f}",
                     f"{e['compute_s'] * n:.3g}"])
    table = md_table(["strategy", "GB sent per GPU", "GB sent, all GPUs",
                      "all GPUs by link class (GB)", "paper, all GPUs (GB)", "step time (ms)",
                      "compute, all GPUs (s)"], rows)
    biggest = ", ".join(f"`{p}` {shape} ({b / 1e6:.3g} MB)"
                        for p, shape, b in res["largest_params"])
    st = res["strategies"]
    dp = st["data-parallel"]["bytes_per_device"]
    ring = 2 * (n - 1) / n * res["param_bytes"]
    top3 = sum(b for _, _, b in res["largest_params"][:3]) / res["param_bytes"]
    vocab = max(max(shape) for _, shape, _ in res["largest_params"])
    lines = [table, "",
             f"NMT here has {res['param_bytes'] / 1e6:.4g} MB of float32 parameters; the largest "
             f"are {biggest}: the three largest, the embeddings and the softmax layer over "
             f"{vocab:,}-word vocabularies, hold {top3:.0%} of them. Data parallelism all-reduces "
             "every gradient; a "
             f"ring all-reduce sends 2 (n-1)/n x {res['param_bytes'] / 1e6:.4g} MB = "
             f"{gb(ring)} GB per GPU, and the simulator counts {gb(dp)} GB per GPU. The "
             "paper's figures are totals over all GPUs (its 65.8 GB for data parallelism on 64 "
             "GPUs is about 1 GB per GPU, a ring all-reduce of about 0.5 GB of parameters), so "
             "the third column is the one to compare with the paper's. The paper does not give "
             f"its NMT's vocabulary sizes; ours are {vocab:,} words on each side "
             "(`models/rnn.py`), and a different vocabulary scales the gradient traffic of every "
             "row.",
             "",
             "The expert row is not the paper's expert strategy. The paper's puts each layer of "
             "a node's replica on its own GPU (inter-operator model parallelism inside a node, "
             "data parallelism across nodes); one SPMD program cannot place operators on single "
             "GPUs, so `soapjax.strategy.baselines.expert` splits the weights of the dense layers "
             "over a node's GPUs instead, and the operators it cannot split that way (the LSTM "
             "loops "
             "split only their batch dim, the embeddings are gathers) stay replicated on the "
             "node's GPUs: they compute the same thing four times and all-reduce their "
             "gradients across nodes whole. Hence its step time and bytes. Keeping the batch "
             "split over the node's GPUs for those operators would make it a fairer baseline."]
    if "soapjax" in st:
        mine = st["soapjax"]["bytes_per_device"]
        r_dp = dp / mine if mine else math.inf
        r_ex = st["expert"]["bytes_per_device"] / mine if mine else math.inf
        lines.append(
            f"\nsoapjax's plan sends {r_dp:.2f}x fewer bytes than data parallelism and "
            f"{r_ex:.2f}x fewer than the expert strategy (paper: 65.8 / 12.1 = 5.4x and "
            "24.2 / 12.1 = 2.0x; a factor below 1 means more bytes). "
            + ("Like the paper's, the plan cuts communication by keeping the large embedding "
               "and softmax weights split (parameter parallel) instead of all-reducing their "
               "gradients." if r_dp >= 2 else
               "Unlike the paper's, the plan does not cut communication by 2x or more: the "
               "search minimises step time, and where the backward pass hides most of the "
               "gradient all-reduce, a plan that sends fewer bytes is not much faster."))
    return "\n".join(lines)


def doc_search_cost(res: dict) -> str:
    devices = sorted({r["devices"] for r in res["table4"]})
    names = list(dict.fromkeys(r["model"] for r in res["table4"]))
    header = ["model"] + [f"{n} GPUs" for n in devices]
    rows, same, speedups = [], [], []
    for m in names:
        row: list[Any] = [m]
        for n in devices:
            r = next(r for r in res["table4"] if r["model"] == m and r["devices"] == n)
            if "error" in r:
                row.append("no plan fits")
                continue
            f, d = r["full"]["cpu_s"], r["delta"]["cpu_s"]
            paper = PAPER_TABLE4_SPEEDUP.get(m, {}).get(n)
            row.append(f"{f:.2f} / {d:.2f} = **{f / d:.1f}x**"
                       + (f" ({paper}x)" if paper else ""))
            same.append(r["same_plan"])
            speedups.append(f / d)
        rows.append(row)
    props = {r["model"]: r["full"]["proposals"] for r in res["table4"] if "full" in r}
    lines = [md_table(header, rows), "",
             "Each cell: CPU seconds (`time.process_time`) of one whole search with full "
             "simulation / with delta simulation = the speed-up (the paper's Table 4 speed-up "
             "in brackets). A search is every baseline and one random strategy as initial "
             "candidates, seed 0, at most "
             f"{res['table4'][0]['max_proposals']} proposals per chain, each chain stopping "
             "early when half of that brings no improvement; proposals are scored by full "
             "simulation (Algorithm 1) or by delta simulation (Algorithm 2). Proposals per "
             "search at the largest device count: "
             + ", ".join(f"{m} {p}" for m, p in props.items()) + ". "
             f"Full and delta simulation found the same plan in {sum(same)} of {len(same)} "
             "searches (they must: the two give bit-identical step times, so the chains are "
             "the same)."]
    if speedups:
        lines.append(_speedup_reading(res, speedups))
    if "error" not in res["fig12"]:
        lines += ["", *_figure12(res["fig12"])]
    return "\n".join(lines)


def _speedup_reading(res: dict, speedups: list[float]) -> str:
    """Delta simulation's speed-ups, by model, and why they grow with the operators."""
    ops: dict[str, tuple[int, list[float]]] = {}
    for r in res["table4"]:
        if "full" in r:
            ops.setdefault(r["model"], (r["operators"], []))[1].append(
                r["full"]["cpu_s"] / r["delta"]["cpu_s"])
    return (f"\nDelta simulation is {min(speedups):.1f}x to {max(speedups):.1f}x faster "
            "than full simulation (paper: 2.2x to 6.9x). Median speed-up by model, "
            "with its operator count: "
            + ", ".join(f"{m} {np.median(v):.1f}x ({n} operators)"
                        for m, (n, v) in ops.items())
            + ". Under one SPMD program the task graph does not grow with the device "
            "count (one compute stream, one resource per channel), so unlike the "
            "paper's the speed-up need not grow with the GPUs; it grows with the "
            "operators instead (a proposal retimes one operator's tasks and what "
            "depends on them, a full simulation rebuilds all of them).")


def _figure12(f12: dict) -> list[str]:
    """Figure 12 as a table: how soon full and delta simulation reach the final best."""
    full, delta = f12["full"], f12["delta"]
    final = delta["step_time_s"]

    def reach(h: list) -> float:
        return next(t for t, s in h if s <= final * (1 + 1e-12))

    return [f"**Figure 12: NMT on {f12['devices']} P100s.** Best simulated step time "
            "found against search time (wall-clock seconds since the search started, "
            f"same seed and at most {f12['max_proposals']} proposals per chain):", "",
            md_table(["simulation", "search time (s)", "time to reach the final best (s)",
                      "final best step (ms)", "proposals"],
                     [[k, f"{v['wall_s']:.2f}", f"{reach(v['history']):.2f}",
                       f"{v['step_time_s'] * 1e3:.3f}", v["proposals"]]
                      for k, v in (("full", full), ("delta", delta))]),
            "", "(The curve is `results/fig12_search_curve.png`; the paper's full and "
            "delta searches took 16 and 6 minutes with its per-device task graphs.)"]


def doc_quality(res: dict) -> str:
    lines = [*_global_optimum_part(res["optimum"]), "", *_local_optimality_part(res)]
    if res.get("budget"):
        lines += ["", *_longer_search_part(res["budget"])]
    return "\n".join(lines)


def _global_optimum_part(optimum: list[dict]) -> list[str]:
    """The searched plan against the global optimum, where the space can be enumerated."""
    rows = [[f"{o['model']} ({o['config']})", o["topology"],
             " x ".join(f"{a}={s}" for a, s in o["mesh"].items()), o["operators"],
             f"{o['strategies']:,}", f"{o['optimum_s'] * 1e3:.4f}",
             f"{o['found_s'] * 1e3:.4f}", "yes" if o["found_optimum"] else
             f"no (+{(o['found_s'] / o['optimum_s'] - 1) * 100:.3f}%)",
             f"{o['exhaustive_cpu_s']:.1f}", f"{o['search_cpu_s']:.1f}", o["proposals"]]
            for o in optimum]
    found = sum(o["found_optimum"] for o in optimum)
    lines = ["**Global optimum.** Branch and bound (`soapjax.search.optimality.exhaustive`, "
             "once per choice of ZeRO axes) against the MCMC search:", "",
             md_table(["model", "topology", "mesh", "operators", "strategies", "optimum (ms)",
                       "search found (ms)", "optimal?", "exhaustive CPU s", "search CPU s",
                       "proposals"], rows), "",
             f"The search found the global optimum in {found} of {len(rows)} cases. The paper "
             "cut RNNLM to 2 unrolled steps to make its space small; here an LSTM layer is one "
             "operator (one `lax.scan`) however many steps it runs, so the full 40-step model is "
             "small already. Its space is still not the paper's 10^11 strategies: a config is a "
             "split of each dim over named mesh axes, not an arbitrary device assignment."]
    misses = [o["found_s"] / o["optimum_s"] - 1 for o in optimum if not o["found_optimum"]]
    if misses:
        lines.append(f"Where the search missed, by at most {max(misses):.3%}, its chains had "
                     "stopped (half of a chain's proposal budget without improvement) next to "
                     "the optimum; more proposals per chain, or a greedy descent over all "
                     "single-operator changes at the end of each chain, would close it.")
    return lines


def _local_optimality_part(res: dict) -> list[str]:
    """Whether the searched plans are local optima: no single-operator change is faster."""
    loc = [r for r in res["local"] if "error" not in r]
    lrows = []
    for r in res["local"]:
        if "error" in r:
            lrows.append([r["model"], r["devices"], "-", "-", "-", "no plan fits", "-"])
            continue
        verdict = "yes" if r["local_optimum"] else (
            f"no: {r['operator']} -> {r['better_neighbour_s'] * 1e3:.3f} ms "
            f"({(1 - r['better_neighbour_s'] / r['step_time_s']) * 100:.2f}% faster)")
        lrows.append([r["model"], r["devices"], r["operators"], r["neighbours"],
                      f"{r['step_time_s'] * 1e3:.3f}", verdict, f"{r['check_cpu_s']:.1f}"])
    good = sum(r["local_optimum"] for r in loc)
    devs = sorted({r["devices"] for r in res["local"]})
    lines = ["**Local optimality.** Every single-operator change of the searched plan "
             f"(at most {res['proposals']} proposals per chain, seed 0) on "
             f"{', '.join(map(str, devs))} P100s (the paper: 2, 4 and 8 devices), "
             "simulated (`soapjax.search.optimality.improving_change`):", "",
             md_table(["model", "GPUs", "operators", "neighbours", "plan step (ms)",
                       "local optimum?", "check CPU s"], lrows), "",
             f"{good} of {len(loc)} searched plans are local optima (paper: all)."]
    if good < len(loc):
        lines.append("The others stop before reaching one: a chain ends after half its "
                     "proposal budget brings no improvement, and on models with hundreds of "
                     "operators a few hundred random proposals do not visit every neighbour. A "
                     "final greedy pass of `improving_change` until none is left would make "
                     "every returned plan a local optimum, at the cost of one pass over the "
                     "neighbours per improvement.")
    return lines


def _longer_search_part(budget: list[dict]) -> list[str]:
    """Whether ten times the proposals per chain finds faster plans."""
    rows = [[b["model"], b["topology"], f"{b['dp_s'] / b['short_s']:.3f}x",
             b["short_proposals"], f"{b['dp_s'] / b['long_s']:.3f}x", b["long_proposals"],
             f"{b['long_cpu_s']:.1f}"] for b in budget]
    gains = [b["short_s"] / b["long_s"] - 1 for b in budget]
    same = sum(g < 1e-3 for g in gains)
    return ["**Does a longer search help?** The same searches with 10x the proposals "
            "per chain:", "",
            md_table(["model", "topology", "speed-up over DP", "proposals",
                      "with 10x proposals", "proposals", "CPU s"], rows), "",
            f"In {same} of {len(rows)} cases ten times the search finds a plan no more "
            f"than 0.1% faster (largest gain {max(gains):.2%})"
            + (": the speed-ups of section 1 are what this simulator and this space allow, "
               "not a search cut short." if same == len(rows) else
               "; where it finds more, section 1's plans were cut short by the proposal "
               "budget.")]


def _one_device_reading(single: list[dict]) -> str:
    low = [r["model"] for r in single if r["error"] < -0.3]
    high = [r["model"] for r in single if r["error"] > 0.3]
    out = []
    if low:
        out.append(f"where it is low ({', '.join(low)}), the whole step does work that no "
                   "operator is charged for, most likely the fixed cost of running one step "
                   "(thread-pool hand-offs between XLA:CPU's kernels), a large share of steps "
                   "this small, and the equations and copies between operators.")
    if high:
        out.append(f"Where it is high ({', '.join(high)}), timing operators one by one adds "
                   "up per-operator costs that the whole step, fused by XLA across operator "
                   "boundaries, does not pay.")
    if not out:
        out.append("every model is within 30%.")
    return " ".join(out)


def _ratio_reading(multi: list[dict]) -> str:
    """Which plans the simulator under-predicts most (measured / simulated, median per plan)."""
    by_plan: dict[str, list[float]] = {}
    for r in multi:
        if "error" not in r:
            kind = "random" if r["plan"].startswith("random") else r["plan"]
            by_plan.setdefault(kind, []).append(r["measured_s"] / r["simulated_s"])
    if not by_plan:
        return ""
    med = {k: float(np.median(v)) for k, v in by_plan.items()}
    order = sorted(med, key=med.get)
    return ("Measured over simulated time, median over the models, by plan: "
            + ", ".join(f"{k} {med[k]:.1f}x" for k in order)
            + f". The simulator under-states {order[-1]} most and {order[0]} least; plans "
            "whose predicted times are close swap places when the under-statement differs "
            "between them by more than their gap.")


def doc_accuracy(res: dict) -> str:
    single = res["single"]
    rows = [[r["model"], r["operators"], f"{r['measured_s'] * 1e3:.3f}", f"{r['spread']:.0%}",
             f"{r['simulated_s'] * 1e3:.3f}", f"{r['error']:+.0%}"] for r in single]
    errs = [abs(r["error"]) for r in single]
    within = sum(e <= 0.3 for e in errs)
    lines = [f"**One device** ({res['backend']}; `tiny` configs): the whole jitted training "
             "step, timed in a loop inside one compiled program "
             "(`soapjax.cost.operators.calibrate`), against the simulated step of the unsharded "
             "plan with operator times measured on "
             "the same device in the same process (`cost_model(mode=\"measured\")`).", "",
             md_table(["model", "operators", "measured step (ms)", "spread",
                       "simulated step (ms)", "error"], rows), "",
             f"{within} of {len(single)} models are within 30% (the paper's band; the spread "
             "is (max - min) / min over the timing trials, other jobs shared the 2 cores). "
             "The simulated one-device step is the sum of the operators' forward and backward "
             "times and the optimizer updates, each timed on its own: "
             + _one_device_reading(single)
             + " Full-size models would be the fair test, but one step of most of them takes "
             "seconds to minutes on 2 CPU cores, and timing each of their operators longer "
             "still; on a GPU the same table is `soapjax calibrate` per model."]
    if res.get("multi_skipped"):
        lines += ["", f"Eight devices: skipped ({res['multi_skipped']})."]
    else:
        lines += _eight_devices_part(res)
    return "\n".join(lines)


def _eight_devices_part(res: dict) -> list[str]:
    """Plans applied on the 8 CPU devices: measured against simulated, their order, bytes."""
    multi = res["multi"]
    mrows, summary = _eight_devices_tables(multi)
    rhos = [float(s[2]) for s in summary if s[2] != "-"]
    lines = ["", "**Eight devices** (`cpu8`: 8 virtual XLA:CPU devices, mesh data=2 x model=4; "
             "`tiny` configs): each plan applied with `soapjax.check` (the sharded step against "
             "the unsharded one, the collectives XLA inserted against the simulator's, the "
             f"median of {res['repeats']} timed steps against the simulated step with measured "
             "operator costs and XLA's resharding collectives). Plans: the baselines, "
             "random strategies, and soapjax's search on `cpu8` (scored with the `cpu8` file's "
             "analytic figures: measuring every shard program a search visits takes minutes "
             "per model on this host).", "",
             md_table(["model", "plan", "measured (ms)", "simulated (ms)",
                       "measured / simulated", "XLA collective kB", "predicted kB",
                       "max abs diff vs unsharded"], mrows), "",
             *([f"Left out on 8 devices: {', '.join(res['multi_left_out'])} (about 200 "
                "operators each: every plan's prediction needs about 200 shard programs "
                "compiled and timed, minutes per plan on this host).", ""]
               if res.get("multi_left_out") else []),
             "Per model, does the simulated time order the plans as the measured time does?",
             "", md_table(["model", "plans", "Spearman rho", "median |error|",
                           "fastest simulated", "fastest measured"], summary), ""]
    if rhos:
        lines += _order_reading(rhos, multi)
    ratios = [r["predicted_bytes"] / r["hlo_bytes"] for r in multi
              if "error" not in r and r["hlo_bytes"] > 0]
    if ratios:
        lines.append(f"\nCollective bytes do not depend on the host: the simulator's predicted "
                     f"bytes per device are {min(ratios):.2f}x to {max(ratios):.2f}x what XLA "
                     f"inserted (median {np.median(ratios):.2f}x) over the {len(ratios)} plans "
                     "that communicate.")
    return lines


def _eight_devices_tables(multi: list[dict]) -> tuple[list[list], list[list]]:
    """The rows of every plan on the 8 devices, and per model a summary: plans, Spearman's rho
    of simulated against measured, median |error|, fastest plan by each."""
    mrows, summary = [], []
    for name in dict.fromkeys(r["model"] for r in multi):
        ok = [r for r in multi if r["model"] == name and "error" not in r]
        rho = spearman([r["simulated_s"] for r in ok], [r["measured_s"] for r in ok])
        best_sim = min(ok, key=lambda r: r["simulated_s"])["plan"] if ok else "-"
        best_meas = min(ok, key=lambda r: r["measured_s"])["plan"] if ok else "-"
        med = float(np.median([abs(r["error_rel"]) for r in ok])) if ok else float("nan")
        summary.append([name, len(ok), fmt(rho, 2), f"{med:.0%}", best_sim, best_meas])
        for r in multi:
            if r["model"] != name:
                continue
            if "error" in r:
                mrows.append([name, r["plan"], "-", "-", "-", "-", "-", r["error"]])
                continue
            mrows.append([name, r["plan"], f"{r['measured_s'] * 1e3:.2f}",
                          f"{r['simulated_s'] * 1e3:.2f}",
                          f"{r['measured_s'] / r['simulated_s']:.1f}",
                          f"{r['hlo_bytes'] / 1e3:,.0f}", f"{r['predicted_bytes'] / 1e3:,.0f}",
                          f"{r['max_abs_diff']:.1g}"])
    return mrows, summary


def _order_reading(rhos: list[float], multi: list[dict]) -> list[str]:
    """Whether the simulator orders the plans as they measure, and why the times differ."""
    lines = [f"Spearman's rho ranges from {min(rhos):.2f} to {max(rhos):.2f} (mean "
             f"{np.mean(rhos):.2f}; 1 means the simulator orders the plans exactly as "
             "they measure). "
             + ("The simulator does not preserve the measured order on this host. "
                if min(rhos) < 1 else "The order is preserved for every model. ")
             + "On virtual CPU devices the absolute times are not comparable, for two "
             "reasons the simulator does not model: the 8 devices share the host's "
             f"{os.cpu_count()} cores (a device's operator runs about 8/"
             f"{os.cpu_count()} times slower than it measured alone), and every "
             "XLA:CPU collective is a rendezvous of 8 threads with a fixed cost of tens "
             "of microseconds that the `cpu8` topology's links (5 GB/s, 5 us) do not "
             "carry. " + _ratio_reading(multi)]
    if min(rhos) < 1:
        lines.append(
            "\n**What would fix it.** Model the host the plans run on: a CPU topology whose "
            "virtual devices share the compute of the real cores (a device's operator "
            "time scaled by devices per core) and whose links carry the measured cost of "
            "an XLA:CPU collective (time a few collectives over each mesh axis on the "
            "attached devices and fit each axis's latency and bandwidth, as "
            "`soapjax calibrate` fits operator costs). Virtual CPU devices are a stand-in; "
            "the test that matters is `soapjax check` on a real GPU mesh, which this "
            "session did not have.")
    return lines


SECTION_DOCS = {
    "throughput": (
        "1. Per-iteration performance (paper Figure 7)", doc_throughput,
        "Predicted training throughput, samples per second = global batch / simulated step time, "
        "of data parallelism, the paper's expert strategies (CNNs: data parallel convolutions, "
        "model parallel dense layers; RNNs: data parallel across nodes, layers split within a "
        "node), Megatron-style tensor parallelism, fully sharded data parallelism (FSDP) and "
        "soapjax's searched plan. The batch follows the paper (section 8.1: 64 samples, 256 for "
        "AlexNet) **per GPU**: the global batch grows with the GPUs, which is how we read Figure "
        "7, whose dashed ideal lines scale linearly. P100 and K80 clusters are the paper's "
        "(`soapjax/topology/meshes/p100x16.toml`, `soapjax/topology/meshes/k80x64.toml`), cut to "
        "fewer GPUs by "
        "`soapjax.topology.cluster.scaled_topology` (2 GPUs: two of one node; 8: two nodes). "
        "Costs are **analytic** (no P100, K80 or H100 is attached): on the P100 and K80 clusters a "
        "roofline of each device's datasheet figures (their topology files have no kernel "
        "table, so those times are lower bounds at 100% of peak); on the H100s the GPU kernel "
        "model of the topologies' `[device.kernels]` table (`soapjax.cost.kernels`: GEMMs at a "
        "fitted fraction of peak with tile and wave quantisation, memory-bound kernels at the "
        "achieved HBM bandwidth, launch overhead; docs/accuracy.md) and NCCL at 0.8 of each "
        "link's line rate. Communication uses the ideal resharding model. OOM marks a strategy "
        "that does not fit in device memory (the search never returns one)."),
    "comm": (
        "2. Communication (paper Figure 8)", doc_comm,
        "Bytes transferred per iteration for NMT on 64 K80s (16 nodes), from the simulated "
        "step (`SimResult.bytes_moved`, the bytes each device sends; every device sends the same "
        "under SPMD), beside the paper's Figure 8b. Step time (Figure 8a) and compute time summed "
        "over the GPUs (Figure 8c) are in the last columns. Costs: analytic."),
    "search": (
        "3. Search cost (paper Table 4 and Figure 12)", doc_search_cost,
        "End-to-end search time with full and with delta simulation, per model, on the K80 "
        "cluster cut to 4 to 64 GPUs (batch per GPU as in section 1). Both modes walk the same "
        "chain (same seed, same proposal budget), so the ratio is the simulator's speed-up "
        "inside a real search. Costs: analytic."),
    "quality": (
        "4. Search quality (paper section 8.4)", doc_quality,
        "Is the searched plan the global optimum where the space can be enumerated, and a local "
        "optimum (no single-operator change is faster) elsewhere? Costs: analytic."),
    "accuracy": (
        "5. Simulator accuracy (paper Figure 11)", doc_accuracy,
        "Simulated against measured step times on the devices actually attached to the machine "
        "that ran this script. Costs: **measured** (every operator's shard program timed on the "
        "local device, in this process)."),
}
