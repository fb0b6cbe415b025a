"""The flat simulation's attention pricing (a part of `soapjax.simulate._flatsim.Simulation`):
an attention operator whose keys' sequence is split, run as ring attention (its sends and its
work) or balanced by zigzag's chunks where it is causal.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from soapjax.base.attention import ring_work, zigzag_sends
from soapjax.cost.kernels import causal_tiles
from soapjax.graph._inner import (
    attention_call_of,
    attention_unit,
    query_dims,
)
from soapjax.simulate._flat_memory import shard_bytes
from soapjax.simulate._taskgraph import Comm
from soapjax.strategy.memory import (
    microbatch_shape,
)
from soapjax.strategy.space import (
    Config,
)

__all__: list[str] = []


class _Ring(NamedTuple):
    """An attention operator run as ring attention (`Simulation._ring_of`)."""

    keys: int  # the iteration dim of the keys' sequence
    seq: tuple[str, ...]  # the axes of the ring
    cp: int
    work: float  # its compute against the gathered form's

    def specs(self, op: Any, specs: tuple, partials: tuple) -> tuple[tuple, tuple]:
        """The operands' layouts and cotangent partial axes under the ring: the keys' and
        values' sequence split over the ring's axes (nothing gathered), their cotangents whole
        (the ring carries them home)."""
        new_specs, new_partials = [], []
        for x, spec, partial in zip(op.inputs, specs, partials):
            if self.keys in x.dims:
                spec = tuple(self.seq if d == self.keys else a for d, a in zip(x.dims, spec))
                partial = tuple(a for a in partial if a not in self.seq)
            new_specs.append(spec)
            new_partials.append(partial)
        return tuple(new_specs), tuple(new_partials)


class _AttentionPricing:
    """Ring and zigzag attention of a `Simulation`: what each sends and computes."""

    def _ring_of(self, j: int, config: Config) -> _Ring | None:
        """How operator `j` runs as ring attention under `config` (`Strategy.ring_attention`),
        or None: not a ring strategy, not an attention operator, its queries not split."""
        if not self._ring:
            return None
        dims = query_dims(self.graph, j)
        if dims is None or not config.axes[dims.sequence]:
            return None
        seq = tuple(config.axes[dims.sequence])
        cp = self.mesh.degree(seq)
        causal = attention_call_of(self.graph, j).causal
        # the synchronous ring over contiguous blocks against a balanced causal split
        work = ring_work(cp) / 0.5 if causal else 1.0
        return _Ring(dims.keys, seq, cp, work)

    def _ring_chain(self, j: int, ring: _Ring, specs: tuple, *, backward: bool
                    ) -> tuple[Comm, ...]:
        """The ring's sends, each microbatch (`soapjax.base.attention.ring_sends`): forward, the key
        block, the value block and the key positions, backward the keys' and values'
        cotangents; one task per tensor for its cp - 1 steps (its time and bytes sent cp - 1
        times one send's, its buffer one block). Priced one after another, after the
        operator's own task: what the ring overlaps with its blocks' computation is not
        credited."""
        op = self.graph.operators[j]
        kv = [(x, spec) for x, spec in zip(op.inputs, specs) if ring.keys in x.dims]
        sends = []
        for x, spec in kv:
            shape = microbatch_shape(x.shape, x.dims, self._sample[j], self._micro)
            sends.append(shard_bytes(shape, spec, x.dtype, self.mesh))
        if not backward and kv:
            length = kv[0][0].shape[kv[0][0].dims.index(ring.keys)]
            sends.append(4 * length // ring.cp)
        out = []
        for nbytes in sends:
            c = self._pricing.comm("collective_permute", nbytes, ring.seq)
            if c is not None:
                steps = ring.cp - 1
                out.append(c._replace(dur=c.dur * steps, sent=c.sent * steps))
        return self._per_microbatch(tuple(out))

    def _split_causal_attention(self, j: int, config: Config):
        """Operator `j`'s `soapjax.graph._inner.QueryDims` where it is a causal attention whose
        query sequence `config` splits; else None."""
        dims = query_dims(self.graph, j)
        if dims is None or not config.axes[dims.sequence] or \
                not attention_call_of(self.graph, j).causal:
            return None
        return dims

    def _whole_tiles(self, j: int, config: Config) -> float:
        """Operator `j`'s compute against its priced kernel where every tile of a causal
        attention is computed (a pipeline stage's sequence-split attention): 1 /
        `soapjax.cost.kernels.causal_tiles` of its keys; else 1."""
        if not self._whole_queries or self._split_causal_attention(j, config) is None:
            return 1.0
        unit = self.graph.program.units[attention_unit(self.graph, j)]
        return 1.0 / causal_tiles(self.graph.program.shapes[unit.ins[1]][1])

    def _zigzag_chain(self, j: int, config: Config) -> tuple[Comm, ...]:
        """The sends that balance causal attention under the gathered form of context
        parallelism (`soapjax.apply._context_parallel`: `soapjax.base.attention.zigzag_sends`), each
        microbatch: each half of the query block to the device that computes it, each half of
        the output back; backward, the same of their cotangents. Its compute is priced
        balanced (the kernel's causal tiles over the whole sequence, `soapjax.cost.kernels`)."""
        dims = self._split_causal_attention(j, config)
        if dims is None:
            return ()
        seq = tuple(config.axes[dims.sequence])
        sends = zigzag_sends(self.mesh.degree(seq))
        prog = self.graph.program
        unit = prog.units[attention_unit(self.graph, j)]
        iteration = (dims.batch, dims.sequence, dims.heads, None)
        spec = tuple(tuple(config.axes[d]) if d is not None else () for d in iteration)
        out = []
        for value in (unit.ins[0], unit.outs[0]):  # the queries, the output
            shape = microbatch_shape(prog.shapes[value], iteration, self._sample[j], self._micro)
            if shape[1] % (2 * self.mesh.degree(seq)):
                return ()  # apply keeps the contiguous blocks (`_context_parallel`)
            half = shard_bytes(shape, spec, prog.dtypes[value], self.mesh) / 2
            for pairs in (sends.even, sends.odd):
                c = self._pricing.comm("collective_permute", half, seq) if pairs else None
                if c is not None:
                    out.append(c)
        return self._per_microbatch(tuple(out))
