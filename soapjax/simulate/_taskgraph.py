"""The simulator's engine: the task graph, its timing, and the pricing of communication tasks.

Private to `soapjax.simulate.front`, which builds a training step's tasks from a strategy with these
three pieces:

* `TaskGraph`: tasks in flat mutable arrays, FIFO resources, the full and the delta timing;
* `Pricing`: the collectives of a resharding (from the `Resharder`), priced on the topology's
  links, and the resources they occupy (memoised: a search asks the same ones again and again);
* `Layout`: what the operator graph fixes whatever the strategy: activation edges, parameter and
  batch leaves with their readers, and the issue-order key of every task slot.

A task has an integer id, a duration, the resources it occupies (integers: 0 is the compute
stream, the rest are communication channels), its dependencies (task ids) and a *key*: its
position in the program's fixed issue order. Each resource runs its tasks in key order (FIFO,
assumption A3), and a task starts at the latest end among its dependencies and the previous task
on each of its resources (A4):

    start[t] = max({0} | {end[d] for d in deps[t]} | {end[prev on r] for r in res[t]})
    end[t]   = start[t] + dur[t]

**Contention** (`TaskGraph(contention=sigma)`, a GPU's ``[device.kernels].overlap_slowdown``):
NCCL's kernels hold some of the SMs while a collective runs, so compute beside it runs slower.
A compute task (resource 0 only) that starts while a collective issued before it still runs
(``B``, the latest end among communication tasks of smaller key, is after its start) computes at
``1 / (1 + sigma)`` of its rate until ``B``:

    end[t] = start[t] + dur[t] + min(dur[t] * sigma, (B - start[t]) * sigma / (1 + sigma))

Collectives issued after a compute task that still overlap it (a ZeRO-3 gather prefetched
beside the operator before its reader) do not slow it: the pass knows only what was issued
before. With ``sigma = 0`` (every CPU file) the formula is the one above.

Every dependency has a smaller key than its dependent, so the timeline is one pass in key order
(`full_pass`, the paper's Algorithm 1 with the issue order fixed). After a local change the
delta pass (`sweep`, Algorithm 2) retimes only from the first changed task onward, and only as
far as a change can reach: the changed tasks' keys bound a range, and a task whose end moved
extends it to its successors and to the next task on each of its resources; where the range
ends, nothing changes any more. Under contention a compute task also reads ``B``: past the range
the pass goes on to the next compute task after each collective it retimed, and stops where that
task's ``B`` is the one it had (kept per task in ``busy``). Both passes evaluate the same
expression on the same operands, so they agree exactly (bit for bit), not just to rounding.

The hot loops need mutable flat arrays (docs/style.md's one exception); the mutability stays inside
this module and `Simulation`. Ids of removed tasks are recycled through a free list, so a long
search does not grow the arrays.
"""

from __future__ import annotations

import copy
import itertools
from bisect import bisect_left
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from soapjax.base.collectives import bytes_sent, kind_name
from soapjax.cost.reshard import ReshardModel
from soapjax.graph.opgraph import OpGraph
from soapjax.strategy.space import MeshShape
from soapjax.topology.cluster import Topology

_NAN = float("nan")
NONE = 0  # the id of the sentinel task that stands for "no task"
CHAIN = 64  # the most collectives one resharding may take (keys leave room for this many)
EDGE, LEAF, CONST = 0, 1, 2


class TaskGraph:
    """Tasks in flat arrays (lists indexed by task id), with per-resource FIFO order.

    Attributes:
      dur, start, end: seconds, per task id.
      key: issue-order key per task id (unique per resource and in `order`).
      res: resources per task (a tuple of ints).
      deps: dependencies per task (a list of task ids, all with smaller keys).
      succ: the reverse of `deps`.
      info: opaque per-task data for the caller (what the task is, for records and traces).
      order, okeys: the attached tasks sorted by key, and their keys (as of the last
        `settle`: every pass and reader settles first).
      rtasks, rkeys: the same per resource.
      lo, hi: the smallest and largest key of a task whose inputs changed since the last pass
        (None when nothing did).
      contention: sigma, how much slower compute runs beside a running collective (module doc).
    """

    def __init__(self, num_resources: int, contention: float = 0.0) -> None:
        if not contention >= 0.0:
            raise ValueError(f"contention: expected a slowdown >= 0, found {contention!r}")
        self.num_resources = num_resources
        self.contention = float(contention)
        self.busy: list[float] = []  # per compute task: the B its last timing read (contention)
        self.dur: list[float] = []
        self.start: list[float] = []
        self.end: list[float] = []
        self.key: list[int] = []
        self.res: list[tuple[int, ...]] = []
        self.deps: list[list[int]] = []
        self.succ: list[list[int]] = []
        self.info: list[Any] = []
        self.free: list[int] = []
        self.order: list[int] = []
        self.okeys: list[int] = []
        self.rtasks: list[list[int]] = [[] for _ in range(num_resources)]
        self.rkeys: list[list[int]] = [[] for _ in range(num_resources)]
        self.lo: int | None = None
        self.hi: int | None = None
        # changes since the last `settle`: tasks attached, and tasks detached (their key and
        # resources, should `new` reuse the id before it)
        self._added: set[int] = set()
        self._dropped: dict[int, tuple[int, tuple[int, ...]]] = {}
        # Task NONE stands for "no task": it ends at 0, has key -1 and is never attached, so
        # loops over neighbours need no test for a missing one.
        self.new(-1, 0.0, (), [], None)
        self.end[NONE] = 0.0

    # --- tasks ---------------------------------------------------------------------------------

    def new(self, key: int, dur: float, res: tuple[int, ...], deps: list[int], info: Any) -> int:
        """Allocates a task (not yet attached to the order or its resources).

        Its end starts as NaN, which differs from every time, so the pass that first times it
        always propagates it.
        """
        if self.free:
            t = self.free.pop()
            self.dur[t] = dur
            self.end[t] = _NAN
            self.key[t] = key
            self.res[t] = res
            self.deps[t] = deps
            self.succ[t] = []
            self.info[t] = info
            self.busy[t] = _NAN
            return t
        t = len(self.dur)
        self.dur.append(dur)
        self.start.append(0.0)
        self.end.append(_NAN)
        self.key.append(key)
        self.res.append(res)
        self.deps.append(deps)
        self.succ.append([])
        self.info.append(info)
        self.busy.append(_NAN)
        return t

    def release(self, tasks: Iterable[int]) -> None:
        """Returns detached tasks' ids to the free list."""
        self.free.extend(tasks)

    # --- bulk build and the full pass (Algorithm 1) --------------------------------------------

    def build(self) -> None:
        """Attaches every allocated task of a fresh graph at once: order, resources, successors."""
        key = self.key
        order = sorted(range(NONE + 1, len(key)), key=key.__getitem__)
        self.order = order
        self.okeys = [key[t] for t in order]
        rtasks: list[list[int]] = [[] for _ in range(self.num_resources)]
        res, succ = self.res, self.succ
        for t in order:
            for r in res[t]:
                rtasks[r].append(t)
            for d in self.deps[t]:
                succ[d].append(t)
        self.rtasks = rtasks
        self.rkeys = [[key[t] for t in lst] for lst in rtasks]

    def full_pass(self) -> None:
        """Times every attached task from scratch, in key order (each resource FIFO)."""
        self.settle()
        last = [0.0] * self.num_resources
        start, end, dur, deps, res = self.start, self.end, self.dur, self.deps, self.res
        sigma, busy, b = self.contention, self.busy, 0.0
        for t in self.order:
            s = _ready(t, deps, res, end, last)
            rs = res[t]
            if sigma:
                e, b, _ = _timed(t, s, rs, dur, busy, b, sigma)
            else:
                e = s + dur[t]
            start[t] = s
            end[t] = e
            for r in rs:
                last[r] = e
        self.lo = self.hi = None

    def step_time(self) -> float:
        """The end of the last task: on each FIFO resource ends never decrease."""
        self.settle()
        end, out = self.end, 0.0
        for lst in self.rtasks:
            if lst and end[lst[-1]] > out:
                out = end[lst[-1]]
        return out

    # --- incremental changes and the delta pass (Algorithm 2) ----------------------------------

    def mark(self, t: int) -> None:
        """Records that task `t`'s inputs changed: the next `sweep` starts no later than it."""
        k = self.key[t]
        if self.lo is None:
            self.lo = self.hi = k
        elif k < self.lo:
            self.lo = k
        elif k > self.hi:
            self.hi = k

    def attach(self, t: int) -> None:
        """Inserts an allocated task into the order, its resources and its deps' successors.

        Its places in the order and on its resources are taken at the next `settle` (every
        pass and reader settles first): a proposal that replaces many tasks (an operator of
        every layer) merges them into those lists once, not one insertion each.
        """
        self._added.add(t)
        for d in self.deps[t]:
            self.succ[d].append(t)
        self.mark(t)

    def detach(self, t: int) -> None:
        """Removes a task from the order, its resources and its deps' successors.

        Its arrays stay intact, so `attach` puts it back exactly (a rejected proposal). The
        task after it on each resource is marked at the next `settle`: its predecessor
        changed.
        """
        if t in self._added:  # attached since the last settle: never placed
            self._added.remove(t)
        else:
            assert t not in self._dropped, "detaching a task that is not attached"
            self._dropped[t] = (self.key[t], self.res[t])
        for d in self.deps[t]:
            self.succ[d].remove(t)

    def settle(self) -> None:
        """Places the tasks attached and removes those detached since the last settle, in the
        order and on each resource, and marks the task after each removed one on each of its
        resources (its predecessor there changed). A few changes to a list are made one by
        one, many merged in one sort (a proposal of an operator of every layer makes
        hundreds)."""
        added, dropped = self._added, self._dropped
        if not added and not dropped:
            return
        self._added, self._dropped = set(), {}
        key, res = self.key, self.res
        new = sorted(added, key=key.__getitem__)
        gone = sorted(((t, k) for t, (k, _) in dropped.items()), key=lambda tk: tk[1])
        _splice(self.order, self.okeys, key, new, gone)
        touched: dict[int, tuple[list, list]] = {}
        for t in new:
            for r in res[t]:
                touched.setdefault(r, ([], []))[0].append(t)
        for t, k in gone:
            for r in dropped[t][1]:
                touched.setdefault(r, ([], []))[1].append((t, k))
        for r, (ins, outs) in touched.items():
            lst, keys = self.rtasks[r], self.rkeys[r]
            _splice(lst, keys, key, ins, outs)
            for _, k in outs:
                i = bisect_left(keys, k)
                if i < len(lst):
                    self.mark(lst[i])

    def set_deps(self, t: int, deps: list[int]) -> list[int]:
        """Replaces an attached task's dependencies; returns the old list (marks it)."""
        old = self.deps[t]
        if old == deps:
            return old
        for d in old:
            self.succ[d].remove(t)
        for d in deps:
            self.succ[d].append(t)
        self.deps[t] = deps
        self.mark(t)
        return old

    def set_dur(self, t: int, dur: float) -> float:
        """Changes an attached task's duration; returns the old one (marks it if changed)."""
        old = self.dur[t]
        if dur != old:
            self.dur[t] = dur
            self.mark(t)
        return old

    def sweep(self) -> None:
        """Retimes the tasks the marks can reach, in key order (the delta pass).

        Starts at the first marked task, with each resource's previous end read from the task
        before it there, and retimes tasks in key order up to a horizon: the last marked key,
        pushed on by every task whose end moved to its successors and its next task on each
        resource. Past the horizon no task has an input that changed, so it stops there; before
        it, an unchanged task is recomputed to the same value (cheaper than tracking it).
        """
        self.settle()
        lo, hi = self.lo, self.hi
        if lo is None:
            return
        self.lo = self.hi = None
        start, end, dur, deps, res = self.start, self.end, self.dur, self.deps, self.res
        key, succ, rtasks = self.key, self.succ, self.rtasks
        last = [0.0] * self.num_resources
        # per resource, the position of the next task on it the pass times
        at = [0] * self.num_resources
        for r, keys in enumerate(self.rkeys):
            j = at[r] = bisect_left(keys, lo)
            if j:
                last[r] = end[rtasks[r][j - 1]]
        sigma, busy = self.contention, self.busy
        # B: ends on a FIFO resource never decrease, so the latest end among the collectives
        # before `lo` is the largest of their resources' last ends (as the full pass has it)
        b = max(last[1:], default=0.0) if sigma else 0.0
        dirty = bool(sigma)  # whether B may differ from the one the last pass had here
        for t in self.order[bisect_left(self.okeys, lo):]:
            if key[t] > hi and not dirty:
                break
            # when it can start (A4; `_ready`, inlined in this hot loop: the same comparisons)
            s = 0.0
            for d in deps[t]:
                x = end[d]
                if x > s:
                    s = x
            rs = res[t]
            for r in rs:
                x = last[r]
                if x > s:
                    s = x
            if sigma:
                e, b, dirty = _timed(t, s, rs, dur, busy, b, sigma)
            else:
                e = s + dur[t]
            start[t] = s
            if e == end[t]:
                for r in rs:
                    last[r] = e
                    at[r] += 1
                continue
            end[t] = e
            # the change reaches its successors and the next task on each of its resources
            for m in succ[t]:
                if key[m] > hi:
                    hi = key[m]
            for r in rs:
                last[r] = e
                j = at[r] = at[r] + 1
                lst = rtasks[r]
                if j < len(lst) and key[lst[j]] > hi:
                    hi = key[lst[j]]

    def discard_marks(self) -> None:
        """Forgets the marks (a rolled-back proposal restores the times itself)."""
        self.settle()
        self.lo = self.hi = None


# --- pricing: collectives -> communication tasks ----------------------------------------------


class Comm(NamedTuple):
    """One collective priced on the topology (memoised, shared by every task that runs it)."""

    kind: str
    nbytes: int
    axes: tuple[str, ...]
    dur: float
    res: tuple[int, ...]
    link_class: str
    sent: float  # bytes each device sends
    runs: int = 1  # collectives of `nbytes` it stands for: one per microbatch (dur and sent: all)


class Pricing:
    """Memoised reshardings, collective times and resources of one topology and resharder."""

    def __init__(self, topology: Topology, resharder: ReshardModel) -> None:
        self.topology = topology
        self.resharder = resharder
        self.mesh = MeshShape.of(topology)
        self._chains: dict[tuple, tuple[Comm, ...]] = {}
        self._comms: dict[tuple, Comm | None] = {}
        # Where the cores that compute also move the bytes (`ComputeSharing.serial_comm`),
        # a collective holds the compute stream (resource 0) as well as its channels.
        sharing = topology.compute
        self._serial = (0,) if sharing is not None and sharing.serial_comm else ()
        self._resources()

    def _resources(self) -> None:
        """Groups channels that every collective uses alike into one resource each."""
        names = self.mesh.axis_names
        subsets = [s for k in range(1, len(names) + 1) for s in itertools.combinations(names, k)
                   if self.mesh.degree(s) > 1]
        used: dict[str, list[tuple[str, ...]]] = {}
        extra: dict[tuple[str, ...], str] = {}
        for s in subsets:
            chans = self.topology.channels_used(s)
            for c in chans:
                used.setdefault(c.id, []).append(s)
            if not chans:
                extra[s] = "axes:" + "+".join(s)
        classes: dict[tuple, list[str]] = {}
        for cid, subs in used.items():
            classes.setdefault(tuple(subs), []).append(cid)
        self.resource_channels: list[tuple[str, ...]] = [("compute",)]
        of_channel: dict[str, int] = {}
        for chans in classes.values():
            for c in chans:
                of_channel[c] = len(self.resource_channels)
            self.resource_channels.append(tuple(sorted(chans, key=self._channel_order)))
        self.subset_res: dict[tuple[str, ...], tuple[int, ...]] = {}
        for s in subsets:
            if s in extra:
                self.subset_res[s] = (len(self.resource_channels),)
                self.resource_channels.append((extra[s],))
            else:
                self.subset_res[s] = tuple(sorted({of_channel[c.id]
                                                   for c in self.topology.channels_used(s)}))
        self.channels = tuple(sorted((c for chans in self.resource_channels[1:] for c in chans),
                                     key=self._channel_order))

    def _channel_order(self, channel_id: str) -> tuple:
        node = channel_id.split("/")[0].removeprefix("node:")
        return (not node.isdigit(), int(node) if node.isdigit() else 0, channel_id)

    def comm(self, kind: str, nbytes: float, axes: Sequence[str], group_size: int = 0
             ) -> Comm | None:
        """A collective priced, or None when it moves nothing (one device, no bytes).

        A collective whose groups span only part of `axes` (XLA gathering over two of an axis's
        four devices: ``group_size``) is priced by `Topology.collective_time` for that many
        devices.
        """
        key = (kind, nbytes, tuple(axes), group_size)
        if key in self._comms:
            return self._comms[key]
        kind = kind_name(kind)
        ordered = tuple(a for a in self.mesh.axis_names if a in key[2])
        n = self.mesh.degree(ordered)
        out = None
        if 1 < group_size < n:
            n = group_size
        if n > 1 and nbytes > 0:
            dur = self.topology.collective_time(kind, nbytes, ordered, group_size=n)
            ring = self.topology.ring_stats(ordered)
            res = self.subset_res[ordered]
            link_class = (self.topology.links[ring.link].link_class if ring.link is not None
                          else self.resource_channels[res[0]][0].split("/")[-1])
            out = Comm(kind, round(nbytes), ordered, dur, self._serial + res, link_class,
                       bytes_sent(kind, nbytes, n))
        self._comms[key] = out
        return out

    def recording(self, seen: list) -> Pricing:
        """A copy that answers every resharding with nothing and appends it to `seen`."""

        class Recorder:
            def reshard(self, shape, dtype, src, dst, *, partial=()):
                seen.append((shape, dtype, src, dst, partial))
                return ()

        out = copy.copy(self)
        out.resharder, out._chains = Recorder(), {}
        return out

    def chain(self, shape: tuple[int, ...], dtype: str, src: tuple, dst: tuple,
              partial: tuple[str, ...] = ()) -> tuple[Comm, ...]:
        """The priced collectives of resharding `src` -> `dst` (partial sums over `partial`)."""
        key = (shape, dtype, src, dst, partial)
        out = self._chains.get(key)
        if out is None:
            if src == dst and not partial:
                out = ()
            else:
                colls = self.resharder.reshard(shape, dtype, src, dst, partial=partial)
                out = tuple(c for c in (self.comm(x.kind, x.nbytes, x.axes,
                                                  getattr(x, "group_size", 0)) for x in colls)
                            if c is not None)
            assert len(out) < CHAIN, f"a resharding of {len(out)} collectives"
            self._chains[key] = out
        return out


# --- the operator graph, config-independent --------------------------------------------------


class Layout:
    """What the task graph's shape needs from the operator graph: edges, leaves, issue order.

    The issue order is fixed by the graph, whatever the strategy, so a task's key depends only
    on where it sits, and a rebuilt task takes its predecessor's key. With ``n`` operators and
    ``S`` slots per segment (the most operands of any operator, plus two), the segments are:

    * ``j`` (forward of operator j): slot ``o`` the communication of operand ``o`` (a
      parameter gather or an input resharding), slot ``S-2`` the forward task, slot ``S-1``
      the all-reduce of its partial sums;
    * ``2n-1-j`` (backward of operator j, in reverse order): slot 0 the backward task, slot
      ``1+o`` operand ``o``'s backward communication (its cotangent's resharding, or the
      gradient synchronisation of a parameter);
    * ``2n+r``: the optimizer update of the r-th parameter to get its gradient.

    Within a slot, a resharding's collectives take consecutive positions (at most `CHAIN`).
    """

    def __init__(self, graph: OpGraph) -> None:
        ops = graph.operators
        self.n = n = len(ops)
        pos = {op.name: i for i, op in enumerate(ops)}
        self.edges: list[tuple[int, int, int, int]] = []  # (producer, output k, consumer, operand)
        self.in_edges: list[list[int]] = [[] for _ in ops]
        self.out_edges: list[list[int]] = [[] for _ in ops]
        self.operands: list[list[tuple[int, int, int]]] = []  # per op: (code, edge|leaf, reader)
        self.leaf_source: list[str] = []
        self.leaf_is_param: list[bool] = []
        self.leaf_shape: list[tuple[int, ...]] = []
        self.leaf_dtype: list[str] = []
        self.readers: list[list[tuple[int, int]]] = []  # per leaf: (op, operand) in program order
        leaf_of: dict[str, int] = {}
        for j, op in enumerate(ops):
            row = []
            for o, x in enumerate(op.inputs):
                if x.kind == "activation":
                    e = len(self.edges)
                    self.edges.append((pos[x.source], x.index, j, o))
                    self.out_edges[pos[x.source]].append(e)
                    self.in_edges[j].append(e)
                    row.append((EDGE, e, 0))
                elif x.kind in ("param", "batch"):
                    if x.source not in leaf_of:
                        leaf_of[x.source] = len(self.leaf_source)
                        self.leaf_source.append(x.source)
                        self.leaf_is_param.append(x.kind == "param")
                        self.leaf_shape.append(x.shape)
                        self.leaf_dtype.append(x.dtype)
                        self.readers.append([])
                    leaf = leaf_of[x.source]
                    row.append((LEAF, leaf, len(self.readers[leaf])))
                    self.readers[leaf].append((j, o))
                else:
                    row.append((CONST, -1, 0))
            self.operands.append(row)
        self.op_leaves = [sorted({ref for code, ref, _ in row if code == LEAF})
                          for row in self.operands]
        self.slots = max((len(op.inputs) for op in ops), default=0) + 2
        # Updates run in the order gradients complete: by their first reader, last first.
        params = [leaf for leaf, p in enumerate(self.leaf_is_param) if p]
        params.sort(key=lambda leaf: (-self.readers[leaf][0][0], self.readers[leaf][0][1]))
        self.update_seg = {leaf: 2 * n + r for r, leaf in enumerate(params)}
        self.edge_name = [f"{ops[p].name} -> {ops[j].name}" for p, _, j, _ in self.edges]
        # Edges that carry the same producer output, in edge order (a value read by several
        # operators): the forward resharding to one layout is done once for all of them (one
        # layer's slice of a stacked value: the readers of that slice).
        by_output: dict[tuple[int, int, tuple[int, ...]], list[int]] = {}
        keys = [(p, k, ops[j].inputs[o].layer) for p, k, j, o in self.edges]
        for e, key in enumerate(keys):
            by_output.setdefault(key, []).append(e)
        self.siblings: list[list[int]] = [by_output[key] for key in keys]

    def key(self, seg: int, slot: int, pos: int = 0) -> int:
        return (seg * self.slots + slot) * CHAIN + pos

    def fwd_key(self, j: int, slot: int, pos: int = 0) -> int:
        return self.key(j, slot, pos)

    def bwd_key(self, j: int, slot: int, pos: int = 0) -> int:
        return self.key(2 * self.n - 1 - j, slot, pos)


_FEW = 16  # changes to a sorted list that `_splice` makes one by one (more: one sort)


def _splice(lst: list[int], keys: list[int], key: list[int], new: list[int],
            gone: list[tuple[int, int]]) -> None:
    """Removes the tasks `gone` (``(task, its key)``) from `lst`, a list of tasks sorted by key
    with their `keys` beside it, and inserts the tasks `new` (`key` their keys now)."""
    if len(new) + len(gone) <= _FEW:
        for t, k in gone:
            i = bisect_left(keys, k)
            assert lst[i] == t, "detaching a task that is not attached"
            del keys[i]
            del lst[i]
        for t in new:
            k = key[t]
            i = bisect_left(keys, k)
            keys.insert(i, k)
            lst.insert(i, t)
        return
    if gone:
        drop = {t for t, _ in gone}
        lst[:] = [t for t in lst if t not in drop]
    lst += new
    lst.sort(key=key.__getitem__)  # two sorted runs: one merge
    keys[:] = [key[t] for t in lst]


_COMPUTE = (0,)  # the resources of a compute task


def _timed(t: int, s: float, rs: tuple, dur: list, busy: list, b: float, sigma: float
           ) -> tuple[float, float, bool]:
    """Task `t`'s end under contention (module doc), starting at `s` with ``B = b`` so far:
    ``(end, B after it, whether B may differ from the last pass's from here)``. A compute
    task reads B (and records it in `busy`); a collective may push it on."""
    if rs == _COMPUTE:
        moved = busy[t] != b
        busy[t] = b
        return _contended(s, dur[t], b, sigma), b, moved
    e = s + dur[t]
    return e, (e if e > b and any(rs) else b), True


def _contended(s: float, dur: float, busy: float, sigma: float) -> float:
    """The end of a compute task that starts at `s` with a collective running until `busy`:
    at ``1 / (1 + sigma)`` of its rate until then (module doc, contention)."""
    if busy <= s:
        return s + dur
    return s + dur + min(dur * sigma, (busy - s) * sigma / (1.0 + sigma))


def _ready(t: int, deps: list, res: list, end: list, last: list) -> float:
    """When task `t` can start (A4): after every dependency's end and the last task so far on
    each of its resources (A3: each resource runs its tasks in issue order). `sweep` makes the
    same comparisons inline (a proposal of every layer's operator retimes every task)."""
    s = 0.0
    for d in deps[t]:
        e = end[d]
        if e > s:  # max(s, e), as the sweep has it
            s = e
    for r in res[t]:
        e = last[r]
        if e > s:
            s = e
    return s
