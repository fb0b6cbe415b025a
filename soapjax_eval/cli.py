"""The command line of the evaluation (``python scripts/evaluate.py``): runs the sections,
writes results.json, the figures and the doc."""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path
from typing import Any

import soapjax_eval
from soapjax_eval.experiments import RUNNERS, Progress, Workbench
from soapjax_eval.modes import FULL, SECTIONS, TINY
from soapjax_eval.render import ROOT, machine, rerender, system_load, write_outputs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=soapjax_eval.__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true",
                    help="tiny configs, few devices and proposals (seconds; what the test runs)")
    ap.add_argument("--out", default=str(ROOT / "docs"),
                    help="folder for results.md and results/ (default: docs/)")
    ap.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    ap.add_argument("--render", metavar="RESULTS_JSON",
                    help="run nothing: rewrite results.md and the figures in --out from a "
                         "previous run's results.json (its numbers, command, date and machine)")
    args = ap.parse_args(argv)
    if args.render:
        return rerender(Path(args.render), Path(args.out), argv)
    given = sys.argv[1:] if argv is None else argv
    mode = TINY if args.tiny else FULL
    out = Path(args.out)
    progress = Progress()
    meta = {"command": " ".join(["python scripts/evaluate.py", *given]),
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "mode": mode.name, "config": mode.config, "load_start": system_load(),
            "section_s": {}}
    results = _run_sections(Workbench(mode, progress), args.sections, meta, out / "results")
    meta["machine"] = machine()
    progress("done", "writing results")
    figures = write_outputs(out, results, meta, data={"meta": meta, "results": results})
    (out / "results" / "results.partial.json").unlink(missing_ok=True)
    progress("done", f"wrote {out / 'results.md'} and {len(figures)} figures "
                     f"in {meta['run_s'] / 60:.1f} min")
    progress.done()
    return 0


def _run_sections(bench: Workbench, sections: list[str], meta: dict,
                  figdir: Path) -> dict[str, Any]:
    """Runs the chosen sections in the doc's order, timing each into `meta`; keeps what it has
    in ``results.partial.json`` as it goes, so a long run stopped half way keeps what it found."""
    figdir.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    t0 = time.perf_counter()
    for sec in SECTIONS:
        if sec in sections:
            s0 = time.perf_counter()
            results[sec] = RUNNERS[sec](bench)
            meta["section_s"][sec] = time.perf_counter() - s0
            (figdir / "results.partial.json").write_text(
                json.dumps({"meta": meta, "results": results}, indent=1, default=str))
    meta["run_s"] = time.perf_counter() - t0
    return results
