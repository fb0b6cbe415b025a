"""soapjax.search._parallel: the search's chains in forked processes, one lane each."""

import os
import time

import numpy as np
import pytest
from test_search import setup

from soapjax.base.errors import SoapjaxError
from soapjax.cost.operators import cost_model
from soapjax.search import SearchSettings, _parallel, find_plan, search
from soapjax.search._chain import ChainOutcome


def _forks(monkeypatch) -> list[int]:
    """Counts `_parallel._forked`'s calls: lanes that did run in processes of their own."""
    calls: list[int] = []
    real = _parallel._forked

    def spy(tasks, dealt, *args):
        calls.append(len(dealt))
        return real(tasks, dealt, *args)
    monkeypatch.setattr(_parallel, "_forked", spy)
    return calls


def test_two_processes_return_the_plan_one_returns(monkeypatch):
    """A proposal count's search: the same plan, step time, counts and finalists whether its
    chains run in this process or in two forked ones (each chain its own random stream)."""
    w, g, topo, cm = setup("gpt2", "p100x16")
    forks = _forks(monkeypatch)
    runs = {n: search(g, topo, cost_model=cm, family=w.family,
                      settings=SearchSettings(max_proposals=120, seed=7, processes=n))
            for n in (1, 2)}
    assert forks == [2]  # the second search forked two lanes; the first none
    one, two = runs[1], runs[2]
    assert one.strategy == two.strategy and one.step_time_s == two.step_time_s
    assert (one.proposals, one.accepted) == (two.proposals, two.accepted) and one.proposals > 0
    assert one.finalists == two.finalists and one.start == two.start
    assert one.history[-1][1] == two.history[-1][1] == one.step_time_s


def test_pipelined_chains_in_processes_return_the_same_plan(monkeypatch):
    """The pipelines' grids (first points, then the best ones' descents) and chains (stage
    boundaries, recomputation, then the chain) run in the lanes too: the same pipelined plan
    either way (the 4-layer GPT on 4 DGX nodes: 2 and 4 stages, several interleaves)."""
    from test_pipesim import A100, gpt

    g = gpt()
    cm = cost_model(g, A100, mode="analytic")
    forks = _forks(monkeypatch)
    said: list[str] = []
    plans = {n: find_plan(g, A100, costs=cm, progress=said.append, settings=SearchSettings(
                 max_proposals=8, seed=2, pipelines=True, processes=n,
                 check_reshardings=False)) for n in (1, 3)}
    # the pipelines' grids and the chains, each in lanes (a proposal count's first pass
    # scores the grids whole: no descent is left for the second)
    assert len(forks) == 2 and all(n >= 2 for n in forks)
    assert any("grids at" in m and "pipelines in 3 processes" in m for m in said)
    assert plans[1].strategy(g, A100) == plans[3].strategy(g, A100)
    assert plans[1].step_time_s == plans[3].step_time_s
    assert plans[1].pipeline == plans[3].pipeline


def _outcome(t: float) -> ChainOutcome:
    return ChainOutcome((), ((t, t),), 1, 0, 0)


def test_lanes_share_the_time_until_the_end_by_weight():
    """Every lane has the whole time until `end`; its chains share it by weight, each from
    when it starts (what one leaves, the next gets). The deadlines come back in the
    outcomes' history (the tasks run in forked processes)."""
    now = time.perf_counter()
    end = now + 60.0

    def task(deadline, rng, forked):
        assert forked and isinstance(rng, np.random.Generator)
        return ChainOutcome((), ((deadline, float(rng.integers(1 << 30))),), 1, 0, 0)
    got = {}
    _parallel.run_chains([(task, 3.0), (task, 1.0), (task, 1.0), (task, 1.0)], 5, 2, end,
                         lambda k, o: got.setdefault(k, o))
    assert sorted(got) == [0, 1, 2, 3]
    # dealt: the weight 3 alone in one lane, the three of 1 in the other
    assert got[0].history[0][0] == pytest.approx(end, abs=0.5)
    assert got[1].history[0][0] == pytest.approx(now + 20.0, abs=0.5)
    # the first returned at once: the second has half of the 60 s left, not of the 40 s
    assert got[2].history[0][0] == pytest.approx(now + 30.0, abs=0.5)
    assert got[3].history[0][0] == pytest.approx(end, abs=0.5)
    # each chain's stream is its own: the seed and its place, in any process
    assert got[2].history[0][1] == _parallel.chain_rng(5, 2).integers(1 << 30)
    assert _parallel._deal([3.0, 1.0, 1.0, 1.0], 2) == [[0], [1, 2, 3]]


def test_one_lane_runs_in_this_process_with_its_progress():
    calls = []

    def task(deadline, rng, forked):
        calls.append((deadline, forked, os.getpid()))
        return _outcome(1.0)
    got = []
    _parallel.run_chains([(task, 1.0), (task, 1.0)], 0, 1, None, lambda k, o: got.append(k))
    assert got == [0, 1] and calls == [(None, False, os.getpid())] * 2


def test_what_a_chain_raises_in_its_process_the_search_raises():
    def bad(deadline, rng, forked):
        raise ValueError("a chain went wrong")

    def good(deadline, rng, forked):
        return _outcome(1.0)
    with pytest.raises(ValueError, match="a chain went wrong") as info:
        _parallel.run_chains([(good, 1.0), (bad, 1.0)], 0, 2, None, lambda k, o: None)
    assert any("raised in a process of the search's chains" in n
               for n in getattr(info.value, "__notes__", []))


def test_a_lane_killed_is_said_not_waited_on():
    def killed(deadline, rng, forked):
        os._exit(3)  # as the kernel's out-of-memory killer would end it

    def good(deadline, rng, forked):
        return _outcome(1.0)
    with pytest.raises(SoapjaxError, match="ended without their results.*processes=1"):
        _parallel.run_chains([(good, 1.0), (killed, 1.0)], 0, 2, None, lambda k, o: None)


def test_how_many_lanes():
    cores = len(os.sched_getaffinity(0))
    assert _parallel.lanes(None, 100) == min(cores, 100)
    assert _parallel.lanes(4, 3) == 3  # at most one a chain
    assert _parallel.lanes(4, 1) == 1
    # measuring runs XLA, the XLA resharder a subprocess behind one pipe: not forked
    assert _parallel.lanes(8, 10, forkable=False) == 1


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, 2000])
def test_processes_must_be_a_count(bad):
    from soapjax.base.errors import SettingsError
    with pytest.raises(SettingsError, match="processes must be None"):
        SearchSettings(processes=bad)


def test_a_search_that_compiles_its_reshardings_stays_in_one_process(monkeypatch):
    """With XLA's compiled reshardings the chains talk to one compiling subprocess through
    one pipe, which forked lanes would share: they run in the search's process."""
    from soapjax.cost.reshard import Resharder
    from soapjax.strategy.space import MeshShape

    w, g, topo, cm = setup("mlp", "cpu8")
    forks = _forks(monkeypatch)
    with Resharder(MeshShape.of(topo), mode="xla") as resharder:
        found = search(g, topo, cost_model=cm, resharder=resharder, family=w.family,
                       settings=SearchSettings(max_proposals=4, seed=0, processes=2))
    assert forks == [] and found.proposals > 0
