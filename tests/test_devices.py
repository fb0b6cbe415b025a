"""soapjax.measure.devices: whether the local devices are a topology's."""

from __future__ import annotations

import pytest

from soapjax.base.errors import CostError
from soapjax.measure import devices
from soapjax.topology.cluster import load_topology


def test_kinds_match_on_model_numbers():
    assert devices._kinds_match("H100 SXM5 80GB", "NVIDIA H100 80GB HBM3")
    assert not devices._kinds_match("Tesla P100-SXM2-16GB", "NVIDIA H100 80GB HBM3")
    assert not devices._kinds_match("Tesla P100-SXM2-16GB", "Tesla V100-SXM2-16GB")
    assert devices._kinds_match("Tesla K80 (one GK210)", "Tesla K80")


def test_the_local_cpu_is_cpu8s_and_no_gpus():
    assert devices.local_backend_matches(load_topology("cpu8")) == (True, "")
    assert devices.local_backend_matches(load_topology("dgx-h100x8")) == (
        False, "topology 'dgx-h100x8' has gpu devices but the local backend is cpu")
    assert devices.local_topology().name == "cpu8"


def test_no_shipped_topology_of_the_local_device_is_an_error(monkeypatch):
    monkeypatch.setattr(devices, "list_topologies", lambda: ["dgx-h100x8"])
    monkeypatch.setattr(devices._timing, "local_platform", lambda: "tpu")
    with pytest.raises(CostError, match=r"no shipped topology has the local device .*write one "
                                        r"with that device kind"):
        devices.local_topology()
