"""Evaluation: the FlexFlow paper's experiments (section 8) reproduced with soapjax.

A thin entry point over `soapjax_eval` (its docstring says what runs and how long)::

    python scripts/evaluate.py                        # everything, ~30 min on 2 cores
    python scripts/evaluate.py --tiny --out /tmp/ev   # tiny configs, seconds (the test's mode)
    python scripts/evaluate.py --sections comm search --out /tmp/ev
    python scripts/evaluate.py --render docs/results/results.json   # re-render, run nothing
"""

from __future__ import annotations

import os
import sys

_FLAG = "--xla_force_host_platform_device_count"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):  # 8 CPU devices for the accuracy section
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}=8".strip()

from soapjax_eval.cli import main  # after XLA_FLAGS: jax reads them when imported

if __name__ == "__main__":
    sys.exit(main())
