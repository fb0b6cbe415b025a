"""The arrays a traced function closes over: the constants of its jaxpr.

A loss that captures arrays (a table, or a LoRA's whole base model) has the step embed them
as constants: whole on every device, where no plan can split them. `constant_bytes` counts
them (the simulator's memory holds them on every device: `MemoryBreakdown.constants`), and
`warn_of_constants` says so at trace time where they are big beside the parameters, with what
to do instead.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import numpy as np

from soapjax.base._dtypes import is_key, itemsize
from soapjax.graph._ir import LeafInfo
from soapjax.graph._program import Program

__all__ = ["constant_bytes", "warn_of_constants"]


def constant_bytes(program: Program) -> int:
    """Bytes of `program`'s constants (PRNG keys left out)."""
    return sum(math.prod(np.shape(c)) * itemsize(c.dtype)
               for c in program.consts.values() if not is_key(str(c.dtype)))


# Closed-over arrays worth a warning: at least this many bytes, and this share of the parameters'.
_CONSTANT_WARNING_BYTES = 1 << 20
_CONSTANT_WARNING_SHARE = 0.1


def warn_of_constants(program: Program, params: Sequence[LeafInfo], fname: str) -> None:
    """Warns where `fname` closes over arrays big beside its parameters (a LoRA's base model
    captured by the loss): the step embeds them as constants, whole on every device, where no
    plan can split them; passed as parameters and frozen, a plan can."""
    consts = [c for c in program.consts.values() if not is_key(str(c.dtype))]
    nbytes = constant_bytes(program)
    held = sum(math.prod(leaf.shape) * itemsize(leaf.dtype) for leaf in params)
    if nbytes < max(_CONSTANT_WARNING_BYTES, _CONSTANT_WARNING_SHARE * held):
        return
    big = max(consts, key=lambda c: math.prod(np.shape(c)))
    warnings.warn(
        f"{fname} closes over {len(consts)} array(s) of {_mb(nbytes)} (the largest "
        f"{np.dtype(big.dtype).name}{list(np.shape(big))}), beside {_mb(held)} of parameters: "
        "the step embeds them as constants, whole on every device, and no plan can split "
        "them (the plan's memory counts them so). Pass large arrays as parameters instead: "
        "frozen ones (a base model under LoRA) with optax.set_to_zero() under "
        "optax.multi_transform, which soapjax computes no gradient for (docs/apply.md)",
        stacklevel=3)


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.4g} MB"
