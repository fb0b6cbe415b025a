"""The figures of the results doc (matplotlib, the ``eval`` extra), one function per figure."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from soapjax_eval.modes import PAPER_FIG8B_GB
from soapjax_eval.tables import by_cluster, expert_name, throughput


def plot_all(results: dict, folder: Path) -> list[str]:
    """Writes the figures of the sections in `results` as PNG files in `folder`; returns their
    names ([] without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    folder.mkdir(parents=True, exist_ok=True)
    made = []
    figures = {"throughput": _throughput_figures, "comm": _comm_figure,
               "search": _search_figure, "accuracy": _accuracy_figure}
    for section, draw in figures.items():
        if section not in results:
            continue
        for name, fig in draw(plt, results[section]):
            fig.tight_layout()
            fig.savefig(folder / name, dpi=110)
            plt.close(fig)
            made.append(name)
    return made


def _throughput_figures(plt, res: dict):
    """Figure 7: predicted samples per second against GPUs, one figure per cluster."""
    for cluster, rows in by_cluster(res["rows"]).items():
        names = list(dict.fromkeys(r["model"] for r in rows))
        cols = min(3, len(names))
        nrows = -(-len(names) // cols)
        fig, axes = plt.subplots(nrows, cols, figsize=(3.6 * cols, 3.0 * nrows), squeeze=False)
        for ax in axes.flat[len(names):]:
            ax.set_visible(False)
        for ax, name in zip(axes.flat, names):
            _throughput_panel(ax, sorted((r for r in rows if r["model"] == name),
                                         key=lambda r: r["devices"]), name)
        for row in axes:
            row[0].set_ylabel("samples/s (predicted)", fontsize=8)
        axes.flat[len(names) - 1].legend(fontsize=7)
        yield f"fig7_throughput_{cluster}.png", fig


def _throughput_panel(ax, mine: list[dict], name: str) -> None:
    """One model's throughput against GPUs: the baselines, soapjax, and ideal scaling."""
    xs = [r["devices"] for r in mine]
    series = {"data parallel": "data-parallel", "expert": expert_name(mine[0]),
              "Megatron": "megatron" if mine[0]["family"] == "transformer" else None}
    for label, key in series.items():
        if key:
            ax.plot(xs, [throughput(r["baselines"].get(key), r["batch"]) or np.nan
                         for r in mine], "o-", label=label, ms=3)
    ys = [r["batch"] / r["soapjax"]["step_time_s"] if "soapjax" in r else np.nan for r in mine]
    ax.plot(xs, ys, "s-", label="soapjax", ms=3)
    if mine[0]["devices"] == 1 and not np.isnan(ys[0]):
        ax.plot(xs, [ys[0] * x for x in xs], "k--", lw=0.8, label="ideal")
    ax.set_xscale("log", base=2)
    ax.set_title(name, fontsize=9)
    ax.set_xlabel("GPUs", fontsize=8)
    ax.tick_params(labelsize=7)


def _comm_figure(plt, res: dict):
    """Figure 8b: bytes per iteration for NMT, ours beside the paper's."""
    names = list(res["strategies"])
    ours = [res["strategies"][k]["bytes_per_device"] * res["devices"] / 1e9 for k in names]
    paper = [PAPER_FIG8B_GB.get(k, np.nan) for k in names]
    fig, ax = plt.subplots(figsize=(4.5, 3.2))
    x = np.arange(len(names))
    ax.bar(x - 0.2, ours, 0.4, label="soapjax (simulated)")
    ax.bar(x + 0.2, paper, 0.4, label="paper (FlexFlow)")
    ax.set_xticks(x, names, fontsize=8)
    ax.set_ylabel("GB per iteration, all GPUs", fontsize=8)
    ax.set_title(f"NMT on {res['devices']} K80s", fontsize=9)
    ax.legend(fontsize=7)
    yield "fig8b_nmt_bytes.png", fig


def _search_figure(plt, res: dict):
    """Figure 12: the best simulated step against search time, full and delta simulation."""
    f12 = res["fig12"]
    if "error" in f12:
        return
    fig, ax = plt.subplots(figsize=(4.5, 3.2))
    for key in ("full", "delta"):
        h = f12[key]["history"]
        ts = [t for t, _ in h] + [f12[key]["wall_s"]]
        ss = [s * 1e3 for _, s in h] + [h[-1][1] * 1e3]
        ax.step(ts, ss, where="post", label=f"{key} simulation")
    ax.set_xlabel("search time (s)", fontsize=8)
    ax.set_ylabel("best simulated step (ms)", fontsize=8)
    ax.set_title(f"NMT on {f12['devices']} P100s", fontsize=9)
    ax.legend(fontsize=7)
    yield "fig12_search_curve.png", fig


def _accuracy_figure(plt, acc: dict):
    """Figure 11: simulated against measured step times, with the 30% band."""
    fig, ax = plt.subplots(figsize=(4.8, 4.2))
    pts = [(r["measured_s"], r["simulated_s"]) for r in acc["single"]]
    ax.scatter(*zip(*pts), marker="o", label="1 device", s=14)
    multi = [r for r in acc["multi"] if "error" not in r]
    for name in dict.fromkeys(r["model"] for r in multi):
        mine = [(r["measured_s"], r["simulated_s"]) for r in multi if r["model"] == name]
        ax.scatter(*zip(*mine), marker="^", s=14, label=f"{name}, 8 CPU devices")
    allv = [v for p in pts for v in p] + [v for r in multi for v in
                                           (r["measured_s"], r["simulated_s"])]
    lo, hi = min(allv) / 2, max(allv) * 2
    ax.plot([lo, hi], [lo, hi], "k-", lw=0.8)
    ax.plot([lo, hi], [lo * 1.3, hi * 1.3], "k--", lw=0.6)
    ax.plot([lo, hi], [lo / 1.3, hi / 1.3], "k--", lw=0.6)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured step (s)", fontsize=8)
    ax.set_ylabel("simulated step (s)", fontsize=8)
    ax.legend(fontsize=6)
    yield "fig11_accuracy.png", fig
