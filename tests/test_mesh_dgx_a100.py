"""meshes/dgx-a100x3072.toml: 384 DGX A100 nodes, cut to any node count, and simulated.

Loading the 3072-device file takes ~0.1 s. The first collective priced over many nodes is the
slow part: the routes between devices are searched once per source device (a widest-path
search over the whole link graph, `soapjax.topology._routing`), so data parallelism over 512 devices
takes ~3 s to simulate, over 1024 ~13 s, over all 3072 1-2 min and 4 GB (heavy).
"""

from __future__ import annotations

import time

import pytest

import soapjax_zoo as zoo
from soapjax.graph.opgraph import trace
from soapjax.simulate.front import simulate
from soapjax.strategy import baselines
from soapjax.strategy.baselines import intra_node_axes
from soapjax.strategy.space import MeshShape, data_parallel
from soapjax.topology.cluster import load_topology, scaled_topology

NAME = "dgx-a100x3072"


@pytest.fixture(scope="module")
def cluster():
    return load_topology(NAME)


def test_loads_quickly_with_the_datasheet_figures(cluster):
    t0 = time.perf_counter()
    topo = load_topology(NAME)
    assert time.perf_counter() - t0 < 5.0  # ~0.1 s
    assert (topo.num_devices, topo.num_nodes, topo.devices_per_node) == (3072, 384, 8)
    assert topo.mesh_shape == {"node": 384, "data": 2, "model": 4}
    peaks = dict(topo.device.peak_flops)
    assert (peaks["float16"], peaks["bfloat16"], peaks["float32"]) == (312e12, 312e12, 19.5e12)
    assert (topo.device.memory_bandwidth, topo.device.memory_bytes) == (2039e9, 80e9)
    assert topo.platform == "gpu" and "A100" in topo.device.kind
    assert len(topo.links) == 3 * 3072  # NVLink, PCIe to the NIC, InfiniBand: per GPU


def test_tensor_parallel_inside_a_node_data_parallel_across(cluster):
    topo = scaled_topology(cluster, 64)  # 8 nodes: the routes of 3072 devices take a minute
    assert intra_node_axes(topo) == ("data", "model")
    # NVLink 3 via NVSwitch, 300 GB/s, and 200 Gb/s HDR InfiniBand per GPU, 25 GB/s: each at
    # the 0.8 of its line rate NCCL reaches (the links' efficiency)
    assert topo.ring_stats(("data", "model")).bandwidth == pytest.approx(240e9)
    assert topo.ring_stats(("node",)).bandwidth == pytest.approx(20e9)


NODES = [1, 8, 35, 64, 128, 384]  # 35 nodes: Megatron's 280 GPUs


@pytest.mark.parametrize("nodes", NODES)
def test_cuts_to_whole_nodes(cluster, nodes):
    topo = scaled_topology(cluster, 8 * nodes)
    assert (topo.num_devices, topo.num_nodes) == (8 * nodes, nodes)
    want = {"data": 2, "model": 4} if nodes == 1 else {"node": nodes, "data": 2, "model": 4}
    assert topo.mesh_shape == want
    assert len(topo.links) == 3 * 8 * nodes


def tiny_gpt(batch_size: int):
    w = zoo.get("gpt", "tiny", batch_size=batch_size)
    return trace(w.loss_fn, w.abstract_params(), w.abstract_batch(), name="gpt")


def test_simulates_megatron_and_data_parallel_on_64_nodes(cluster):
    topo = scaled_topology(cluster, 512)
    g, mesh = tiny_gpt(512), MeshShape.of(topo)
    dp = simulate(g, topo, data_parallel(g, mesh))
    tp = simulate(g, topo, baselines.megatron(g, mesh, ("model",)))
    assert dp.num_devices == tp.num_devices == 512
    assert 0 < dp.step_time_s < 1 and 0 < tp.step_time_s < 1


@pytest.mark.heavy
def test_simulates_data_parallel_on_all_3072_devices(cluster):
    g = tiny_gpt(3072)
    r = simulate(g, cluster, data_parallel(g, MeshShape.of(cluster)))
    assert r.num_devices == 3072 and 0 < r.step_time_s < 1
