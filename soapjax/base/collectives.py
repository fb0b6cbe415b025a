"""What a collective costs: one table of ring closed forms, for a group of any size.

Every place that prices a collective (`soapjax.topology.cluster.Topology.collective_time`, the
simulator's communication tasks, the bytes `soapjax check` reports) reads this table. A ring
collective over ``n`` devices, each holding ``s = nbytes`` (the buffer convention below), sends
``sent(n) * s`` bytes per device and pays ``steps(n)`` latencies, so on a ring of bandwidth
``b`` and latency ``a`` it takes ``sent(n) * s / b + steps(n) * a``:

==================  ============  ============  ====================================
kind                sent(n)       steps(n)      ``nbytes`` is, per device
==================  ============  ============  ====================================
all_reduce          2(n-1)/n      2(n-1)        the buffer being reduced
all_gather          (n-1)/n       n-1           the gathered OUTPUT
reduce_scatter      (n-1)/n       n-1           the INPUT
all_to_all          (n-1)/n       n-1           the buffer (s/n to each peer)
collective_permute  1             1             the buffer sent to one peer
point_to_point      1             1             the buffer; one lone transfer
==================  ============  ============  ====================================

An all_reduce over several nodes may also run as NCCL's tree (`tree_time`): a chain inside
each node and a double binary tree across nodes, ``log2`` of the nodes' latencies where the
ring pays one per step, at 0.9 of the bandwidth (NCCL's own tuning model). The topology's
``auto`` takes the cheapest of ring, hierarchical rings and tree, as NCCL's tuner does.

Which ``b`` and ``a`` a kind sees on a topology (the contended ring, the all-to-all's
all-pairs bandwidth, a lone transfer's) is the topology's business; the formulas are here.

**The all-to-all is balanced.** Its row assumes every device sends ``s/n`` to each peer, so
the slowest pair carries what the average does. That holds by construction for the
all-to-alls soapjax plans: a resharding moves a dense tensor between two even shardings, and
a mixture of experts' tokens reach their experts in GShard's capacity form
(`soapjax_zoo.moe`), where every expert's buffer ``[E, B, C, d]`` has the capacity's fixed
size ``C`` whatever the router chose (tokens past it are dropped, free slots are zeros), so
each device sends the same bytes to each peer even when the router's load is uneven. The
router's imbalance costs compute and dropped tokens there, not communication. A dropless MoE
(tokens sorted to their experts, ``ragged_all_to_all``) would move uneven pieces, bounded by
the busiest expert's load; this table does not price that.

>>> ring_time("all_reduce", 1e6, 4, bandwidth=1e9, latency=1e-6)  # 1.5 ms + 6 us
0.001506
>>> bytes_sent("all-gather", 1024, 4)  # HLO spellings work too
768.0

Each row also holds the kind's HLO opcode (``"all-gather"``; none for point_to_point, which
XLA emits as send and recv): `soapjax.measure.hlo` reads compiled programs' collectives by those
opcodes, `soapjax.measure.links` measures every kind XLA emits (`XLA_COLLECTIVES`) and the ideal
resharding model (`soapjax.cost.reshard`) speaks in them. Adding a kind is a row here and, if XLA
emits it, its measuring program in `soapjax.measure.links`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal, NamedTuple, get_args

__all__ = ["ALGORITHMS", "COLLECTIVES", "FORMULAS", "HLO_OPCODES", "TREE_BANDWIDTH",
           "XLA_COLLECTIVES", "CollectiveKind", "Formula", "bytes_sent", "hierarchical_time",
           "kind_name", "ring_time", "tree_time"]

CollectiveKind = Literal["all_reduce", "all_gather", "reduce_scatter", "all_to_all",
                         "collective_permute", "point_to_point"]
COLLECTIVES: tuple[CollectiveKind, ...] = get_args(CollectiveKind)
ALGORITHMS: tuple[str, ...] = ("auto", "ring", "hierarchical", "tree")
# NCCL's tuning model (NVIDIA/nccl, src/graph/tuning.cc, ncclTopoTuneModel): a tree's bus
# bandwidth is 0.9 of the ring's ("busBw = std::min(busBw*.9, maxTreeBw)"), its latency
# ``2 ((ranks per node - 1) intraLat + log2(nodes) interLat)`` against the ring's one per step.
TREE_BANDWIDTH = 0.9


class Formula(NamedTuple):
    """One row of the table: per-device bytes sent (a fraction of nbytes), latency steps, the
    HLO opcode of the kind (None where XLA has no instruction of its own for it), and whether
    `hierarchical_time` prices it (rings inside nodes, then across)."""

    sent: Callable[[int], float]
    steps: Callable[[int], int]
    hlo: str | None
    hierarchical: bool = False


FORMULAS: dict[CollectiveKind, Formula] = {
    "all_reduce": Formula(lambda n: 2 * (n - 1) / n, lambda n: 2 * (n - 1), "all-reduce", True),
    "all_gather": Formula(lambda n: (n - 1) / n, lambda n: n - 1, "all-gather", True),
    "reduce_scatter": Formula(lambda n: (n - 1) / n, lambda n: n - 1, "reduce-scatter", True),
    "all_to_all": Formula(lambda n: (n - 1) / n, lambda n: n - 1, "all-to-all"),
    "collective_permute": Formula(lambda n: 1.0, lambda n: 1, "collective-permute"),
    "point_to_point": Formula(lambda n: 1.0, lambda n: 1, None),
}
assert tuple(FORMULAS) == COLLECTIVES

# The kinds XLA emits as collective instructions, and their HLO opcodes.
XLA_COLLECTIVES: tuple[CollectiveKind, ...] = tuple(k for k, f in FORMULAS.items() if f.hlo)
HLO_OPCODES: dict[str, CollectiveKind] = {f.hlo: k for k, f in FORMULAS.items() if f.hlo}


def kind_name(kind: str) -> str:
    """``"all-reduce"`` (HLO) or ``"all_reduce"`` -> ``"all_reduce"``."""
    return HLO_OPCODES.get(kind, kind.replace("-", "_"))


def bytes_sent(kind: str, nbytes: float, group_size: int) -> float:
    """Bytes each device sends in one ring collective of `group_size` devices."""
    return FORMULAS[kind_name(kind)].sent(group_size) * nbytes


def ring_time(kind: str, nbytes: float, n: int, bandwidth: float, latency: float) -> float:
    """Seconds of a ring collective over `n` devices (0 for one device)."""
    if n <= 1:
        return 0.0
    formula = FORMULAS[kind_name(kind)]
    return formula.sent(n) * nbytes / bandwidth + formula.steps(n) * latency


def tree_time(kind: str, nbytes: float, local: tuple[int, float, float],
              cross: tuple[int, float, float]) -> float:
    """NCCL's tree all-reduce: a chain through each node's ``m`` devices, a double binary tree
    across the ``k`` nodes, pipelined (NCCL's tuning model, `TREE_BANDWIDTH`).

    Its bandwidth term is the hierarchical algorithm's at `TREE_BANDWIDTH` of the links; its
    latency ``2 ((m - 1) a_local + ceil(log2 k) a_cross)``, where a ring pays one latency per
    step: a tree wins on small buffers over many nodes and loses 10 % on large ones.

    >>> round(tree_time("all_reduce", 0.0, (8, 1e11, 1e-6), (1024, 1e10, 5e-6)) * 1e6, 1)
    114.0
    """
    if kind_name(kind) != "all_reduce":
        raise ValueError(f"the tree algorithm is an all_reduce's, not {kind_name(kind)}'s")
    (m, b_l, a_l), (k, b_x, a_x) = local, cross
    moved = hierarchical_time(kind, nbytes, (m, b_l, 0.0), (k, b_x, 0.0)) / TREE_BANDWIDTH
    return moved + 2 * ((m - 1) * a_l + math.ceil(math.log2(k)) * a_x) if k > 1 or m > 1 else 0.0


def hierarchical_time(
    kind: str,
    nbytes: float,
    local: tuple[int, float, float],
    cross: tuple[int, float, float],
) -> float:
    """Rings inside each node, then across nodes, for all_reduce, all_gather, reduce_scatter.

    `local` and `cross` are ``(devices per ring, bandwidth, latency)`` of the in-node rings
    (``m`` devices) and the cross-node rings (``k`` nodes). With ``RS`` and ``AG`` the ring
    times above: all_reduce = ``RS(s, m) + AR(s/m, k) + AG(s, m)`` (AR as RS + AG);
    all_gather = ``AG(s/m, k) + AG(s, m)``; reduce_scatter = ``RS(s, m) + RS(s/m, k)``.
    """
    (m, b_l, a_l), (k, b_x, a_x) = local, cross
    in_node = ring_time("all_gather", nbytes, m, b_l, a_l)
    across = ring_time("all_gather", nbytes / m, k, b_x, a_x)
    if kind_name(kind) == "all_reduce":
        return 2 * in_node + 2 * across
    return in_node + across
