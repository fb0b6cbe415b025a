"""The attached devices against a topology's: can its operator times be measured here?

`soapjax.cost.operators` measures shard programs only where the local backend is the topology's (its
platform and, for accelerators, its device kind), and the training helper plans on the local
devices' own topology. Device kinds are matched on model numbers, not on the whole name: the
topology file of a DGX H100 says ``"H100 SXM5 80GB"``, jax says ``"NVIDIA H100 80GB HBM3"``
(`local_backend_matches`); CPUs match on the platform alone (``cpu8`` on any CPU).
`local_topology` is the first shipped topology that matches (``cpu8`` on a CPU).
"""

from __future__ import annotations

import jax

from soapjax.base.errors import CostError
from soapjax.measure import _timing
from soapjax.topology.cluster import Topology, list_topologies, load_topology

__all__ = ["local_backend_matches", "local_topology"]


# Words in device names that say how a chip is packaged, not which chip it is.
_FORM_FACTORS = ("SXM", "HBM", "PCIE", "GDDR", "NVL")


def _kinds_match(topology_kind: str, local_kind: str) -> bool:
    """Whether a topology's device kind names the local device (model numbers must agree).

    ``"H100 SXM5 80GB"`` matches jax's ``"NVIDIA H100 80GB HBM3"`` (both say H100);
    ``"Tesla P100-SXM2-16GB"`` does not match ``"Tesla V100-SXM2-16GB"``.
    """

    def models(kind: str) -> set[str]:
        words = "".join(c if c.isalnum() else " " for c in kind.upper()).split()
        return {w for w in words if any(c.isdigit() for c in w) and any(c.isalpha() for c in w)
                and not w.endswith("GB") and not w.startswith(_FORM_FACTORS)}

    a, b = models(topology_kind), models(local_kind)
    return bool(a & b) if a and b else topology_kind.strip().lower() == local_kind.strip().lower()


def local_backend_matches(topology: Topology) -> tuple[bool, str]:
    """Whether the local devices are the topology's, and why not."""
    local, dev = _timing.local_platform(), jax.devices()[0]
    if local != topology.platform:
        return False, (f"topology {topology.name!r} has {topology.platform} devices but the local "
                       f"backend is {local}")
    if local != "cpu" and not _kinds_match(topology.device.kind, dev.device_kind):
        return False, (f"topology {topology.name!r} has {topology.device.kind!r} devices but the "
                       f"local device is {dev.device_kind!r}")
    return True, ""


def local_topology() -> Topology:
    """A shipped topology whose devices are the local ones (``cpu8`` on a CPU).

    Raises:
      CostError: none of the shipped topologies has the local device kind.
    """
    for name in (["cpu8"] if _timing.local_platform() == "cpu" else []) + list(list_topologies()):
        t = load_topology(name)
        if local_backend_matches(t)[0]:
            return t
    dev = jax.devices()[0]
    raise CostError(f"no shipped topology has the local device ({dev.platform}, "
                    f"{dev.device_kind!r}); write one with that device kind (soapjax/topology/"
                    "meshes/ holds examples) and pass its path")
