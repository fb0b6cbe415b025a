"""soapjax.cost.devicefit: kernels' FLOPs and bytes, the fit on synthetic timings, one real
timing."""

from __future__ import annotations

import tomllib

import pytest

from soapjax.cost import devicefit
from soapjax.cost.devicefit import KernelTiming, fit_efficiency, format_efficiency
from soapjax.topology._topology_file import Efficiency, _parse_efficiency
from soapjax.topology.cluster import load_topology

H100 = load_topology("dgx-h100x8").device  # 989 TFLOP/s bf16, 67 float32, 3.35 TB/s


def timing(kind, dtype, flops, nbytes, seconds, variant=""):
    return KernelTiming(kind, f"{kind} {flops:g}", dtype, (), flops, nbytes, seconds, 0.0, 0.0,
                        variant)


@pytest.mark.parametrize("kernel, flops, nbytes", [
    (devicefit.gemm(64, 32, 16, "bfloat16"), 2 * 64 * 32 * 16, 2 * (64 * 16 + 16 * 32 + 64 * 32)),
    (devicefit.streaming(1000, "float32"), 2000, 8000),
    (devicefit.softmax(10, 20, "bfloat16"), 1000, 800),
    (devicefit.attention(2, 8, 3, 4, "bfloat16"), 4 * 2 * 3 * 8 * 8 * 4 / 2, 4 * 192 * 2),
    (devicefit.attention(2, 8, 3, 4, "bfloat16", backward=True), 3 * 3072, 2.5 * 1536),
], ids=["gemm", "stream", "softmax", "attention", "attention-bwd"])
def test_kernels_count_flops_and_bytes(kernel, flops, nbytes):
    assert (kernel.flops, kernel.nbytes) == (flops, nbytes)


def test_the_fit_takes_the_median_of_the_larger_half():
    peak = 989e12
    fractions = [0.5, 0.6, 0.7, 0.8, 0.9]  # by size: the larger half is 0.7, 0.8, 0.9
    timings = [timing("gemm", "bfloat16", 1e9 * 10**i, 0, 1e9 * 10**i / (f * peak))
               for i, f in enumerate(fractions)]
    timings.append(timing("gemm", "bfloat16", 1e15, 0, 1e15 / peak, variant="highest"))
    timings += [timing("stream", "float32", 0, b, b / (f * 3.35e12))
                for b, f in [(1e6, 0.3), (1e9, 0.88), (4e9, 0.9)]]
    fit = fit_efficiency(timings, H100)
    assert fit.efficiency == Efficiency((("bfloat16", 0.8),), 0.89)
    assert fit.flops["bfloat16"] == (pytest.approx(0.8), 3, 5)  # the `highest` one left out
    assert fit.memory == (pytest.approx(0.89), 2, 3) and fit.notes == ()


def test_kernels_near_the_loop_floor_are_left_out():
    timings = [timing("gemm", "float32", 1e6, 0, 1e-6), timing("gemm", "float32", 2e6, 0, 2e-6),
               timing("gemm", "float32", 3.35e9, 0, 1e-4)]  # 0.5 of 67 TFLOP/s
    # Without a floor the larger half is the last two (0.015 and 0.5 of the peak); with a floor
    # of 1 us only the last is 10 floors long.
    assert fit_efficiency(timings, H100).flops["float32"][1:] == (2, 3)
    assert fit_efficiency(timings, H100, floor_s=1e-6).flops["float32"] == (
        pytest.approx(0.5), 1, 3)
    only_small = fit_efficiency(timings[:2], H100, floor_s=1e-6)
    assert only_small.flops["float32"][1:] == (1, 2)  # the largest is kept all the same


def test_fractions_above_one_are_capped_and_said():
    fit = fit_efficiency([timing("gemm", "float32", 4e14, 0, 1.0)], H100)  # 400 TFLOP/s: TF32
    assert fit.efficiency.peak_flops == (("float32", 1.0),) and fit.memory is None
    assert fit.efficiency.memory_bandwidth == 1.0
    assert len(fit.notes) == 1 and "TF32" in fit.notes[0] and "5.97x" in fit.notes[0]


def test_the_toml_text_parses_as_the_table():
    fit = fit_efficiency([timing("gemm", "bfloat16", 7.9e14, 0, 1.0),
                          timing("stream", "bfloat16", 0, 3e12, 1.0)], H100)
    text = format_efficiency(fit, comment="measured\non a test")
    assert text.splitlines()[:2] == ["# measured", "# on a test"]
    table = tomllib.loads(text)["device"]["efficiency"]
    assert _parse_efficiency(table) == fit.efficiency == Efficiency((("bfloat16", 0.799),),
                                                                    0.896)


def test_with_efficiency_replaces_the_devices_table_only():
    topo = load_topology("dgx-h100x8")
    eff = Efficiency((("bfloat16", 0.75),), 0.9)
    fitted = devicefit.with_efficiency(topo, eff)
    assert fitted.device.efficiency == eff and fitted.device.kind == topo.device.kind
    assert fitted.links == topo.links and topo.device.efficiency == Efficiency()


def test_a_real_kernel_is_timed():
    t = devicefit.measure(devicefit.gemm(64, 64, 64, "float32"),
                          devicefit.TimingOptions(target_trial_s=0.002, trials=2))
    assert t.seconds > 0 and t.flop_rate > 0 and t.shape == (64, 64, 64) and t.variant == ""
    assert devicefit.loop_floor() > 0
