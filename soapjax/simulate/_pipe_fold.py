"""One pipeline stage's simulation on a few of its layers: what the search prices a pipeline with;
and the cost models a stage's simulation reads (`StageCosts`, a folded graph's `_FoldedCosts`).

A pipeline's stage simulation (`soapjax.simulate.pipesim`) runs the whole graph on one stage's
devices, every layer of it: GPT 175B's 96 layers are ~6,000 tasks, and a chain's proposal
(the operator at one position of every layer, `soapjax.search._chain`) rebuilds and retimes all
of them. The layers of a scan are alike and a chain keeps them tied (one config and recompute
policy per position), so the stage's timeline is periodic in them: after the first layer (the
embedding before it) each layer's forward takes the same time, each layer's backward too, but
for the last (the head after it). `FoldedStage` simulates two graphs that keep only the first
``K`` layers (`FOLD_LAYERS`: 3 and 4; the epilogue reads the last kept layer where it read the
last layer: `folded_graph`) and reads the whole graph's timeline, memory and layouts off them:

* **forward ends**: the kept layers' but the last are the whole graph's (the forward runs in
  program order: a prefix); later layers' step by the last of those layers' forward span, per
  position; the last layer's by the last kept layer's (whose readers are the epilogue's, as the
  last layer's are: a row-parallel matmul's reduce-scatter is made in its readers' layout);
* **backward ends, the epilogue's and the prologue's, the timeline's end, parameter, gradient,
  optimizer-state and activation bytes**: linear in the layer count, read off the two graphs
  (``X(L) = X(K2) + (L - K2) (X(K2) - X(K1))``); the middle layers' backward ends step by one
  middle layer's backward span, per position; the first layer's by its own;
* **per operator, what its config decides** (its config, layouts, kept activation bytes, the
  seconds of its gradient synchronisations, its parameters' stored bytes): the kept layer at the
  same place (the first, the last, or a middle one).

This is exact where the timeline is periodic after the first layer and before the last (the
usual case: tests/test__pipe_fold.py and docs/vs-experts.md measure the folded price against
the whole one); a communication backlog that builds up over the layers is
linear in their count and so extrapolated too. The search prices its pipelines with it
(`soapjax.search.pipelines`); the plan it returns is priced whole
(`soapjax.simulate.front.simulate`, which never folds).

A strategy whose layers are not tied cannot be folded: proposals must change every layer at a
position alike (`PlanError` otherwise). Delta and full simulation of each folded graph are the
`Simulation`'s own, so they stay bit-identical here too.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

from soapjax.base.errors import PlanError
from soapjax.graph.opgraph import Operator, OpGraph
from soapjax.simulate._flatsim import Simulation
from soapjax.simulate._simresult import Kept, MemoryBreakdown
from soapjax.simulate._taskgraph import Comm
from soapjax.strategy.space import Config, MeshShape, Strategy

__all__ = ["FOLD_LAYERS", "MIN_LAYERS", "FoldedStage", "LayerFold", "StageCosts", "folded_graph",
           "layer_fold", "tied"]

# The layers the two folded graphs keep (K1, K2 = K1 + 1): the first layer, a middle one whose
# spans are periodic (the timeline's transient after the embedding is one layer), the last.
FOLD_LAYERS = (3, 4)
# Graphs with fewer layers than this are simulated whole (a fold would not save much).
MIN_LAYERS = 12


class LayerFold(NamedTuple):
    """Where the graph's layers are: ``layers`` runs of ``per_layer`` operators from index
    ``first``, each the same operators at the same positions (`layer_fold`)."""

    first: int
    per_layer: int
    layers: int

    def place(self, i: int) -> tuple[int, int]:
        """Operator `i`'s ``(layer, position)``: layer -1 before the layers, `layers` after."""
        k = i - self.first
        if k < 0:
            return -1, i
        if k >= self.layers * self.per_layer:
            return self.layers, k - self.layers * self.per_layer
        return divmod(k, self.per_layer)

    def index(self, layer: int, position: int, layers: int | None = None) -> int:
        """The index of the operator at `position` of `layer` in a graph of `layers` layers
        (default: this one's); layer -1 is the prologue, `layers` the epilogue."""
        n = self.layers if layers is None else layers
        if layer < 0:
            return position
        if layer >= n:
            return self.first + n * self.per_layer + position
        return self.first + layer * self.per_layer + position


def _signature(op: Operator, kinds: bool = True) -> tuple:
    return (op.block_position, op.anchor, op.iteration_sizes, op.iteration_roles,
            tuple((x.kind if kinds else "", x.shape, x.dims) for x in op.inputs),
            tuple(o.shape for o in op.outputs))


def layer_fold(graph: OpGraph) -> LayerFold | None:
    """The graph's layers as a `LayerFold`, or None where they cannot be folded: no family of
    repeated layers, layers that are not consecutive runs of the same operators, or an
    operator that reads a layer other than its own or the one before (the prologue's values
    aside; the epilogue may read any layer, counted from the last)."""
    groups = graph.repeated_blocks()
    longest = max((len(g) for g in groups), default=0)
    family = [g for g in groups if len(g) == longest]
    if longest < 2:
        return None
    starts = [min(g[m] for g in family) for m in range(longest)]
    per_layer = starts[1] - starts[0]
    if per_layer < 1 or any(b - a != per_layer for a, b in zip(starts, starts[1:])):
        return None
    fold = LayerFold(starts[0], per_layer, longest)
    ops = graph.operators
    if fold.first + longest * per_layer > len(ops):
        return None
    for g in family:  # every member where the runs put it
        if any(fold.place(i) != (m, fold.place(g[0])[1]) for m, i in enumerate(g)):
            return None
    pos = {op.name: i for i, op in enumerate(ops)}

    def reads(op: Operator, m: int) -> tuple:
        """Where `op` (of layer m) reads its activations, relative to its layer."""
        out = []
        for x in op.inputs:
            if x.kind == "activation":
                p, q = fold.place(pos[x.source])
                out.append((x.source,) if p == -1 else (p - m, q, x.index))
        return tuple(out)

    # layer 0 reads the prologue (or the batch) where the others read the layer before: its
    # operators alone, their operands' kinds aside
    base = [(_signature(ops[fold.index(1, q)]), reads(ops[fold.index(1, q)], 1))
            for q in range(per_layer)]
    if any(_signature(ops[fold.index(0, q)], kinds=False) != _signature(ops[fold.index(1, q)],
                                                                       kinds=False)
           for q in range(per_layer)):
        return None
    for m in range(2, longest):
        for q in range(per_layer):
            op = ops[fold.index(m, q)]
            if (_signature(op), reads(op, m)) != base[q]:
                return None
    if any(r[0] not in (0, -1) for b in base for r in b[1] if len(r) == 3):
        return None  # a layer reads further back than the layer before it
    return fold


def folded_graph(graph: OpGraph, fold: LayerFold, keep: int) -> OpGraph:
    """`graph` with only its first `keep` layers: the prologue, those layers and the epilogue,
    whose reads of the last layers are rewired to the last kept ones (the same position, as
    many layers from the end), and its reads of the layers before them (a mixture of experts'
    loss adds every layer's load-balancing term) to the first kept layer: the folds' count of
    those reads is linear in their layers, as `FoldedStage` needs, and none at the whole
    graph's. Operator names are the kept operators' own; the program, the parameter and batch
    leaves are `graph`'s."""
    ops = graph.operators
    shift = fold.layers - keep
    kept: list[Operator] = list(ops[:fold.first + keep * fold.per_layer])
    pos = {op.name: i for i, op in enumerate(ops)}
    for i in range(fold.index(fold.layers, 0), len(ops)):
        op = ops[i]
        inputs = []
        for x in op.inputs:
            if x.kind == "activation":
                m, q = fold.place(pos[x.source])
                if 0 <= m < fold.layers:
                    src = ops[fold.index(max(m - shift, 0), q)]
                    x = dataclasses.replace(x, source=src.name,
                                            value=src.outputs[x.index].value)
            inputs.append(x)
        kept.append(dataclasses.replace(op, inputs=tuple(inputs)))
    return dataclasses.replace(graph, operators=tuple(kept))


def _kept_strategy(strategy: Strategy, kept: Sequence[int]) -> Strategy:
    """`strategy` on a folded graph: the configs and recompute policies of the operators it
    keeps (`kept`, whole-graph indices in its order)."""
    recompute = tuple(strategy.recompute[i] for i in kept) if strategy.recompute else ()
    return dataclasses.replace(strategy, configs=tuple(strategy.configs[i] for i in kept),
                               recompute=recompute)


def _untied(fold: LayerFold, strategy: Strategy) -> int | None:
    """The first layer operator whose config or recompute policy is not its first layer's
    twin's, or None."""
    policies = strategy.recompute or ("none",) * len(strategy.configs)
    for q in range(fold.per_layer):
        first = fold.index(0, q)
        want = (strategy.configs[first], policies[first])
        for m in range(1, fold.layers):
            i = fold.index(m, q)
            if (strategy.configs[i], policies[i]) != want:
                return i
    return None


def tied(graph: OpGraph, fold: LayerFold, strategy: Strategy) -> bool:
    """Whether `strategy` gives every layer of `graph` (`fold`) the same configs and
    recompute policies, as a folded stage needs."""
    return len(strategy.configs) == len(graph.operators) and _untied(fold, strategy) is None


class FoldedStage:
    """One pipeline stage's `Simulation` of the whole graph, read off two simulations of its
    first `FOLD_LAYERS` layers (module doc): the part of a `Simulation`'s interface that
    `soapjax.simulate.pipesim.PipelinedSimulation` reads (its ``_inner``), over the whole
    graph's operator indices. ``result()`` (the task records) is not kept: a folded stage has
    no whole timeline to give."""

    def __init__(self, graph: OpGraph, fold: LayerFold, topology, cost_model, resharder,
                 strategy: Strategy, *, opt_state_factor: float = 2.0):
        self.graph, self._fold = graph, fold
        self.topology = topology
        n, large = len(graph.operators), FOLD_LAYERS[-1]
        # per operator of the whole graph, its twin in the larger folded graph (its config's
        # stand-in): the prologue and epilogue their own, the first and last layer the first
        # and last kept, the others the last-but-one kept
        self._twins = []
        for i in range(n):
            m, q = fold.place(i)
            if 0 <= m < fold.layers:
                m = m if m < large - 1 else (large - 1 if m == fold.layers - 1 else large - 2)
            elif m == fold.layers:
                m = large
            self._twins.append(fold.index(m, q, large))
        # per folded graph, the whole graph's operators it keeps, in its order
        self._kept = [[i for i in range(n) if fold.place(i)[0] < keep
                       or fold.place(i)[0] == fold.layers] for keep in FOLD_LAYERS]
        self._check_tied(strategy)
        # `compute_ends` and the epilogue's delay of the current state (reset by each change)
        self._ends: tuple[list[float], list[float], float] | None = None
        self._sims: list[Simulation] = []
        for keep, kept in zip(FOLD_LAYERS, self._kept):
            folded = graph.memo(("folded_graph", keep), lambda: folded_graph(graph, fold, keep))
            self._sims.append(Simulation(folded, topology, _FoldedCosts(cost_model, fold, keep),
                                         resharder, _kept_strategy(strategy, kept),
                                         opt_state_factor=opt_state_factor,
                                         pipeline_stage=True))
        self._sources: dict[str, str] | None = None

    # --- strategies and proposals -----------------------------------------------------------

    def _folds(self, strategy: Strategy) -> list[Strategy]:
        """`strategy` (the whole graph's, its layers tied: `PlanError` otherwise) on each
        folded graph."""
        self._check_tied(strategy)
        return [_kept_strategy(strategy, kept) for kept in self._kept]

    def _check_tied(self, strategy: Strategy) -> None:
        i = _untied(self._fold, strategy)
        if i is not None:
            first = self.graph.operators[self._fold.index(0, self._fold.place(i)[1])]
            raise PlanError(f"a folded stage simulation needs every layer's operators alike; "
                            f"{self.graph.operators[i].name!r} has another config or "
                            f"recompute policy than {first.name!r}: simulate the stage whole "
                            "(fold=False)")

    def _changes(self, changes: Sequence[tuple[int, Config, str | None]], keep: int
                 ) -> list[tuple[int, Config, str | None]]:
        """The whole graph's `changes` on the graph of `keep` layers: a layer's position
        changes in every layer alike (`PlanError` otherwise), so its kept layers' take it."""
        fold = self._fold
        by_position: dict[int, list] = {}
        out = []
        for i, config, policy in changes:
            m, q = fold.place(i)
            if 0 <= m < fold.layers:
                by_position.setdefault(q, []).append((m, config, policy))
                if m < keep:
                    out.append((fold.index(m, q, keep), config, policy))
            else:
                out.append((fold.index(m, q, keep), config, policy))
        for q, moved in by_position.items():
            if len(moved) != fold.layers or len({m for m, _, _ in moved}) != fold.layers or \
                    len({(c, p) for _, c, p in moved}) != 1:
                raise PlanError(f"a folded stage simulation moves every layer's operators "
                                f"alike; a proposal moved {len(moved)} of the "
                                f"{fold.layers} at position "
                                f"{self.graph.operators[fold.index(0, q)].block_position!r} "
                                "(or not alike): simulate the stage whole (fold=False)")
        return out

    def reset(self, strategy: Strategy) -> float:
        self._ends = None
        for sim, folded in zip(self._sims, self._folds(strategy)):
            sim.reset(folded)
        return 0.0

    def propose_many(self, changes: Sequence[tuple[int, Config, str | None]]) -> float:
        folded = [self._changes(changes, keep) for keep in FOLD_LAYERS]
        self._ends = None
        for sim, ch in zip(self._sims, folded):
            sim.propose_many(ch)
        return 0.0

    def propose_strategy(self, strategy: Strategy) -> float:
        self._ends = None
        for sim, folded in zip(self._sims, self._folds(strategy)):
            sim.propose_strategy(folded)
        return 0.0

    def accept(self) -> None:
        self._ends = None
        for sim in self._sims:
            sim.accept()

    def reject(self) -> None:
        self._ends = None
        for sim in self._sims:
            sim.reject()

    @property
    def strategy(self) -> Strategy:
        """The whole graph's strategy (the larger folded graph's, its layers unfolded)."""
        s, twins = self._sims[-1].strategy, self._twins
        recompute = tuple(s.recompute[t] for t in twins) if s.recompute else ()
        return dataclasses.replace(s, configs=tuple(s.configs[t] for t in twins),
                                   recompute=recompute)

    @property
    def microbatches(self) -> int:
        return self._sims[-1].microbatches

    @property
    def mesh(self):
        return self._sims[-1].mesh

    @property
    def call_overhead(self) -> float:
        return self._sims[-1].call_overhead

    # --- what a config decides, per operator: its twin's ------------------------------------

    def choice(self, j: int) -> tuple[Config, str]:
        return self._sims[-1].choice(self._twins[j])

    def output_specs(self, i: int):
        return self._sims[-1].output_specs(self._twins[i])

    def permuting_reads(self, indices: Sequence[int], manual: Sequence[str] = ()
                        ) -> tuple[tuple[str, int], ...]:
        return self._sims[-1].permuting_reads(sorted({self._twins[i] for i in indices}), manual)

    def held_specs(self, i: int):
        return self._sims[-1].held_specs(self._twins[i])

    def policies(self, indices: Iterable[int]) -> set[str]:
        return self._sims[-1].policies({self._twins[i] for i in indices})

    def recomputes(self, j: int) -> bool:
        return self._sims[-1].recomputes(self._twins[j])

    def forward_gathers(self, indices: Sequence[int]) -> list[tuple[int, Comm]]:
        per: dict[int, list] = {}
        for t, c in self._sims[-1].forward_gathers(sorted({self._twins[i] for i in indices})):
            per.setdefault(t, []).append(c)
        return [(i, c) for i in indices for c in per.get(self._twins[i], ())]

    def grad_sync_seconds(self) -> list[float]:
        per = self._sims[-1].grad_sync_seconds()
        return [per[t] for t in self._twins]

    def forward_seconds(self) -> list[float]:
        per = self._sims[-1].forward_seconds()
        return [per[t] for t in self._twins]

    def io_bytes_by_operator(self) -> list[tuple[tuple[int, ...], int]]:
        per = self._sims[-1].io_bytes_by_operator()
        return [per[t] for t in self._twins]

    def stash_io_by_operator(self, indices: Sequence[int]
                             ) -> dict[int, tuple[tuple[Kept, ...], tuple[Kept, ...]]]:
        per = self._sims[-1].stash_io_by_operator(sorted({self._twins[i] for i in indices}))
        return {i: per[self._twins[i]] for i in indices}

    def activation_bytes_by_operator(self) -> list[int]:
        per = self._sims[-1].activation_bytes_by_operator()
        return [per[t] for t in self._twins]

    def stored_param_bytes(self) -> Mapping[str, int]:
        """Each parameter's stored shard per device, by its source in the whole graph (a
        dropped layer's slice: its twin's), read from the larger fold as asked."""
        if self._sources is None:
            twin_ops = self._sims[-1].graph.operators
            self._sources = {}
            for op, t in zip(self.graph.operators, self._twins):
                for x, y in zip(op.inputs, twin_ops[t].inputs):
                    if x.kind == "param":
                        self._sources[x.source] = y.source
        return _TwinBytes(self._sims[-1].stored_param_bytes(), self._sources)

    # --- the timeline and memory: extrapolated over the layers ------------------------------

    def _linear(self, small: float, large: float) -> float:
        """A quantity linear in the layer count, from its values at the two folds."""
        return large + (self._fold.layers - FOLD_LAYERS[1]) * (large - small)

    def compute_ends(self) -> tuple[list[float], list[float]]:
        """When each operator's forward and backward compute tasks end (module doc)."""
        if self._ends is None:
            self._ends = self._extrapolate()
        return self._ends[0], self._ends[1]

    def _extrapolate(self) -> tuple[list[float], list[float], float]:
        """`compute_ends`, and how much later than linearly extrapolated the epilogue's
        forward ends (`_epilogue_forward`)."""
        fold, (k1, k2) = self._fold, FOLD_LAYERS
        (f1, b1), (f2, b2) = ends = [sim.compute_ends() for sim in self._sims]
        L, n, first = fold.layers, fold.per_layer, fold.first

        def layer(ends: list[float], m: int) -> list[float]:
            return ends[first + m * n:first + (m + 1) * n]

        def linear(small: list[float], large: list[float]) -> list[float]:
            return [self._linear(a, b) for a, b in zip(small, large)]

        # forward: the layers before the last kept one are the whole graph's (a prefix of it;
        # the last kept layer's forward is the last layer's, whose readers are the epilogue's:
        # a row-parallel matmul's reduce-scatter is made in its readers' layout); the others
        # step by the last such layer's span; the last by the last kept layer's
        ahead = layer(f2, k2 - 2)
        step_f = [a - b for a, b in zip(ahead, layer(f2, k2 - 3))]
        last_f = [a - b for a, b in zip(layer(f2, k2 - 1), ahead)]
        fwd = f2[:first + (k2 - 1) * n]
        for m in range(k2 - 1, L - 1):
            k = m - k2 + 2
            fwd += [a + k * d for a, d in zip(ahead, step_f)]
        fwd += [a + d for a, d in zip(fwd[-n:], last_f)]
        epilogue, late = self._epilogue_forward(fwd[-1], [f for f, _ in ends])
        fwd += epilogue
        # backward: the last k1 - 1 layers' ends linear in the layer count, counted from the
        # top; then a middle layer's backward span down to layer 1; then layer 0's own
        top = [linear(layer(b1, k1 - 1 - r), layer(b2, k2 - 1 - r)) for r in range(k1 - 1)]
        step_b = [a - b for a, b in zip(layer(b2, 1), layer(b2, 2))]
        middle = []
        below = top[-1]
        for _ in range(L - k1, 0, -1):
            below = [a + d for a, d in zip(below, step_b)]
            middle.append(below)
        bottom = [a + d - e for a, d, e in zip(below, layer(b2, 0), layer(b2, 1))]
        bwd = linear(b1[:first], b2[:first])  # the prologue
        bwd += bottom
        for row in reversed(middle):
            bwd += row
        for row in reversed(top):
            bwd += row
        bwd += linear(b1[first + k1 * n:], b2[first + k2 * n:])  # the epilogue
        return fwd, [t + late for t in bwd], late

    def _epilogue_forward(self, after: float, ends: Sequence[list[float]]
                          ) -> tuple[list[float], float]:
        """The epilogue's forward ends, from the last layer's (`after`; `ends`: each fold's
        forward ends), and how much later the forward ends than extrapolated linearly (the
        backward and the step's end start that much later too).

        The epilogue's operators run one after another on the compute stream. Where one
        started in both folds when the one before it ended, it does so in the whole graph
        (and the linear extrapolation is exact); where it waited in a fold for something
        else (its weights' gather under ZeRO, its input's resharding), it is ready in the
        whole graph when that is, the ready times extrapolated linearly from the folds where
        it waited in both (else the fold's where it waited): each ends at the later of the
        one before's end and its ready time, plus its duration in the larger fold. A linear
        extrapolation alone is wrong where the head waits for its weights in a few layers and
        for the layers in all of them (GPT 18.4B on 256 A100s with the distributed optimizer:
        the head's forward 11 s early)."""
        (k1, k2), sims = FOLD_LAYERS, self._sims
        lo = [self._fold.first + k * self._fold.per_layer for k in (k1, k2)]
        starts = [sim.forward_starts() for sim in sims]
        out = []
        for p in range(len(ends[1]) - lo[1]):
            waited, ready = [], []
            for k in (0, 1):
                j = lo[k] + p
                tol = _WAITED * max(abs(ends[k][j]), 1e-300)
                waited.append(starts[k][j] > ends[k][j - 1] + tol)
                ready.append(starts[k][j])
            at = (self._linear(*ready) if all(waited) else ready[1] if waited[1]
                  else ready[0] if waited[0] else -math.inf)
            j = lo[1] + p
            after = max(after, at) + (ends[1][j] - starts[1][j])
            out.append(after)
        linear = self._linear(ends[0][-1], ends[1][-1]) if out else 0.0
        return out, (out[-1] - linear if out else 0.0)

    def timeline_end(self) -> float:
        self.compute_ends()  # the epilogue's delay with it
        late = self._ends[2]
        return self._linear(self._sims[0].timeline_end(), self._sims[-1].timeline_end()) + late

    def memory_breakdown(self) -> MemoryBreakdown:
        small, large = (sim.memory_breakdown() for sim in self._sims)
        return MemoryBreakdown(*(round(self._linear(a, b)) for a, b in zip(small[:4], large[:4])),
                               comm_buffers=large.comm_buffers, constants=large.constants)

    def result(self):
        raise PlanError("a folded stage simulation keeps no whole timeline; simulate the "
                        "stage whole (fold=False) for its tasks")


# How much later than the operator before it ended (relative to the time) an epilogue
# operator must start to count as having waited for something else (`_epilogue_forward`).
_WAITED = 1e-12


class _TwinBytes(Mapping):
    """The whole graph's parameters' stored bytes, each its twin's in a folded graph."""

    def __init__(self, stored: Mapping[str, int], twins: dict[str, str]):
        self._stored, self._twins = stored, twins

    def __getitem__(self, source: str) -> int:
        return self._stored[self._twins[source]]

    def __iter__(self):
        return iter(self._twins)

    def __len__(self) -> int:
        return len(self._twins)


class _FoldedCosts:
    """The whole graph's cost model read by a folded graph's operator indices (the epilogue's
    are `keep` layers' operators earlier there)."""

    def __init__(self, base, fold: LayerFold, keep: int):
        self.base = base
        self.source = base.source
        self.update_reductions = getattr(base, "update_reductions", 0)
        self.update_whole = getattr(base, "update_whole", {})
        self.update_reads = getattr(base, "update_reads", set())
        self._epilogue = fold.index(keep, 0, keep)
        self._shift = (fold.layers - keep) * fold.per_layer

    def _whole(self, j: int) -> int:
        return j + self._shift if j >= self._epilogue else j

    def op_time(self, op_index: int, config: Config):
        return self.base.op_time(self._whole(op_index), config)

    def shard_time(self, op_index: int, degrees: tuple[int, ...]):
        return self.base.shard_time(self._whole(op_index), degrees)

    def update_time(self, param_shard_bytes: float) -> float:
        return self.base.update_time(param_shard_bytes)

    def update_matmul_time(self, path: str) -> float:
        return getattr(self.base, "update_matmul_time", lambda _: 0.0)(path)


class StageCosts:
    """A cost model read over one stage's mesh: the configs of a pipeline stage name one
    stage's devices, and `cost_model` may be the whole cluster's, whose ``op_time`` reads a
    config's axes at the cluster's sizes (the node axis 4 where a stage has 2). Every time
    comes from ``shard_time`` at the stage's degrees."""

    def __init__(self, base, mesh: MeshShape):
        self.base, self.mesh = base, mesh
        self.source = base.source
        self.update_reductions = getattr(base, "update_reductions", 0)
        self.update_whole = getattr(base, "update_whole", {})
        self.update_reads = getattr(base, "update_reads", set())

    def op_time(self, op_index: int, config: Config):
        return self.base.shard_time(op_index, config.degrees(self.mesh))

    def shard_time(self, op_index: int, degrees: tuple[int, ...]):
        return self.base.shard_time(op_index, degrees)

    def update_time(self, param_shard_bytes: float) -> float:
        return self.base.update_time(param_shard_bytes)

    def update_matmul_time(self, path: str) -> float:
        return getattr(self.base, "update_matmul_time", lambda _: 0.0)(path)
