"""Evaluation: the FlexFlow paper's experiments (section 8) reproduced with soapjax.

One command runs every experiment and writes ``docs/results.md`` (every table with the command
that made it, the date, the machine and the cost source), the raw numbers as
``docs/results/results.json`` and, when matplotlib is installed (the ``eval`` extra), the
figures as ``docs/results/*.png``:

1. ``throughput`` (paper Figure 7): predicted training throughput of data parallelism, the
   expert strategies, Megatron, FSDP and soapjax's searched plan for the paper's six models on
   the P100 and K80 clusters at 1 to 16 (64) GPUs, and GPT-2 on the H100 topologies.
2. ``comm`` (Figure 8): bytes moved per iteration for NMT on 64 K80s, beside the paper's.
3. ``search`` (Table 4, Figure 12): search time with full and with delta simulation; the
   best-found-step-time-vs-search-time curve for NMT on 16 P100s.
4. ``quality`` (section 8.4): the global optimum on small cases (branch and bound), local
   optimality of the searched plans on 2, 4 and 8 devices.
5. ``accuracy`` (Figure 11): simulated against measured step times on the attached devices:
   one device for every zoo model, several plans per model on 8 (virtual CPU) devices.

Usage::

    python scripts/evaluate.py                        # everything, ~30 min on 2 cores
    python scripts/evaluate.py --tiny --out /tmp/ev   # tiny configs, seconds (the test's mode)
    python scripts/evaluate.py --sections comm search --out /tmp/ev
    python scripts/evaluate.py --render docs/results/results.json   # re-render, run nothing

A progress line on stderr says where the run is. Sections not run are left out of the doc.

The package, in the order a run goes: `modes` (how big a run is, the paper's quoted numbers),
`experiments` (each section's runner over a shared `experiments.Workbench`), `sections` (each
section's tables and the reading of them), `figures`, `render` (the doc, its header and the
re-render from a results.json) and `cli` (the command line). It sits above the library, like the
zoo: it imports `soapjax` and `soapjax_zoo`, and `soapjax` never imports it.
"""
