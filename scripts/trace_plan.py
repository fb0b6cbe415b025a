"""How often a plan enters each soapjax module on its way through a command (issue 30).

Runs a command line (default: ``soapjax check`` of tiny GPT-2's plan on ``cpu8``) under
`sys.setprofile` and counts, per module, the calls into it from another module that carry the
plan in flight: an argument that is the `Plan`, a `Strategy` or a checked one (not ``self``: a
method of the plan's own class is its behaviour, not a stage). A plan that
bounces between modules (validated at six entry points, converted from names three times)
enters some of them many times; one that flows through the stages enters each a few times.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python scripts/trace_plan.py
    python scripts/trace_plan.py --max 3          # exit 1 if a module is entered more often
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import io
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from soapjax import cli  # noqa: E402
from soapjax.apply.step import Checked  # noqa: E402
from soapjax.strategy.plan import Plan  # noqa: E402
from soapjax.strategy.space import Strategy  # noqa: E402


def _carries_plan(frame) -> bool:
    """Whether an argument of the call is the plan in flight (a method of the Plan or
    Strategy itself, called on it as ``self``, is the data's own behaviour: not counted)."""
    code = frame.f_code
    names = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
    return any(isinstance(frame.f_locals.get(n), (Plan, Strategy, Checked))
               for n in names if n not in ("self", "cls"))


def trace_entries(argv: list[str], calls: list | None = None) -> collections.Counter:
    """Calls into each soapjax module, from another module, with the plan in flight (and,
    into `calls`, each such call as ``caller module.function -> callee module.function``)."""
    entries: collections.Counter = collections.Counter()

    def profile(frame, event, arg):
        if event != "call":
            return
        callee = frame.f_globals.get("__name__", "")
        if not callee.startswith("soapjax.") or frame.f_back is None:
            return
        caller = frame.f_back.f_globals.get("__name__", "")
        if caller != callee and _carries_plan(frame):
            entries[callee] += 1
            if calls is not None:
                calls.append(f"{caller}.{frame.f_back.f_code.co_name} -> "
                             f"{callee}.{frame.f_code.co_name}")

    sys.setprofile(profile)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            cli.main(argv)
    finally:
        sys.setprofile(None)
    return entries


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", action="store_true", help="list every counted call")
    ap.add_argument("--max", type=int, default=None,
                    help="exit 1 if the plan enters a module more often than this")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        plan = str(Path(tmp) / "gpt2-tiny.json")
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            cli.main(["plan", "--model", "gpt2", "--size", "tiny", "--mesh", "cpu8", "--costs",
                      "analytic", "--proposals", "50", "--out", plan])
        calls: list[str] = []
        entries = trace_entries(["check", "--plan", plan, "--costs", "analytic",
                                 "--repeats", "1"], calls)
    print("# soapjax check of GPT-2 tiny's plan on cpu8: calls into each module carrying the "
          "plan (a Plan or Strategy argument), from another module")
    for module, n in entries.most_common():
        print(f"{n:4d}  {module}")
    if args.calls:
        print("\n".join(calls))
    worst = max(entries.values(), default=0)
    return 1 if args.max is not None and worst > args.max else 0


if __name__ == "__main__":
    sys.exit(main())
