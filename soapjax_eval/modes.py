"""How big an evaluation run is (`Mode`: `FULL` and `TINY`), its sections, and the numbers
quoted from the paper (Jia et al., SysML 2019) to be shown beside ours, never as ours."""

from __future__ import annotations

import dataclasses

import soapjax_zoo

SECTIONS = ("throughput", "comm", "search", "quality", "accuracy")


PAPER_MODELS = ("alexnet", "inception_v3", "resnet101", "rnntc", "rnnlm", "nmt")

# Quoted from the paper (Jia et al., SysML 2019), to be shown beside ours, never as ours.
PAPER_FIG8B_GB = {"data-parallel": 65.8, "expert": 24.2, "soapjax": 12.1}
PAPER_TABLE4_SPEEDUP = {  # delta over full simulation, Table 4
    "alexnet": {4: 2.9, 8: 3.0, 16: 2.9, 32: 3.0, 64: 3.0},
    "resnet101": {4: 3.2, 8: 3.2, 16: 3.1, 32: 3.2, 64: 3.3},
    "inception_v3": {4: 3.4, 8: 3.9, 16: 5.0, 32: 5.9, 64: 6.9},
    "rnntc": {4: 2.2, 8: 2.3, 16: 2.4, 32: 2.6, 64: 3.0},
    "rnnlm": {4: 2.3, 8: 2.5, 16: 2.7, 32: 3.2, 64: 3.6},
    "nmt": {4: 2.5, 8: 2.7, 16: 3.0, 32: 3.8, 64: 4.1},
}


@dataclasses.dataclass(frozen=True)
class Mode:
    """How big a run is: model configs, device counts, search effort, repeats."""

    name: str
    config: str  # zoo config of the analytic sections
    p100: tuple[int, ...]  # device counts on the P100 cluster
    k80: tuple[int, ...]
    h100: tuple[tuple[str, int], ...]  # (topology, devices) for GPT-2
    paper_models: tuple[str, ...]  # of the throughput and search-cost sections
    proposals: int  # max_proposals per chain of the throughput/quality searches
    table4_devices: tuple[int, ...]
    table4_proposals: int
    fig12_proposals: int
    optimum_cases: tuple[tuple[str, str, str], ...]  # (model, config, topology[-devices])
    optimum_proposals: int
    local_devices: tuple[int, ...]
    local_models: tuple[str, ...]
    budget_cases: tuple[tuple[str, str], ...]  # (model, topology): searched again, 10x longer
    accuracy_models: tuple[str, ...]  # one-device accuracy
    accuracy_multi_models: tuple[str, ...]  # plans on the 8 CPU devices
    accuracy_baselines: tuple[str, ...]  # which baselines to apply on the 8 CPU devices
    accuracy_plans: int  # random plans per model besides the baselines and the searched one
    accuracy_proposals: int  # max_proposals of the search on the CPU devices
    repeats: int  # timed runs of each measured step


FULL = Mode(
    name="full", config="default", p100=(1, 2, 4, 8, 16), k80=(1, 2, 4, 8, 16, 64),
    h100=(("dgx-h100x8", 1), ("dgx-h100x8", 8), ("dgx-h100x32", 32), ("h100x64", 64)),
    paper_models=PAPER_MODELS,
    proposals=400, table4_devices=(4, 8, 16, 32, 64), table4_proposals=150,
    fig12_proposals=1500,
    optimum_cases=(("lenet", "default", "p100x16-4"), ("rnnlm", "default", "p100x16-4"),
                   ("rnnlm", "default", "cpu4"), ("mlp", "tiny", "cpu4")),
    optimum_proposals=1000, local_devices=(2, 4, 8), local_models=tuple(soapjax_zoo.names()),
    budget_cases=(("nmt", "k80x64-64"), ("rnntc", "p100x16-8"), ("inception_v3", "p100x16-4"),
                  ("gpt2", "h100x64-64")),
    accuracy_models=tuple(soapjax_zoo.names()),
    # Inception-v3 and ResNet-101 have ~200 operators: every plan needs ~200 shard programs
    # compiled and timed for its prediction, minutes per plan on a 2-core host.
    accuracy_multi_models=tuple(m for m in soapjax_zoo.names()
                                if m not in ("inception_v3", "resnet101")),
    accuracy_baselines=("data-parallel", "megatron", "expert-cnn", "expert-rnn"),
    accuracy_plans=1, accuracy_proposals=100, repeats=5)


TINY = Mode(
    name="tiny", config="tiny", p100=(1, 4), k80=(1, 8), h100=(("dgx-h100x8", 8),),
    paper_models=("alexnet", "nmt"),
    proposals=20, table4_devices=(4,), table4_proposals=20, fig12_proposals=40,
    optimum_cases=(("mlp", "tiny", "p100x16-4"),), optimum_proposals=200, local_devices=(2,),
    local_models=("nmt",), budget_cases=(("nmt", "p100x16-4"),), accuracy_models=("mlp",),
    accuracy_multi_models=("mlp",),
    accuracy_baselines=("data-parallel",), accuracy_plans=0, accuracy_proposals=20,
    repeats=2)
