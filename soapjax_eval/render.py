"""The results doc: its header (command, date, machine, cost sources), every section run, and
the figures; written after a run, or rewritten from a finished run's results.json."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import jax

from soapjax_eval.figures import plot_all
from soapjax_eval.modes import SECTIONS
from soapjax_eval.sections import SECTION_DOCS
from soapjax_eval.tables import md_table

ROOT = Path(__file__).resolve().parent.parent


def machine() -> dict:
    import jaxlib

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    devs = jax.devices()
    kinds = sorted({f"{d.platform} ({d.device_kind})" for d in devs})
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, check=False,
                                capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {"platform": platform.platform(), "cpu": cpu, "cores": os.cpu_count(),
            "python": platform.python_version(), "jax": jax.__version__,
            "jaxlib": jaxlib.__version__, "devices": f"{len(devs)} x {', '.join(kinds)}",
            "gpu": any(d.platform in ("gpu", "cuda", "rocm") for d in devs),
            "commit": commit or "unknown", "load": system_load()}


def system_load() -> str:
    try:
        return " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def write_doc(path: Path, results: dict, meta: dict, figures: list[str], figdir: str) -> None:
    m = meta["machine"]
    gpu_note = ("A GPU is attached: the one-device accuracy below ran on it."
                if m["gpu"] else
                "**No GPU was attached to this machine** (none was lent to the session that "
                "ran it), so every GPU figure below is a prediction from analytic costs (a "
                "roofline for the P100 and K80, the fitted GPU kernel model for the H100), and "
                "simulator accuracy is measured on the CPU only.")
    head = [
        "# Results: the FlexFlow paper's experiments, reproduced with soapjax", "",
        "Written by `scripts/evaluate.py`; every number below comes from the run described "
        "here (rerun the command to regenerate; do not edit by hand). The paper is Jia, "
        "Zaharia, Aiken, *Beyond Data and Model Parallelism for Deep Neural Networks*, SysML "
        "2019, section 8; its numbers appear only where labelled as the paper's.", "",
        md_table(["", ""], [
            ["command", f"`{meta['command']}`"],
            ["date", meta["date"]],
            ["machine", f"{m['platform']}; {m['cpu']}, {m['cores']} cores"],
            ["software", f"python {m['python']}, jax {m['jax']}, jaxlib {m['jaxlib']}; soapjax "
                         f"commit {m['commit']}"],
            ["devices", m["devices"]],
            ["mode", f"{meta['mode']} (zoo configs `{meta['config']}`)"],
            ["run time", f"{meta['run_s'] / 60:.1f} min ("
                         + ", ".join(f"{k} {v:.0f} s" for k, v in meta["section_s"].items())
                         + ")"],
            ["load average", f"{meta['load_start']} at the start, {m['load']} at the end "
                             "(other jobs shared the machine; search times are CPU times)"],
            *([["earlier run", _carried_note(meta["carried"])]] if meta.get("carried") else []),
            *([["rendered", f"this text and the figures were rewritten from that run's "
                            f"`results/results.json` by `{meta['rendered']}`; every number is "
                            "the run's"]] if meta.get("rendered") else []),
        ]), "", gpu_note, ""]
    body = []
    for sec in SECTIONS:
        if sec not in results:
            continue
        title, doc, intro = SECTION_DOCS[sec]
        source = "measured" if sec == "accuracy" else "analytic"
        run, rm = meta, m  # a section carried over from an earlier run names that run
        if sec in meta.get("carried", {}):
            run = meta["carried"][sec]
            rm = run["machine"]
        body += [f"## {title}", "", intro, "",
                 f"*Made by `{run['command']}` on {run['date']}, {rm['cpu']} "
                 f"({rm['cores']} cores), jax {rm['jax']}, soapjax commit {rm['commit']}; "
                 f"cost source: {source}.*", "",
                 doc(results[sec]), ""]
        figs = [f for f in figures if f.startswith(_FIG_PREFIX[sec])]
        body += [f"![{f}]({figdir}/{f})" for f in figs]
        if figs:
            body.append("")
    if not figures:
        body += ["*(No figures: matplotlib is not installed; `pip install -e .[eval]`.)*", ""]
    path.write_text("\n".join(head + body))


def _carried_note(carried: dict) -> str:
    """Which sections a results.json carries over from earlier runs (its ``meta.carried``: the
    section's results copied from an earlier run's results.json, with that run's command, date
    and machine), for the doc's header."""
    runs: dict[tuple, list[str]] = {}
    for sec, c in carried.items():
        key = (c["date"], c["machine"]["commit"], c["command"])
        runs.setdefault(key, []).append(f"{SECTIONS.index(sec) + 1} ({sec})")
    return "; ".join(
        f"section{'s' if len(secs) > 1 else ''} {' and '.join(secs)} carried over unchanged "
        f"from the run of {date} at commit {commit} (`{command}`; its results copied into this "
        "run's results.json)" for (date, commit, command), secs in runs.items()
    ) + "; the run time above is this run's sections only"


_FIG_PREFIX = {"throughput": "fig7", "comm": "fig8", "search": "fig12", "quality": "none",
               "accuracy": "fig11"}


def write_outputs(out: Path, results: dict, meta: dict, *, data: dict | None = None) -> list[str]:
    """Writes the figures, ``results/results.json`` (`data`, default the run's meta and results;
    None to leave the file alone) and ``results.md`` in folder `out`; returns the figures."""
    figdir = out / "results"
    figdir.mkdir(parents=True, exist_ok=True)
    figures = plot_all(results, figdir)
    if data is not None:
        (figdir / "results.json").write_text(json.dumps(data, indent=1, default=str))
    write_doc(out / "results.md", results, meta, figures, "results")
    return figures


def rerender(source: Path, out: Path, argv: list[str] | None) -> int:
    """Rewrites the doc and figures from a finished run's results.json (runs nothing)."""
    data = json.loads(source.read_text())
    meta, results = data["meta"], data["results"]
    given = sys.argv[1:] if argv is None else argv
    meta["rendered"] = " ".join(["python scripts/evaluate.py", *given])
    same_file = source.resolve() == (out / "results" / "results.json").resolve()
    figures = write_outputs(out, results, meta, data=None if same_file else data)
    print(f"rendered {out / 'results.md'} and {len(figures)} figures from {source}",
          file=sys.stderr)
    return 0
