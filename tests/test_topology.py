"""Tests of soapjax.topology.cluster: the TOML format, shipped topologies, collective costs, jax
meshes."""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from soapjax import cli
from soapjax.base.errors import SoapjaxError, TopologyError
from soapjax.topology.cluster import (
    Channel,
    Topology,
    list_topologies,
    load_topology,
    make_mesh,
    scaled_topology,
)

SHIPPED = ("cpu8", "dgx-h100x32", "dgx-h100x8", "dgx-h100x1024", "h100x64", "k80x64", "p100x16")
GB = 1e9
US = 1e-6


# --- shipped topologies ----------------------------------------------------------------------


def test_list_topologies_names_the_shipped_files():
    assert set(SHIPPED) <= set(list_topologies())


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_topology_loads_consistently(name):
    t = load_topology(name)
    assert t.name == name
    assert Path(t.source_file).name == f"{name}.toml"
    assert int(np.prod(t.axis_sizes)) == t.num_devices == t.num_nodes * t.devices_per_node
    assert t == load_topology(name) and hash(t) == hash(load_topology(name))
    assert t.fingerprint() == load_topology(name).fingerprint()
    assert re.fullmatch(r"[0-9a-f]{64}", t.fingerprint())
    for dtype in ("float32", "bfloat16", "float16"):
        assert t.device.peak_flops_for(dtype) > 0


def test_fingerprints_differ_between_topologies():
    assert len({load_topology(n).fingerprint() for n in SHIPPED}) == len(SHIPPED)


def test_device_figures_of_the_paper_and_dgx_clusters():
    p100 = load_topology("p100x16").device
    assert p100.peak_flops_for("float32") == pytest.approx(10.6e12)
    assert p100.peak_flops_for(jnp.float16) == pytest.approx(21.2e12)
    assert (p100.memory_bandwidth, p100.memory_bytes) == (pytest.approx(732 * GB), 16 * 10**9)
    h100 = load_topology("dgx-h100x8").device
    assert h100.peak_flops_for(jnp.bfloat16) == pytest.approx(989e12)
    assert h100.peak_flops_for(np.float32) == pytest.approx(67e12)
    assert h100.memory_bandwidth == pytest.approx(3.35e12)
    k80 = load_topology("k80x64").device
    assert (k80.peak_flops_for("float32"), k80.memory_bandwidth) == (
        pytest.approx(4.37e12),
        pytest.approx(240 * GB),
    )
    with pytest.raises(TopologyError, match=r"no peak FLOP/s for dtype 'int8'.*float32"):
        p100.peak_flops_for("int8")


# Per-axis bandwidth: an in-node axis sees its fabric, a cross-node axis the network. A ring over
# `node` runs one ring per local GPU at once, so on p100x16 and k80x64 four rings share each node's
# single NIC; on DGX H100 each GPU has its own NIC.
@pytest.mark.parametrize(
    "name, axis, bandwidth, link_class, link_bandwidth, sharing, latency",
    [
        ("p100x16", "gpu", 20 * GB, "nvlink", 20 * GB, 1, 1 * US),
        ("p100x16", "node", 12.5 * GB / 4, "infiniband", 12.5 * GB, 4, 4 * US),
        ("k80x64", "gpu", 15.75 * GB, "pcie", 15.75 * GB, 1, 2 * US),
        ("k80x64", "node", 7 * GB / 4, "infiniband", 7 * GB, 4, 5 * US),
        # the H100 files' NVLink and InfiniBand at the 0.8 of their line rates NCCL reaches
        ("dgx-h100x8", "model", 360 * GB, "nvlink", 360 * GB, 1, 1 * US),
        ("dgx-h100x32", "model", 360 * GB, "nvlink", 360 * GB, 1, 1 * US),
        ("dgx-h100x32", "node", 40 * GB, "infiniband", 40 * GB, 1, 4 * US),
        ("h100x64", "node", 40 * GB, "infiniband", 40 * GB, 1, 4 * US),
        ("cpu8", "model", 5 * GB, "shared_memory", 5 * GB, 1, 10 * US),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_axis_bandwidth_comes_from_the_links_it_crosses(
    name, axis, bandwidth, link_class, link_bandwidth, sharing, latency
):
    t = load_topology(name)
    r = t.ring_stats((axis,))
    assert t.axis_bandwidth((axis,)) == pytest.approx(bandwidth)
    assert t.axis_latency((axis,)) == pytest.approx(latency)
    assert t.links[r.link].link_class == link_class
    assert t.links[r.link].bandwidth == pytest.approx(link_bandwidth)
    assert r.sharing == sharing


def test_groups_of_an_axis_follow_the_mesh():
    t = load_topology("p100x16")
    assert t.groups(("gpu",))[:2] == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert t.groups(("node",))[:2] == ((0, 4, 8, 12), (1, 5, 9, 13))
    assert t.groups(("gpu", "node")) == t.groups(("node", "gpu")) == (tuple(range(16)),)
    assert t.groups(()) == tuple((d,) for d in range(16))


def test_intra_node_axes_are_the_axes_whose_groups_stay_in_a_node():
    """p100x16 (node=4 x gpu=4): the gpu groups are nodes; dgx-a100x3072-64 (node=8 x data=2
    x model=4): both in-node axes; cpu8-nodes (node=2 x data=2 x model=2, nodes of 4): data
    and model. The answer is kept on the topology (one object each time)."""
    p100 = load_topology("p100x16")
    assert p100.intra_node_axes() == ("gpu",)
    assert p100.intra_node_axes() is p100.intra_node_axes()
    assert load_topology("dgx-a100x3072-64").intra_node_axes() == ("data", "model")
    nodes = load_topology(str(Path(__file__).parent / "meshes" / "cpu8-nodes.toml"))
    assert nodes.intra_node_axes() == ("data", "model")  # node=2 x data=2 x model=2


# --- collective costs: closed forms ------------------------------------------------------------


S = 64e6  # bytes


def ring_ar(s, n, b, a):
    return 2 * (n - 1) / n * s / b + 2 * (n - 1) * a


def ring_ag(s, n, b, a):
    return (n - 1) / n * s / b + (n - 1) * a


def test_ring_collectives_match_closed_forms_inside_a_dgx():
    t = load_topology("dgx-h100x8")
    n, b, a = 8, 360 * GB, 1 * US  # NVLink 4's 450 GB/s at NCCL's 0.8
    ar = ring_ar(S, n, b, a)
    assert t.collective_time("all_reduce", S, ("data", "model"), "ring") == pytest.approx(ar)
    assert t.collective_time("all-reduce", S, ("data", "model")) == pytest.approx(ar)
    assert (t.collective_time("all_gather", S, ("data", "model"))
            == pytest.approx(ring_ag(S, n, b, a)))
    assert (t.collective_time("reduce_scatter", S, ("data", "model"))
            == pytest.approx(ring_ag(S, n, b, a)))
    # every GPU sends s/8 to each of 7 peers through its one NVSwitch port
    assert (t.collective_time("all_to_all", S, ("data", "model"))
            == pytest.approx(ring_ag(S, n, b, a)))
    assert t.collective_time("collective_permute", S, ("data", "model")) == pytest.approx(S / b + a)
    assert t.collective_time("point_to_point", S, ("data", "model")) == pytest.approx(S / b + a)


def test_ring_collectives_across_shared_nics():
    t = load_topology("k80x64")
    n, b, a = 16, 7 * GB / 4, 5 * US
    assert t.collective_time("all_reduce", S, ("node",)) == pytest.approx(ring_ar(S, n, b, a))
    assert t.collective_time("all_gather", S, ("node",)) == pytest.approx(ring_ag(S, n, b, a))
    # a lone transfer has the NIC to itself
    assert t.collective_time("point_to_point", S, ("node",)) == pytest.approx(S / (7 * GB) + a)


def test_all_to_all_over_direct_links_uses_all_of_them():
    # p100x16: every pair of GPUs in a node has its own 20 GB/s NVLink, so each device sends its
    # s/4 to the 3 others at once: time = s/4 / 20 GB/s (+ 3 latencies)
    t = load_topology("p100x16")
    assert t.collective_time("all_to_all", S, ("gpu",)) == pytest.approx(S / 4 / (20 * GB) + 3 * US)


def test_a_group_over_part_of_an_axis_uses_the_same_table():
    # p100x16, gpu=4 over direct NVLinks: a 2-device group of the 4 is priced with n=2 at what
    # the whole axis sees (the ring's 20 GB/s; the all-to-all's all-pairs 3 x 20 GB/s)
    t = load_topology("p100x16")
    b, a = t.axis_bandwidth(("gpu",)), t.axis_latency(("gpu",))
    got = t.collective_time("all_gather", S, ("gpu",), group_size=2)
    assert got == pytest.approx(ring_ag(S, 2, b, a), rel=1e-15)
    got = t.collective_time("all_to_all", S, ("gpu",), group_size=2)
    assert got == pytest.approx(S / 2 / (3 * 20 * GB) + US, rel=1e-15)
    assert t.collective_time("all_gather", S, ("gpu",), group_size=4) == t.collective_time(
        "all_gather", S, ("gpu",))
    with pytest.raises(TopologyError, match=r"group_size 8 over axes \('gpu',\): expected 1 .. 4"):
        t.collective_time("all_gather", S, ("gpu",), group_size=8)


def test_hierarchical_collectives_match_closed_forms():
    t = load_topology("dgx-h100x32")
    axes = ("node", "data", "model")
    # NCCL's 0.8 of the line rates (the links' efficiency)
    m, bl, al = 8, 360 * GB, 1 * US  # in a node: NVSwitch
    k, bx, ax = 4, 40 * GB, 4 * US  # across nodes: one cross ring per GPU, each on its own NIC
    hier_ar = ring_ag(S, m, bl, al) + ring_ar(S / m, k, bx, ax) + ring_ag(S, m, bl, al)
    hier_ag = ring_ag(S / m, k, bx, ax) + ring_ag(S, m, bl, al)
    assert t.collective_time("all_reduce", S, axes, "hierarchical") == pytest.approx(hier_ar)
    assert t.collective_time("all_gather", S, axes, "hierarchical") == pytest.approx(hier_ag)
    assert t.collective_time("reduce_scatter", S, axes, "hierarchical") == pytest.approx(hier_ag)
    # the flat ring over all 32 leaves each node once, through one 50 GB/s NIC (40 GB/s to
    # NCCL), with the slowest hop's latency (4 us) on every step
    flat_ar = ring_ar(S, 32, 40 * GB, 4 * US)
    assert t.collective_time("all_reduce", S, axes, "ring") == pytest.approx(flat_ar)
    assert t.collective_time("all_reduce", S, axes) == pytest.approx(min(hier_ar, flat_ar))
    assert hier_ar < flat_ar


def test_auto_takes_the_cheaper_algorithm_on_a_shared_nic():
    # p100x16: the flat ring leaves a node through the NIC with one flow; the hierarchical
    # cross-node rings put 4 flows on it. Big buffers: ring wins; tiny ones: fewer latencies win.
    t = load_topology("p100x16")
    axes = ("node", "gpu")
    for s in (1e3, 1e9):
        ring = t.collective_time("all_reduce", s, axes, "ring")
        hier = t.collective_time("all_reduce", s, axes, "hierarchical")
        assert ring == pytest.approx(ring_ar(s, 16, 12.5 * GB, 4 * US))
        expected = ring_ag(s, 4, 20 * GB, 1 * US) * 2 + ring_ar(s / 4, 4, 12.5 * GB / 4, 4 * US)
        assert hier == pytest.approx(expected)
        tree = t.collective_time("all_reduce", s, axes, "tree")
        assert t.collective_time("all_reduce", s, axes) == pytest.approx(min(ring, hier, tree))
    assert t.collective_time("all_reduce", 1e9, axes) < t.collective_time(
        "all_reduce", 1e9, axes, "hierarchical"
    )
    assert t.collective_time("all_reduce", 1e3, axes) < t.collective_time(
        "all_reduce", 1e3, axes, "ring"
    )


def test_the_tree_all_reduce_is_nccls_and_wins_small_buffers_over_many_nodes():
    """NCCL's tree (its tuning model): the hierarchical rings' bytes at 0.9 of the bandwidth,
    2 ((m - 1) in-node + log2(k) cross-node) latencies where the rings pay one per step."""
    t = load_topology("dgx-a100x3072")  # 384 DGX nodes
    axes = ("node", "data", "model")
    (m, bl, al), (k, bx, ax) = (x[:3] for x in t.hierarchy_stats(axes))
    assert (m, k) == (8, 384)
    for s in (1e3, 1e6, 1e9):
        hier = t.collective_time("all_reduce", s, axes, "hierarchical")
        ring = t.collective_time("all_reduce", s, axes, "ring")
        tree = t.collective_time("all_reduce", s, axes, "tree")
        moved = (ring_ag(s, m, bl, 0) * 2 + ring_ar(s / m, k, bx, 0)) / 0.9
        assert tree == pytest.approx(moved + 2 * (7 * al + 9 * ax))
        assert t.collective_time("all_reduce", s, axes) == pytest.approx(min(hier, ring, tree))
    small, large = 1e3, 1e9
    assert t.collective_time("all_reduce", small, axes) == t.collective_time(
        "all_reduce", small, axes, "tree") < t.collective_time("all_reduce", small, axes,
                                                               "hierarchical")
    # over 4 nodes the rings' few latencies cost less than the tree's tenth of the bandwidth
    four = load_topology("dgx-h100x32")
    assert four.collective_time("all_reduce", large, axes) < four.collective_time(
        "all_reduce", large, axes, "tree")
    with pytest.raises(TopologyError, match=r"group_size 4 over axes .* with the ring"):
        t.collective_time("all_reduce", small, axes, "tree", group_size=4)
    # inside one node the tree is a chain: never cheaper than the ring
    one = load_topology("dgx-h100x8")
    assert one.collective_time("all_reduce", small, ("data", "model")) < one.collective_time(
        "all_reduce", small, ("data", "model"), "tree")


def test_collectives_over_no_axes_cost_nothing():
    t = load_topology("cpu8")
    assert t.collective_time("all_reduce", S, ()) == 0.0
    assert t.axis_bandwidth(()) == float("inf")


@pytest.mark.parametrize(
    "kind, axes, algorithm, message",
    [
        ("all_sum", ("gpu",), "auto", r"collective kind 'all_sum': expected one of all_reduce"),
        ("all_reduce", ("tensor",), "auto", r"axes \('tensor',\): expected distinct names among"),
        ("all_reduce", ("gpu", "gpu"), "auto", r"expected distinct names"),
        ("all_reduce", ("gpu",), "mesh", r"algorithm 'mesh': expected one of auto, ring"),
        ("all_gather", ("gpu",), "tree", r"'tree' is defined for all_reduce, not all_gather"),
        ("all_to_all", ("gpu",), "hierarchical", r"'hierarchical' is defined for all_reduce"),
    ],
)
def test_bad_collective_queries(kind, axes, algorithm, message):
    with pytest.raises(TopologyError, match=message):
        load_topology("p100x16").collective_time(kind, S, axes, algorithm)


# --- resources for the simulator ----------------------------------------------------------------


def test_channels_of_an_in_node_axis_and_a_cross_node_axis():
    t = load_topology("p100x16")
    assert t.channels_used(("gpu",)) == tuple(
        Channel(f"node:{n}/nvlink", "nvlink", n) for n in range(4)
    )
    cross = {c.id for c in t.channels_used(("node",))}
    assert cross == {f"node:{n}/{c}" for n in range(4) for c in ("pcie", "infiniband")}
    assert all(t.links[i].link_class == "nvlink" for i in t.links_used(("gpu",)))
    assert len(t.links_used(("gpu",))) == 24  # 6 NVLinks in each of 4 nodes


def test_channels_overlap_exactly_when_fabrics_are_shared():
    t = load_topology("dgx-h100x32")
    assert not set(t.channels_used(("data", "model"))) & set(t.channels_used(("node",)))
    k80 = load_topology("k80x64")
    # the K80's cross-node traffic climbs the same PCIe tree as its in-node traffic
    in_node, cross = (set(k80.channels_used((axis,))) for axis in ("gpu", "node"))
    assert in_node < cross


# --- the file format: errors name the file, the key and what was expected -----------------------


GOOD = """\
platform = "gpu"

[device]
kind = "test gpu"
memory_bytes = "16 GB"
memory_bandwidth = "732 GB/s"
peak_flops = { float32 = 1e13, bfloat16 = "20 TFLOP/s", float16 = "20 TFLOP/s" }

[nodes]
count = 2
devices_per_node = 2
switches = { host = 1 }

[fabric]
switches = { ib = 1 }

[mesh]
axes = { node = 2, gpu = 2 }

[[links]]
class = "nvlink"
bandwidth = "20 GB/s"
latency = "1 us"
connect = [["device:0", "device:1"]]

[[links]]
class = "infiniband"
bandwidth = "100 Gb/s"
latency = 1.5e-6
connect = [["device:*", "host"], ["host", "ib"]]
"""


def write(tmp_path: Path, text: str, name: str = "tiny.toml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_a_small_file_parses_with_units(tmp_path):
    t = load_topology(str(write(tmp_path, GOOD)))
    assert (t.name, t.num_devices, t.mesh_shape) == ("tiny", 4, {"node": 2, "gpu": 2})
    assert t.device.memory_bytes == 16 * 10**9
    assert t.axis_bandwidth(("gpu",)) == pytest.approx(20 * GB)
    assert t.axis_bandwidth(("node",)) == pytest.approx(12.5 * GB / 2)  # 100 Gb/s, 2 flows
    assert t.axis_latency(("node",)) == pytest.approx(3 * 1.5 * US + 1.5 * US)
    assert {link.a for link in t.links} >= {"device:2", "node:1/host"}
    # the fingerprint ignores where the file is and how numbers are written, not the name
    same = GOOD.replace('"20 GB/s"', "20e9").replace('"1 us"', "1e-6")
    assert load_topology(write(tmp_path, same, "other.toml")).fingerprint() != t.fingerprint()
    renamed = 'name = "tiny"\n' + same
    assert load_topology(write(tmp_path, renamed, "other.toml")).fingerprint() == t.fingerprint()


@pytest.mark.parametrize(
    "old, new, message",
    [
        pytest.param(
            'memory_bandwidth = "732 GB/s"',
            'memory_bandwith = "732 GB/s"',
            r"\[device\]: unknown key 'memory_bandwith' \(did you mean 'memory_bandwidth'\?\); "
            r"expected one of: kind, peak_flops, memory_bandwidth, memory_bytes",
            id="unknown-key",
        ),
        pytest.param(
            "axes = { node = 2, gpu = 2 }",
            "axes = { node = 2, gpu = 4 }",
            r"\[mesh\]\.axes: sizes node=2 x gpu=4 = 8, expected the device count 4 "
            r"\(\[nodes\] count=2 x devices_per_node=2\)",
            id="axis-sizes",
        ),
        pytest.param(
            'bandwidth = "20 GB/s"\n',
            "",
            r"links\[0\]: missing required key 'bandwidth' \(bytes/s in each direction",
            id="missing-bandwidth",
        ),
        pytest.param(
            '["device:0", "device:1"]',
            '["device:0", "device:2"]',
            r"links\[0\] \(class 'nvlink'\)\.connect: 'device:2' names a device that does not "
            r"exist; expected device:0 \.\. device:1 \(each node has 2 devices\)",
            id="no-such-device",
        ),
        pytest.param(
            '["host", "ib"]',
            '["host", "spine"]',
            r"links\[1\] \(class 'infiniband'\)\.connect: 'spine' is no device or switch",
            id="no-such-switch",
        ),
        pytest.param(
            'bandwidth = "100 Gb/s"',
            'bandwidth = "100 Gbit"',
            r"links\[1\] \(class 'infiniband'\)\.bandwidth: expected bytes/s as a number or a "
            r"string like \"20 GB/s\"",
            id="bad-unit",
        ),
        pytest.param(
            'class = "nvlink"',
            'class = "nvlink5"',
            r"links\[0\] \(class 'nvlink5'\)\.class: expected one of nvlink, pcie, infiniband",
            id="unknown-link-class",
        ),
        pytest.param(
            "float32 = 1e13, ",
            "",
            r"\[device\]\.peak_flops: expected one entry for each of float32, bfloat16, float16",
            id="missing-dtype",
        ),
        pytest.param(
            '["device:*", "host"], ["host", "ib"]',
            '["device:*", "host"]',
            r"links: device:2 cannot reach device:0; expected the links to join every pair",
            id="disconnected",
        ),
        pytest.param(
            'platform = "gpu"',
            'platform = "gpu"\nnodes_total = 3',
            r"top level: unknown key 'nodes_total'",
            id="unknown-top-level-key",
        ),
        pytest.param(
            'memory_bytes = "16 GB"\n',
            "",
            r"\[device\]: missing required key 'memory_bytes' \(bytes, a number or a string "
            r"like \"80 GB\"\)",
            id="missing-memory",
        ),
        pytest.param(
            '[["device:0", "device:1"]]',
            '[["device:0", "device:1"], ["device:1", "device:0"]]',
            r"links: device:1 -- device:0 is listed twice; give one link with the summed",
            id="duplicate-link",
        ),
        pytest.param(
            "axes = { node = 2, gpu = 2 }",
            "axes = { node = 2, gpu = 2 }\ndevice_order = [0, 1, 2, 2]",
            r"\[mesh\]\.device_order: expected each device id 0\.\.3 once",
            id="device-order",
        ),
    ],
)
def test_bad_file_names_file_key_and_expectation(tmp_path, old, new, message):
    assert old in GOOD
    path = write(tmp_path, GOOD.replace(old, new, 1), "bad.toml")
    with pytest.raises(TopologyError, match=re.escape(str(path)) + ": " + message):
        load_topology(str(path))


def test_unknown_name_and_invalid_toml(tmp_path):
    with pytest.raises(TopologyError, match=r"no topology named 'p100x61'; expected one of .*x16"):
        load_topology("p100x61")
    path = write(tmp_path, "platform = ", "broken.toml")
    with pytest.raises(TopologyError, match=re.escape(str(path)) + ": not valid TOML"):
        load_topology(path)
    assert issubclass(TopologyError, SoapjaxError) and issubclass(TopologyError, ValueError)


def test_cluster_scope_links_describe_an_explicit_graph(tmp_path):
    # two nodes whose hosts are cabled to each other directly, no switch
    text = GOOD.replace("[fabric]\nswitches = { ib = 1 }\n", "").replace(
        'connect = [["device:*", "host"], ["host", "ib"]]',
        'connect = [["device:*", "host"]]\n\n[[links]]\nclass = "ethernet"\n'
        'bandwidth = "10 Gb/s"\nlatency = "10 us"\nscope = "cluster"\n'
        'connect = [["node:0/host", "node:1/host"]]',
    )
    t = load_topology(write(tmp_path, text))
    assert t.axis_bandwidth(("node",)) == pytest.approx(1.25 * GB / 2)
    assert t.links[t.ring_stats(("node",)).link].channel == "cluster/ethernet"


# --- jax meshes ---------------------------------------------------------------------------------


def test_cpu8_builds_a_real_mesh_with_auto_axes():
    t = load_topology("cpu8")
    mesh = make_mesh(t)
    assert dict(mesh.shape) == {"data": 2, "model": 4}
    assert mesh.axis_types == (AxisType.Auto, AxisType.Auto)
    assert [d.id for d in mesh.devices.flat] == [d.id for d in jax.devices()][:8]
    x = jax.device_put(jnp.arange(32.0).reshape(8, 4), NamedSharding(mesh, P("data", "model")))
    total = jax.jit(lambda v: v.sum(), out_shardings=NamedSharding(mesh, P()))(x)
    assert float(total) == pytest.approx(496.0)
    assert len(x.addressable_shards) == 8 and x.addressable_shards[0].data.shape == (4, 1)


def test_make_mesh_follows_the_device_order(tmp_path):
    body = Path(load_topology("cpu8").source_file).read_text()
    axes = "axes = { data = 2, model = 4 }"
    body = body.replace(axes, axes + "\ndevice_order = [7, 6, 5, 4, 3, 2, 1, 0]")
    mesh = make_mesh(load_topology(write(tmp_path, body, "rev.toml")))
    ids = sorted(d.id for d in jax.devices())
    assert [d.id for d in mesh.devices.flat] == ids[::-1]


def test_make_mesh_refuses_the_wrong_platform():
    with pytest.raises(
        TopologyError,
        match=r"topology 'dgx-h100x8' needs 8 gpu devices but 8 cpu devices are attached; "
        r"run on gpus, or choose a topology for the attached devices, e.g. 'cpu8'",
    ):
        make_mesh(load_topology("dgx-h100x8"))


def test_make_mesh_refuses_too_few_devices():
    with pytest.raises(
        TopologyError,
        match=r"topology 'cpu8' needs 8 cpu devices but 4 cpu devices were given; set "
        r"XLA_FLAGS=--xla_force_host_platform_device_count=8",
    ):
        make_mesh(load_topology("cpu8"), jax.devices()[:4])


# --- command line -------------------------------------------------------------------------------


def test_cli_mesh_show_json(capsys):
    assert cli.main(["mesh", "show", "p100x16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["name"], out["num_devices"]) == ("p100x16", 16)
    axes = {a["name"]: a for a in out["axes"]}
    assert [a["name"] for a in out["axes"]] == ["node", "gpu"]
    assert axes["gpu"]["size"] == 4
    assert axes["gpu"]["bandwidth_GBps"] == pytest.approx(20.0)
    assert axes["gpu"]["bandwidth_gbps"] == pytest.approx(160.0)
    assert axes["gpu"]["latency_us"] == pytest.approx(1.0)
    assert axes["gpu"]["bottleneck"]["class"] == "nvlink"
    assert axes["node"]["bandwidth_GBps"] == pytest.approx(3.125)
    assert axes["node"]["bandwidth_gbps"] == pytest.approx(25.0)
    assert axes["node"]["bottleneck"] == {
        "class": "infiniband",
        "link": "node:0/host -- ib",
        "link_bandwidth_GBps": pytest.approx(12.5),
        "sharing": 4,
    }


def test_cli_mesh_show_text_and_meshes_table(capsys):
    assert cli.main(["mesh", "show", "k80x64"]) == 0
    text = capsys.readouterr().out
    assert re.search(r"gpu\s+4\s+15\.75\s+126\s+2us\s+pcie", text)
    assert re.search(r"node\s+16\s+1\.75\s+14\s+5us\s+infiniband .*shared by 4", text)
    assert cli.main(["meshes"]) == 0
    table = capsys.readouterr().out
    assert re.search(r"dgx-h100x32\s+gpu\s+32\s+node=4, data=2, model=4\s+H100 SXM5 80GB", table)
    assert all(name in table for name in SHIPPED)


def test_cli_unknown_mesh_is_an_error(capsys):
    assert cli.main(["mesh", "show", "nope"]) == 2
    assert "no topology named 'nope'" in capsys.readouterr().err


def test_topology_is_frozen():
    t = load_topology("cpu8")
    assert isinstance(t, Topology)
    with pytest.raises(AttributeError):
        t.name = "other"  # type: ignore[misc]


# --- scaled topologies -----------------------------------------------------------------------


@pytest.mark.parametrize("name, n, axes, nodes, per_node", [
    ("k80x64", 8, {"node": 2, "gpu": 4}, 2, 4),
    ("k80x64", 2, {"gpu": 2}, 1, 2),
    ("k80x64", 1, {"gpu": 1}, 1, 1),
    ("p100x16", 4, {"gpu": 4}, 1, 4),
    ("dgx-h100x8", 4, {"model": 4}, 1, 4),
    ("h100x64", 16, {"node": 2, "data": 2, "model": 4}, 2, 8),
], ids=lambda x: str(x) if not isinstance(x, dict) else "-".join(map(str, x.values())))
def test_scaled_topology_keeps_the_first_devices(name, n, axes, nodes, per_node):
    t = scaled_topology(name, n)
    assert (t.name, t.num_devices, t.mesh_shape) == (f"{name}-{n}", n, axes)
    assert (t.num_nodes, t.devices_per_node) == (nodes, per_node)
    ends = {v for link in t.links for v in (link.a, link.b) if v.startswith("device:")}
    assert ends == {f"device:{d}" for d in range(n)}  # links to the devices cut are gone
    assert not any(s.startswith(f"node:{nodes}/") for s in t.switches)


def test_scaled_topology_prices_collectives_like_the_cluster_it_cuts():
    k80 = load_topology("k80x64")
    two_nodes = scaled_topology(k80, 8)
    # Across nodes: one 56 Gb/s NIC per node, shared by its four GPUs' rings.
    assert two_nodes.axis_bandwidth(("node",)) == pytest.approx(k80.axis_bandwidth(("node",)))
    assert two_nodes.axis_bandwidth(("gpu",)) == pytest.approx(k80.axis_bandwidth(("gpu",)))
    ring = two_nodes.collective_time("all_reduce", 1e8, ("node",))
    assert ring == pytest.approx(2 * (1e8 / 2) / (56e9 / 8 / 4) + 2 * 3 * US, rel=0.05)
    # Two GPUs of one K80 board talk through their own PCIe switch at 15.75 GB/s.
    assert scaled_topology(k80, 2).axis_bandwidth(("gpu",)) == pytest.approx(15.75 * GB)
    assert scaled_topology(k80, 64) is k80


@pytest.mark.parametrize("name, n, message", [
    ("p100x16", 6, "cannot be cut to 6 devices; expected a multiple of 4 up to 16, or a "
                   "divisor of 4"),
    ("p100x16", 32, "cannot be cut to 32 devices"),
    ("cpu4", 3, "cannot be cut to 3 devices"),
])
def test_scaled_topology_refuses_partial_nodes(name, n, message):
    with pytest.raises(TopologyError, match=re.escape(message)):
        scaled_topology(name, n)


def test_a_shipped_name_with_a_count_is_the_cut_cluster():
    cut = load_topology("p100x16-4")
    assert cut == scaled_topology("p100x16", 4)
    assert cut.name == "p100x16-4" and cut.mesh_shape == {"gpu": 4}
    with pytest.raises(TopologyError, match="cannot be cut to 3 devices"):
        load_topology("p100x16-3")
    with pytest.raises(TopologyError, match="no topology named 'nosuch-4'"):
        load_topology("nosuch-4")


# --- routing at cluster scale --------------------------------------------------------------------


@pytest.mark.parametrize("name", ["k80x64", "h100x64", "dgx-a100x3072-256"])
def test_routes_from_two_nodes_are_the_whole_graphs_routes(name):
    from itertools import combinations

    from soapjax.topology._routing import Routes

    t = load_topology(name)
    fast = t._routes()
    whole = Routes(t.num_devices, t.switches, t.links)  # one search per source, no symmetry
    assert fast._symmetry is not None and whole._symmetry is None
    for a in range(0, t.num_devices, 7):
        assert [fast.route(a, b) for b in range(t.num_devices) if b != a] == [
            whole.route(a, b) for b in range(t.num_devices) if b != a]
    for k in range(1, len(t.axis_names) + 1):
        for axes in combinations(t.axis_names, k):
            groups = t.groups(axes)
            assert fast.all_pairs(groups) == whole.all_pairs(groups)  # flows counted, not routed
            assert fast.rings_stats(groups) == whole.rings_stats(groups)


def test_a_node_that_forwards_between_cluster_switches_takes_the_whole_graph(tmp_path):
    # node:N/host joins two cluster switches: a route between two nodes may cross a third
    path = tmp_path / "bridge.toml"
    path.write_text(textwrap.dedent("""
        name = "bridge"
        platform = "gpu"
        [device]
        kind = "x"
        memory_bytes = "16 GB"
        memory_bandwidth = "900 GB/s"
        [device.peak_flops]
        float32 = "15 TFLOP/s"
        bfloat16 = "120 TFLOP/s"
        float16 = "120 TFLOP/s"
        [nodes]
        count = 4
        devices_per_node = 2
        switches = { host = 1 }
        [fabric]
        switches = { a = 1, b = 1 }
        [mesh]
        axes = { node = 4, gpu = 2 }
        [[links]]
        class = "pcie"
        bandwidth = "16 GB/s"
        latency = "1 us"
        connect = [["device:*", "host"]]
        [[links]]
        class = "ethernet"
        bandwidth = "10 GB/s"
        latency = "5 us"
        connect = [["host", "a"], ["host", "b"]]
    """))
    t = load_topology(path)
    assert t._routes()._symmetry is None
    assert t.axis_bandwidth(("node",)) > 0


def test_the_3072_gpu_cluster_is_summarised_and_priced_in_seconds():
    import time

    start = time.perf_counter()
    t = load_topology("dgx-a100x3072")
    axes = {a["name"]: a for a in t.summary()["axes"]}
    channels = t.channels_used(("node", "data", "model"))
    elapsed = time.perf_counter() - start
    # 25 and 300 GB/s line rates at the 0.8 NCCL reaches (the links' efficiency)
    assert axes["node"]["bandwidth_GBps"] == pytest.approx(20.0) and axes["node"]["size"] == 384
    assert axes["model"]["bandwidth_GBps"] == pytest.approx(240.0)
    # every node's NVLink, PCIe and NIC channels: 384 x 3
    assert len(channels) == 3 * 384
    assert elapsed < 10  # 40-60 s and 4 GB when every pair was routed


def test_the_collectives_table_is_the_one_list_of_kinds():
    """Every list of collective kinds reads `soapjax.base.collectives.FORMULAS`: HLO's opcodes
    (`hlo.KINDS`), the ideal resharding's kinds and the kinds `calibrate --links` measures,
    each with its measuring program."""
    from soapjax.base import collectives
    from soapjax.cost import reshard
    from soapjax.measure import hlo, links

    assert collectives.COLLECTIVES == tuple(collectives.FORMULAS)
    assert hlo.KINDS == ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                         "collective-permute")
    xla = tuple(k for k in collectives.COLLECTIVES if k != "point_to_point")
    assert collectives.XLA_COLLECTIVES == reshard.KINDS == links.MEASURED_KINDS == xla
    assert tuple(links._PROGRAMS) == xla
    assert [collectives.kind_name(k) for k in hlo.KINDS] == list(xla)
    assert [collectives.kind_name(k) for k in collectives.COLLECTIVES] == list(
        collectives.COLLECTIVES)
