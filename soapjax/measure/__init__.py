"""Stage 4, measuring on the attached devices: timing compiled programs, the devices and links as
they are, compiled HLO read as data.

- `_hlo_flops`: The FLOPs of a compiled program, recounted from its HLO text by XLA's rules, loops
  unrolled.
- `_hlo_text`: HLO text as data: computations of instructions, how often each runs, types, device
  groups.
- `_reshard_worker`: The compiling subprocess of `soapjax.cost.reshard`: both ends of its JSON-
  lines protocol.
- `_timing`: Timing compiled programs on the local backend, with the dispatch overhead amortised.
- `devices`: The attached devices against a topology's: can its operator times be measured here?
- `hlo`: The collectives in compiled (post-SPMD) HLO text, and the mesh axes they run over.
- `links`: Measured collectives and shared compute: what the attached devices really cost.
- `stepprofile`: Where a compiled step's device time goes: its kernels, read from a `jax.profiler`
  trace.

The timing loop every measurement runs is public here, for the scripts that time kernels:
`time_loop`, `kick` (makes a loop's iterations depend on each other) and `quiet_gc` (Python's
garbage collector held off while timing).
"""

from soapjax.measure._timing import (
    kick as kick,
    quiet_gc as quiet_gc,
    time_loop as time_loop,
)

__all__ = ["kick", "quiet_gc", "time_loop"]
