"""The search's chains side by side: one process per core (issue 46, point 3).

A search ends with its chains (`soapjax.search._chain`): one from each start and one from each
of the best pipelines (and before them, the descents over the best pipelines' grids,
`soapjax.search.pipelines`, run the same way). Each is independent of the others: it starts
from its own strategy, draws from its own random stream (`chain_rng`: the search's seed and
the chain's place in the list) and returns what it found (`ChainOutcome`). `run_chains` runs
them in *lanes*: the chains are dealt to the lanes by their shares of the time (the largest
first, each to the lane with the least so far), and each lane runs its chains one after the
other in a process of its own, forked from the search's: it inherits the traced graph, the
simulations and every price worked out so far, copy on write, and sends back only what its
chains found. The outcomes are added to the search in the chains' order
(`_Searcher.absorb`), so a proposal count's search returns the same plan with one lane or
many (tests/test__parallel.py); with a time budget, as before, how far each chain gets
depends on the machine.

**Time.** With a deadline (`end`) every lane has the whole time until it, so P lanes give the
chains P times what one process gives them. A lane's chains share its time by their weights:
each, when it starts, gets its weight's share of what is left
(``now + (end - now) * w / (the weights of the lane's chains not yet run)``), so a chain that
stops early (its best has not improved for half its time) leaves the rest to the ones after.

**One lane, in this process**, where `lanes` says so: one core or ``processes=1``, a single
chain, measured operator costs (a chain may measure a shard program it proposes, and
measuring compiles and runs it on the attached devices: XLA's runtime is threaded, and a
forked process must not use what its threads held), XLA's compiled reshardings (``soapjax
plan --reshard xla``: one compiling subprocess the search talks to through a pipe, which
forked lanes would share), or a platform other than Linux (macOS's
system libraries are not safe to fork; Windows has no fork). A forked lane uses JAX only to
trace the shard programs of configs it prices first (`jax.make_jaxpr`, no XLA runtime); JAX's
warning that forking a process that uses it may deadlock is silenced for that reason, at the
fork alone.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from soapjax.base.errors import SoapjaxError
from soapjax.search._chain import ChainOutcome

__all__ = ["ChainTask", "Task", "chain_rng", "empty_outcome", "lanes", "run_chains"]

# A chain as `run_chains` runs it: called with its deadline (a `time.perf_counter` time, or
# None: a proposal count's search), its random stream and whether it runs in a lane's process
# (which prints no progress: the search's process says how the lanes are doing); returns what
# it found.
ChainTask = Callable[[float | None, np.random.Generator, bool], ChainOutcome]
# Any work `run_chains` runs so, returning what its caller reads (picklable): a chain, or a
# pipeline grid's descent (`soapjax.search.pipelines._Pipelines.grids`).
Task = Callable[[float | None, np.random.Generator, bool], Any]

_EMPTY = ChainOutcome((), (), 0, 0, 0)


def chain_rng(seed: int, k: int) -> np.random.Generator:
    """The random stream of the `k`-th chain of a search seeded `seed`: its own, whichever
    process runs it."""
    return np.random.default_rng([seed, k])


def lanes(processes: int | None, chains: int, forkable: bool = True) -> int:
    """How many lanes (processes) run `chains` chains: `processes` (None: one per core this
    process may run on), at most one per chain, and one where forking is not safe (the
    module doc: not `forkable`, with measured costs or XLA's compiled reshardings; a
    platform other than Linux)."""
    if not forkable or not sys.platform.startswith("linux") or chains < 2:
        return 1
    if processes is None:
        processes = len(os.sched_getaffinity(0))
    return max(1, min(processes, chains))


def run_chains(tasks: Sequence[tuple[Task, float]], seed: int, processes: int,
               end: float | None, on_outcome: Callable[[int, Any], None],
               progress: Callable[[str], None] | None = None) -> None:
    """Runs every chain of `tasks` (each with its weight: its share of a lane's time; or any
    `Task`, as the pipeline grids' passes) in `processes` lanes until `end` (a
    `time.perf_counter` time; None: each its proposal count), and calls `on_outcome(k,
    outcome)` for every chain in their order, once the last lane ends (one lane: as each
    chain ends).

    Raises:
      whatever a chain raised (with the traceback of the process it ran in, as a note), or
      SoapjaxError where a lane's process ended without its chains' outcomes (killed: out of
      memory, say).
    """
    dealt = _deal([w for _, w in tasks], processes)
    if len(dealt) == 1:
        for k, outcome in _run_lane(tasks, dealt[0], seed, end, forked=False):
            on_outcome(k, outcome)
        return
    outcomes = _forked(tasks, dealt, seed, end, progress)
    for k in range(len(tasks)):
        on_outcome(k, outcomes[k])


def _deal(weights: Sequence[float], processes: int) -> list[list[int]]:
    """The chains' places dealt to `processes` lanes: the largest weight first, each to the
    lane with the least weight so far (the first such); each lane's in the chains' order."""
    n = max(1, min(processes, len(weights)))
    dealt: list[list[int]] = [[] for _ in range(n)]
    load = [0.0] * n
    for k in sorted(range(len(weights)), key=lambda k: (-weights[k], k)):
        lane = min(range(n), key=lambda j: (load[j], j))
        dealt[lane].append(k)
        load[lane] += weights[k]
    return [sorted(lane) for lane in dealt if lane]


def _run_lane(tasks: Sequence[tuple[Task, float]], lane: Sequence[int], seed: int,
              end: float | None, forked: bool):
    """Runs `lane`'s chains one after the other (module doc, Time); yields each one's place
    and outcome."""
    left = sum(tasks[k][1] for k in lane)
    for k in lane:
        task, weight = tasks[k]
        deadline = None
        if end is not None:
            now = time.perf_counter()
            deadline = now + max(end - now, 0.0) * (weight / left if left > 0 else 1.0)
        left -= weight
        yield k, task(deadline, chain_rng(seed, k), forked)


def _forked(tasks: Sequence[tuple[Task, float]], dealt: list[list[int]], seed: int,
            end: float | None, progress: Callable[[str], None] | None) -> dict[int, Any]:
    """Each lane of `dealt` in a forked process (`_lane_main`); the chains' outcomes by place."""
    ctx = multiprocessing.get_context("fork")
    procs, conns = [], []
    try:
        with warnings.catch_warnings():  # the module doc says why it is safe here
            warnings.filterwarnings("ignore", message=r".*fork\(\)")
            for lane in dealt:
                receive, send = ctx.Pipe(duplex=False)
                proc = ctx.Process(target=_lane_main, args=(send, tasks, lane, seed, end),
                                   daemon=True, name="soapjax-chains")
                proc.start()
                send.close()
                procs.append(proc)
                conns.append(receive)
        return _collect(conns, len(tasks), len(dealt), progress)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
            proc.join()
        for conn in conns:
            conn.close()


def _collect(conns: list, count: int, lanes: int,
             progress: Callable[[str], None] | None) -> dict[int, Any]:
    """Reads the lanes' messages until each has sent its end; the outcomes by place."""
    outcomes: dict[int, Any] = {}
    open_ = list(conns)
    last = 0.0
    while open_:
        for conn in multiprocessing.connection.wait(open_, timeout=0.5):
            try:
                message = conn.recv()
            except EOFError:
                raise SoapjaxError(
                    "a process running the search's chains ended without their results "
                    "(killed, out of memory?); run the search in one process "
                    "(SearchSettings(processes=1), `soapjax plan --processes 1`)") from None
            if message[0] == "outcome":
                outcomes[message[1]] = message[2]
            elif message[0] == "end":
                open_.remove(conn)
            else:  # "error": what a chain raised, and where
                _, error, where = message
                if isinstance(error, BaseException):
                    error.add_note(f"raised in a process of the search's chains:\n{where}")
                    raise error
                raise SoapjaxError(f"a chain of the search failed in its process:\n{where}")
        now = time.perf_counter()
        if progress is not None and now - last >= 2.0:
            last = now
            progress(f"search: chains in {lanes} processes: {len(outcomes)} of {count} done")
    return outcomes


def _lane_main(send, tasks: Sequence[tuple[Task, float]], lane: Sequence[int], seed: int,
               end: float | None) -> None:
    """A lane's process: runs its chains, sends each outcome, then its end (or what a chain
    raised, and its traceback)."""
    try:
        for k, outcome in _run_lane(tasks, lane, seed, end, forked=True):
            send.send(("outcome", k, outcome))
        send.send(("end",))
    except BaseException as error:  # noqa: BLE001 - sent to the search, which raises it
        where = traceback.format_exc()
        try:
            send.send(("error", error, where))
        except Exception:  # noqa: BLE001 - the error does not pickle: its text does
            send.send(("error", None, where))
    finally:
        send.close()


def empty_outcome() -> ChainOutcome:
    """What a chain that did not run found: nothing."""
    return _EMPTY
