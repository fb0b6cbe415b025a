"""One Metropolis-Hastings chain over strategies (`soapjax.search.find`'s building block).

A chain starts from a strategy and proposes random moves, each scored by the simulation it
walks (delta simulation, `Simulation.propose_many`, or full, `Simulation.propose_strategy`):
a new config for one operator (for every layer at once where the operator is at the same
position of a repeated block), a recompute policy (`RECOMPUTE_MOVES` of the moves; of every
layer operator at once where the strategy has pipeline stages, which run one), a
number of microbatches (`MICROBATCH_MOVES`), Megatron's distributed optimizer on or off
(`OPTIMIZER_MOVES`: the optimizer state sharded over every mesh axis its parameter is
replicated on, `Strategy.optimizer_axes`), or, where the graph has attention operators and the
strategy no pipeline stages, context parallelism's ring form on or off (`RING_MOVES`,
`Strategy.ring_attention`). A move is accepted with probability
``min(1, exp(beta * (cost(S) - cost(S*))))`` against the current strategy; the best strategy
that fits in memory and that apply can run is recorded (`_Searcher.record`). A chain that
stalls goes back to its best point and walks again from there (`RESTART_AFTER`). `SearchSettings`
says how long and how: its proposal count or deadline, seed, temperature, space limits. The
search (`soapjax.search.find.search`) runs one chain per start and keeps the best.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import numbers
import time
from collections.abc import Callable
from typing import Literal, NamedTuple

import numpy as np

from soapjax.base.errors import PlanError, SettingsError
from soapjax.graph.opgraph import OpGraph
from soapjax.simulate.front import Simulation
from soapjax.strategy.memory import microbatch_choices, microbatch_error
from soapjax.strategy.space import (
    RECOMPUTE_POLICIES,
    MeshShape,
    SpaceLimits,
    Strategy,
    configs,
    spatial_convolution,
    tie_blocks,
)

__all__ = ["MAX_BUDGET_S", "MAX_PROPOSALS", "MICROBATCH_MOVES", "OPTIMIZER_MOVES",
           "RECOMPUTE_MOVES", "RESTART_AFTER", "RING_MOVES", "ChainOutcome", "Progress",
           "SearchSettings", "random_strategy"]

Progress = Callable[[str], None]

# A budget or a proposal count past these never ends on any machine (a week; ten million
# proposals per chain, hours at the fastest rates the search reaches): refused, not waited on.
MAX_BUDGET_S = 7 * 24 * 3600
MAX_PROPOSALS = 10**7


@dataclasses.dataclass(frozen=True)
class SearchSettings:
    """How to search.

    Attributes:
      budget_s: wall-clock budget of the whole search, from its start: scoring the starts,
        measuring shard programs (until 60% of it; estimated after: see
        `soapjax.cost.operators.CostModel.measure_until`), Megatron's grids and every chain (20 s:
        ``make plan`` of GPT-2 small on a DGX H100 searches 18 s).
      max_proposals: proposals per chain; when set, the budget is ignored (reproducible).
      seed: the random seed.
      num_random: random strategies added to the initial candidates.
      temperature: the relative slowdown accepted with probability 1/2 (see module doc).
      limits: restrictions of the SOAP space (e.g. no R splits, as in FlexFlow).
      simulation: ``"delta"`` (default) or ``"full"``: how each proposal is simulated (see
        the module doc; the same chain either way, only slower in full).
      pipelines: search plans with pipeline stages too (`soapjax.strategy.pipeline`), for graphs
        with repeated layers: for each stage count S that divides the layers and the outermost
        mesh axis and each interleave the layers allow, Megatron's grid at pp=S (TP 1 to 8)
        is scored with `soapjax.simulate.pipesim.PipelinedSimulation`, and chains start from the
        best pipelines' best points (`soapjax.search.find`'s module doc). True:
        always; False: never; None (default): only when no plan without stages fits in
        memory (a model too large for its cluster gets a pipelined plan instead of an error,
        and every other search is unchanged).
      check_reshardings: with the ideal resharding model, price the best few plans found
        again with the reshardings XLA compiles for them and return the fastest so priced
        (`soapjax.search.find.find_plan`: a plan whose layout changes XLA makes by
        replicating a tensor whole is priced so, and loses to one that needs none).
      processes: how many processes run the chains (`soapjax.search._parallel`): None
        (default) one per core this process may run on, 1 all in this process. Each chain
        draws from its own random stream (the seed and the chain's place), so a proposal
        count's search returns the same plan with any number. With measured operator costs
        the chains stay in this process (measuring runs XLA, which a forked process must
        not).
    """

    budget_s: float = 20.0
    max_proposals: int | None = None
    seed: int = 0
    num_random: int = 1
    temperature: float = 0.02
    limits: SpaceLimits = SpaceLimits()
    simulation: Literal["delta", "full"] = "delta"
    pipelines: bool | None = None
    check_reshardings: bool = True
    processes: int | None = None

    def __post_init__(self) -> None:
        if self.check_reshardings not in (True, False):
            raise SettingsError(f"SearchSettings.check_reshardings must be True or False, got "
                                f"{self.check_reshardings!r}")
        if self.pipelines not in (None, True, False):
            raise SettingsError(f"SearchSettings.pipelines must be True, False or None (only "
                                f"when nothing fits without stages), got {self.pipelines!r}")
        if self.simulation not in ("delta", "full"):
            raise SettingsError(f"SearchSettings.simulation must be 'delta' or 'full', got "
                                f"{self.simulation!r}")
        _check_number("budget_s", self.budget_s, 0.0,
                      f"a number of seconds from 0 to {MAX_BUDGET_S} (a week)", MAX_BUDGET_S)
        if self.max_proposals is not None:
            _check_number("max_proposals", self.max_proposals, 1,
                          f"None or an integer from 1 to {MAX_PROPOSALS:,}", MAX_PROPOSALS)
        _check_number("seed", self.seed, 0, "an integer >= 0")
        _check_number("num_random", self.num_random, 0, "an integer >= 0")
        _check_number("temperature", self.temperature, math.ulp(0.0), "a number > 0")
        if self.processes is not None:
            _check_number("processes", self.processes, 1,
                          "None (one per core) or an integer from 1 to 1024", 1024)

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["limits"] = dataclasses.asdict(self.limits)
        return d


def _check_number(name: str, value: object, low: float, expected: str,
                  high: float = math.inf) -> None:
    """SettingsError unless `value` is a finite number from `low` to `high` (an integer if
    `low` is)."""
    kind = numbers.Integral if isinstance(low, int) else numbers.Real
    if isinstance(value, bool) or not isinstance(value, kind) or not math.isfinite(value) \
            or not low <= value <= high:
        raise SettingsError(f"SearchSettings.{name} must be {expected}, got {value!r}")


def _cost(sim: Simulation) -> float:
    if _hangs(sim):
        return math.inf
    t = sim.step_time()
    cap = sim.topology.device.memory_bytes
    over = sim.peak_memory_bytes() / cap - 1.0
    return t if over <= 0 else t * (2.0 + 10.0 * over)


def _hangs(sim: Simulation) -> bool:
    """Whether apply would refuse the simulated plan because its pipeline stages would hang:
    a layout change inside a stage's action that XLA may make with a collective-permute
    (`soapjax.simulate.pipesim.PipelinedSimulation.stage_permutes`). The chains treat it as
    infinitely slow and `_Searcher.record` keeps none."""
    permutes = getattr(sim, "stage_permutes", None)  # a pipelined simulation's
    return permutes is not None and bool(permutes())


def random_strategy(graph: OpGraph, mesh: MeshShape, rng: np.random.Generator,
                    limits: SpaceLimits = SpaceLimits()) -> Strategy:
    """A config for every operator drawn uniformly from its SOAP space (one per repeated
    block position: every layer of a scan over layers gets the same)."""
    return tie_blocks(graph, Strategy(tuple(_pick(configs(op, mesh, limits), rng)
                                            for op in graph.operators)))


def _pick(choices, rng):
    return choices[int(rng.integers(len(choices)))]


def _changed(strategy: Strategy, members: list[int], config, policy: str | None) -> Strategy:
    """`strategy` with operators `members` given `config` (if any) and `policy` (if any)."""
    changes: dict = {}
    if config is not None:
        configs = list(strategy.configs)
        for j in members:
            configs[j] = config
        changes["configs"] = tuple(configs)
    if policy:
        recompute = list(strategy.recompute or ("none",) * len(strategy.configs))
        for j in members:
            recompute[j] = policy
        changes["recompute"] = tuple(recompute)
    return dataclasses.replace(strategy, **changes) if changes else strategy


def _proposed(strategy: Strategy, move: tuple) -> Strategy:
    """The strategy `move` (`_Searcher._draw`'s) makes of `strategy`."""
    members, config, policy, m = move
    if isinstance(m, Strategy):  # ring attention toggled
        return m
    if isinstance(m, tuple):  # the distributed optimizer's axes
        return dataclasses.replace(strategy, optimizer_axes=m)
    if m is not None:
        return strategy.with_microbatches(m)
    return _changed(strategy, members, config, policy)


def _propose_all(sim: Simulation, members: list[int], config, policy: str | None = None) -> None:
    """Delta-simulates every member taking `config` (None: its own) and recompute `policy`
    (None: its own), as one pending proposal (`Simulation.propose_many`: one retiming pass)."""
    sim.propose_many([(j, sim.choice(j)[0] if config is None else config, policy)
                      for j in members])


# The most strategies a chain remembers the price of (`_Searcher._priced`): a chain that comes
# back to one (at a local best it draws the same few moves again and again) need not simulate
# it again to reject it. About 10 KB a strategy of a 1,000-operator graph.
PRICES_KEPT = 4096
# How often a proposal changes a recompute policy (of one operator or one position of every
# layer) or the number of microbatches instead of a config. A microbatch change re-simulates
# the whole step (`Simulation.reset`), in delta and full simulation alike.
RECOMPUTE_MOVES = 0.15
MICROBATCH_MOVES = 0.03
# How often a proposal turns the distributed optimizer on or off (a full re-simulation too).
OPTIMIZER_MOVES = 0.02
# How often it turns ring attention on or off, where it can (a full re-simulation too).
RING_MOVES = 0.02
# A chain whose best has not improved for this share of its time (of its proposal count)
# goes back to its best point, once until it improves again; at half it ends (`_Searcher.chain`).
RESTART_AFTER = 0.25


class ChainOutcome(NamedTuple):
    """What one chain found (`_Searcher.outcome`), to add to the search's (`_Searcher.absorb`):
    wherever it ran, in this process or another (`soapjax.search._parallel`).

    Attributes:
      bests: the fitting plans it recorded, the best per start name, as (step time,
        strategy, start name).
      history: (seconds since the search's start, its best so far) at each improvement.
      proposals, accepted, repriced: its counts (`_Searcher`'s).
    """

    bests: tuple[tuple[float, Strategy, str], ...]
    history: tuple[tuple[float, float], ...]
    proposals: int
    accepted: int
    repriced: int


class _Searcher:
    """One search: the simulation, the SOAP spaces, the chains."""

    def __init__(self, sim: Simulation, settings: SearchSettings, progress: Progress | None):
        self.sim = sim
        self.settings = settings
        self.progress = progress
        self.rng = np.random.default_rng(settings.seed)
        mesh = MeshShape.of(sim.topology)
        self.spaces = [configs(op, mesh, settings.limits) for op in sim.graph.operators]
        # Operators at the same position of every layer of a scan over layers move together:
        # a 48-layer model costs the search what one layer costs.
        self.tied = {i: g for g in sim.graph.repeated_blocks() for i in g}
        self.movable = [i for i, s in enumerate(self.spaces)
                        if len(s) > 1 and self.tied.get(i, [i])[0] == i]
        self.recomputable = [i for i in range(len(self.spaces)) if self.tied.get(i, [i])[0] == i]
        # A pipeline's layers run one recompute policy, the strongest any layer operator has
        # (`soapjax.apply._pipeline_layout.layer_recompute`), and the rest none: there a
        # recompute move sets every layer operator's at once, so what is priced is what runs.
        self.layer_ops = ([i for i, op in enumerate(sim.graph.operators) if op.block_position]
                          if getattr(sim.strategy, "pipelined", False) else [])
        self.microbatches = microbatch_choices(sim.graph)
        self.mesh = mesh
        self.proposals = self.accepted = 0
        self.repriced = 0  # proposals priced from `_priced`, not simulated
        self.restarts = 0  # chains sent back to their best point (`chain`)
        # the price (`_cost`) of every strategy proposed, while it fits `PRICES_KEPT`: the
        # simulation prices a strategy the same whichever way it got there (delta == full)
        self._priced: dict[Strategy, float] = {}
        self.best: tuple[float, Strategy, str] | None = None
        self.bests: dict[str, tuple[float, Strategy, str]] = {}  # per start (`offer`)
        # every plan a chain's outcome brought (`absorb`), a start's best among them or not
        self.absorbed: list[tuple[float, Strategy, str]] = []
        self.t0 = time.perf_counter()
        self.history: list[tuple[float, float]] = []
        self._last_print = 0.0
        # in progress lines: the proposals made and the best time found before this
        # searcher's (`view`)
        self._shown, self._known = 0, math.inf
        self._t_best = 0.0  # when the current chain last improved, seconds after its start
        self.check_convolutions = not settings.limits.allow_spatial and any(
            "conv" in op.anchor for op in sim.graph.operators)
        self.has_attention = any(op.anchor == "attention" for op in sim.graph.operators)

    def record(self, name: str) -> None:
        if not self.sim.fits_in_memory():
            return
        if self.check_convolutions and spatial_convolution(self.sim.graph, self.sim.strategy):
            return  # apply refuses it (XLA computes it wrongly): never a plan
        if _hangs(self.sim):
            return  # apply refuses it (its stages would hang): never a plan
        self.offer((self.sim.step_time(), self.sim.strategy, name))

    def offer(self, found: tuple[float, Strategy, str]) -> None:
        """Keeps `found` (a fitting plan: time, strategy, start name) among each start's best,
        the candidates `finalists` draws from, and as the best (with its time in `history`)
        where it is faster."""
        t, _, name = found
        if name not in self.bests or t < self.bests[name][0]:
            self.bests[name] = found
        if self.best is None or t < self.best[0]:
            self.best = found
            self.history.append((time.perf_counter() - self.t0, t))

    def view(self, rng: np.random.Generator) -> _Searcher:
        """A searcher for one chain (`soapjax.search._parallel`): this one's simulation,
        spaces, clock and memory of prices, with `rng` for its random stream and bests,
        history and counts of its own, which `absorb` adds back here."""
        out = copy.copy(self)
        out.rng = rng
        out.proposals = out.accepted = out.repriced = out.restarts = 0
        out.best, out.bests, out.history, out.absorbed = None, {}, [], []
        out._shown = self._shown + self.proposals
        out._known = min(self._known, self.best[0] if self.best is not None else math.inf)
        return out

    def outcome(self, best_only: bool = False) -> ChainOutcome:
        """What this searcher found: its bests per start name (`best_only`: its best alone),
        history and counts."""
        bests = (((self.best,) if self.best is not None else ()) if best_only
                 else tuple(self.bests.values()))
        return ChainOutcome(bests, tuple(self.history), self.proposals, self.accepted,
                            self.repriced)

    def absorb(self, outcome: ChainOutcome) -> None:
        """Adds what a chain found (`outcome`) to this search: its plans among the starts'
        bests and the best, its improvements to the history (kept where they improved on
        the search's best at their time), its counts."""
        self.absorbed += outcome.bests
        for found in outcome.bests:
            t, _, name = found
            if name not in self.bests or t < self.bests[name][0]:
                self.bests[name] = found
            if self.best is None or t < self.best[0]:
                self.best = found
        kept: list[tuple[float, float]] = []
        for point in sorted([*self.history, *outcome.history]):
            if not kept or point[1] < kept[-1][1]:
                kept.append(point)
        self.history = kept
        self.proposals += outcome.proposals
        self.accepted += outcome.accepted
        self.repriced += outcome.repriced

    def finalists(self, k: int) -> tuple[tuple[float, Strategy, str], ...]:
        """The `k` fastest distinct fitting plans among the starts' bests, fastest first."""
        out: list[tuple[float, Strategy, str]] = []
        for found in sorted(self.bests.values(), key=lambda f: f[0]):
            if len(out) == k:
                break
            if all(found[1] != kept[1] for kept in out):
                out.append(found)
        return tuple(out)

    def chain(self, name: str, start: Strategy, deadline: float) -> None:
        """Metropolis-Hastings from `start` until the deadline or proposal budget.

        A proposal is delta-simulated (`Simulation.propose_many`) or, with
        ``SearchSettings(simulation="full")`` and for any change of the microbatch count,
        fully simulated (`Simulation.propose_strategy`); `accept` or `reject` ends it. A
        strategy proposed before is priced from `_priced` instead and, if rejected, never
        simulated: the same chain, draw for draw, as without it. A chain whose best has not
        improved for `RESTART_AFTER` of its time (of its proposal count) goes back to its
        best point once (`restarts` counts it; it had walked away from it on moves that
        were slower, as the temperature lets it) and walks again from there; at half, it
        ends, leaving the rest of its time to the chains after it."""
        sim, rng, s = self.sim, self.rng, self.settings
        sim.reset(start)
        self.record(name)
        if not self.movable and not self.recomputable:
            return
        current = _cost(sim)
        # (a start apply would refuse costs infinity: its time sets the temperature)
        beta = math.log(2.0) / (s.temperature * (current if math.isfinite(current)
                                                 else sim.step_time()))
        self._t_best = 0.0
        best_here, since_best, n = current, 0, 0
        # the chain's best point, and whether it went back there since it last improved
        best_point, restarted = sim.strategy, False
        t_start = time.perf_counter()
        while True:
            if s.max_proposals is not None:
                if n >= s.max_proposals or since_best >= max(1, s.max_proposals // 2):
                    break
                stalled = since_best >= max(1, int(s.max_proposals * RESTART_AFTER))
            else:
                now = time.perf_counter()
                idle, share = (now - t_start) - self._t_best, deadline - t_start
                if now >= deadline or idle >= share / 2:
                    break
                stalled = idle >= share * RESTART_AFTER
            if stalled and not restarted:  # back to its best point, once per improvement
                restarted = True
                if sim.strategy != best_point:
                    sim.reset(best_point)
                    current = best_here  # its price there (delta == full)
                    self.restarts += 1
            n += 1
            self.proposals += 1
            move = self._draw(sim.microbatches, lambda: sim.strategy)
            if move is None:  # a config or microbatch count the current strategy cannot take
                since_best += 1
                continue
            proposed = _proposed(sim.strategy, move)
            new = self._priced.get(proposed)
            simulated = new is None  # else priced before: the same price (delta == full)
            if simulated:
                self._propose(proposed, move)
                new = self._remember(proposed, _cost(sim))
            else:
                self.repriced += 1
            if new <= current or rng.random() < math.exp(beta * (current - new)):
                if not simulated:
                    self._propose(proposed, move)
                sim.accept()
                self.accepted += 1
                current = new
                if new < best_here:
                    best_here, since_best = new, 0
                    best_point, restarted = sim.strategy, False
                    self._t_best = time.perf_counter() - t_start
                    self.record(name)
                else:
                    since_best += 1
            else:
                if simulated:
                    sim.reject()
                since_best += 1
            self._report(name)

    def _propose(self, proposed: Strategy, move: tuple) -> None:
        """Proposes `move`, which makes `proposed`, on the simulation: delta-simulated, or
        fully for a change of microbatches, the distributed optimizer or ring attention (or
        with ``SearchSettings(simulation="full")``)."""
        members, config, policy, m = move
        if m is not None or self.settings.simulation == "full":
            self.sim.propose_strategy(proposed)
        else:
            _propose_all(self.sim, members, config, policy)

    def _remember(self, strategy: Strategy, cost: float) -> float:
        """Keeps `cost` as `strategy`'s price (`_priced`, at most `PRICES_KEPT`); returns it."""
        if len(self._priced) >= PRICES_KEPT:
            self._priced.clear()
        self._priced[strategy] = cost
        return cost

    def _draw(self, m: int, current: Callable[[], Strategy]) -> tuple | None:
        """A random move from the current strategy (`current()`, with `m` microbatches):
        (members, config or None, policy or None, microbatches or the distributed optimizer's
        new axes (a tuple) or the strategy with ring attention toggled or None), or None when
        the drawn change does not divide the batch or cannot be made."""
        rng = self.rng
        r = rng.random()
        if r >= 1.0 - OPTIMIZER_MOVES:
            return [], None, None, () if current().optimizer_axes else self.mesh.axis_names
        if self.has_attention and r >= 1.0 - OPTIMIZER_MOVES - RING_MOVES:
            try:
                toggled = dataclasses.replace(current(),
                                              ring_attention=not current().ring_attention)
            except PlanError:  # pipeline stages: the ring runs without them only
                return None
            return [], None, None, toggled
        if r < MICROBATCH_MOVES and len(self.microbatches) > 1:
            new = self.microbatches[int(rng.integers(len(self.microbatches)))]
            ops = self.sim.graph.operators
            if new == m or any(microbatch_error(op, c, self.mesh, new)
                               for op, c in zip(ops, current().configs)):
                return None
            return [], None, None, new
        if r < MICROBATCH_MOVES + RECOMPUTE_MOVES:
            if self.layer_ops:  # a pipeline's layers: one policy for all (see __init__)
                return self.layer_ops, None, _pick(RECOMPUTE_POLICIES, rng), None
            i = self.recomputable[int(rng.integers(len(self.recomputable)))]
            return self.tied.get(i, [i]), None, _pick(RECOMPUTE_POLICIES, rng), None
        if not self.movable:
            return None
        i = self.movable[int(rng.integers(len(self.movable)))]
        config = _pick(self.spaces[i], rng)
        if m > 1 and microbatch_error(self.sim.graph.operators[i], config, self.mesh, m):
            return None
        return self.tied.get(i, [i]), config, None, None

    def _report(self, name: str, force: bool = False) -> None:
        if self.progress is None:
            return
        now = time.perf_counter()
        if not force and now - self._last_print < 0.5:
            return
        self._last_print = now
        elapsed = now - self.t0
        t = min(self._known, self.best[0] if self.best is not None else math.inf)
        best = f"{t * 1e3:.3f} ms" if t < math.inf else "none fits yet"
        made = self._shown + self.proposals
        self.progress(f"search: {elapsed:5.1f}s  chain {name:<14}  best {best}  "
                      f"{made} proposals ({made / max(elapsed, 1e-9):,.0f}/s)")
