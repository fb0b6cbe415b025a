"""Stage 2, the cluster: topology files read into devices, links and named mesh axes, and what a
collective costs on them.

- `_routing`: Routes over a topology's link graph, and what the rings of a collective see on them.
- `_topology_file`: The topology file: a cluster as TOML, read into the fields of a
  `soapjax.topology.cluster.Topology`.
- `cluster`: Topology: the devices, links and named mesh axes of a cluster, and what communication
  costs.

Its public names are `soapjax.topology.cluster`'s, re-exported here.
"""

from soapjax.topology import cluster as _cluster
from soapjax.topology.cluster import (
    ALGORITHMS as ALGORITHMS,
    CAPABILITIES as CAPABILITIES,
    COLLECTIVES as COLLECTIVES,
    KNOWN_DTYPES as KNOWN_DTYPES,
    LINK_CLASSES as LINK_CLASSES,
    MESHES_DIR as MESHES_DIR,
    PLATFORMS as PLATFORMS,
    REQUIRED_DTYPES as REQUIRED_DTYPES,
    Capabilities as Capabilities,
    Channel as Channel,
    CollectiveModel as CollectiveModel,
    ComputeSharing as ComputeSharing,
    DeviceSpec as DeviceSpec,
    Efficiency as Efficiency,
    KernelSpec as KernelSpec,
    Link as Link,
    Platform as Platform,
    RingStats as RingStats,
    Topology as Topology,
    bytes_sent as bytes_sent,
    list_topologies as list_topologies,
    load_topology as load_topology,
    make_mesh as make_mesh,
    scaled_topology as scaled_topology,
    stage_topology as stage_topology,
)

__all__ = list(_cluster.__all__)  # the names of `soapjax.topology.cluster`
