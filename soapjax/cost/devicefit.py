"""Kernel efficiency of the attached device, and the ``[device.efficiency]`` table fitted from it.

The analytic cost model (`soapjax.cost.roofline.roofline_time`) prices an operator at the topology's
datasheet peaks, times the fractions its optional ``[device.efficiency]`` table gives. A
datasheet peak is what no kernel reaches: an 8192x8192x8192 bfloat16 matmul ran at 769-798
TFLOP/s on this workplace's H100 SXM (about 0.8 of the datasheet's 989), and a device-to-device
copy moved about 3.0 TB/s (0.9 of 3.35). This module measures such fractions on whatever is
attached and writes them as that table (`scripts/gpu_kit.py` runs it on a GPU):

* **GEMMs** ``a[m, k] @ b[k, n]`` (`gemm`): ``2 m n k`` FLOPs, against the peak of the dtype.
* **Streaming** ``x * a + b`` over one large array (`streaming`): its bytes read and written
  (``2 * x.nbytes``), against the memory bandwidth; **row reductions** (`softmax`,
  `layer_norm`, in float32 over the last dim) count the same bytes.
* **Attention** (`attention`): ``jax.nn.dot_product_attention``, causal, forward or forward and
  backward; ``4 b n t^2 h / 2`` FLOPs forward (the causal half), three times that with the
  backward (a backward is twice its forward's matmuls; a fused kernel's recomputation is not
  counted).

Each kernel is timed by `soapjax.measure._timing`: many repetitions inside one compiled loop, so the
dispatch of a call (10-150 us on a GPU) cancels. A loop iteration still costs something of its
own (the harness's one-element kicks, the loop's condition, on a GPU a wait for the predicate
on the host): `loop_floor` measures it, every timing has it taken off (since 2026-11-27; the
first H100 run's kernel times include it), and kernels within 10x of it are left out of the
fit. `launch_overhead` is what one jitted call of
almost nothing costs, the dispatch the loop hides.

The fit (`fit_efficiency`, pure) takes, per dtype, the median fraction over the larger half (by
FLOPs) of the GEMMs of that dtype, and for the memory bandwidth the median over the larger half
(by bytes) of the streaming kernels: small kernels are launch- and wave-bound, which the
analytic model prices apart (its per-kernel overhead). A fraction above 1 (a datasheet figure
below what XLA reaches: float32 matmuls run on TF32 tensor cores at JAX's default precision) is
written as 1, the most the table allows, and said so in `EfficiencyFit.notes`.

Example::

    device = load_topology("dgx-h100x8").device
    timings = [measure(gemm(8192, 8192, 8192, "bfloat16")),
               measure(streaming(2**28, "float32"))]
    fit = fit_efficiency(timings, device)
    print(format_efficiency(fit, comment="measured on ..."))
    # [device.efficiency]
    # peak_flops = { bfloat16 = 0.79 }
    # memory_bandwidth = 0.9
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from soapjax.base.attention import flash_attention
from soapjax.cost.kernels import FlashKernel
from soapjax.measure import _timing
from soapjax.measure._timing import TimingOptions, loop_floor
from soapjax.topology._topology_file import DeviceSpec, Efficiency
from soapjax.topology.cluster import Topology

__all__ = ["EfficiencyFit", "Kernel", "KernelTiming", "TimingOptions", "attention",
           "embedding_grad", "fit_attention_efficiency", "fit_efficiency", "format_efficiency",
           "gemm", "launch_overhead", "layer_norm", "loop_floor", "measure", "softmax",
           "streaming", "with_efficiency"]

# Kernels shorter than this many loop floors are too close to the harness's own cost to fit.
FLOOR_MARGIN = 10.0


class Kernel(NamedTuple):
    """One kernel to time: a function of arrays that `make_args` allocates on the device.

    Attributes:
      kind: ``"gemm"``, ``"stream"``, ``"reduce"``, ``"attention"`` or ``"scatter"``.
      name: e.g. ``"gemm 8192x8192x8192 bfloat16"``.
      dtype: the dtype it computes in (a name).
      shape: the sizes that define it (``(m, n, k)``, ``(elements,)``, ``(b, t, n, h)``, ...).
      flops: floating point operations of one call.
      nbytes: bytes one call must read and write at the least.
      fn: ``fn(*args) -> list of arrays``.
      make_args: allocates the arguments (random values, on the default device).
      variant: how it runs, where there is a choice: a GEMM's ``precision``, an attention's
        ``implementation``; ``""`` for the default.
    """

    kind: str
    name: str
    dtype: str
    shape: tuple[int, ...]
    flops: float
    nbytes: float
    fn: Callable[..., list[jax.Array]]
    make_args: Callable[[], list[jax.Array]]
    variant: str = ""


class KernelTiming(NamedTuple):
    """A timed `Kernel` (JSON-able with ``_asdict()``).

    Attributes:
      kind, name, dtype, shape, flops, nbytes, variant: the kernel's.
      seconds: one call, dispatch amortised (`soapjax.measure._timing.Timing.seconds`).
      spread: (max - min) / min over the trials.
      overhead_s: what a call of the timing loop cost beyond its repetitions.
    """

    kind: str
    name: str
    dtype: str
    shape: tuple[int, ...]
    flops: float
    nbytes: float
    seconds: float
    spread: float
    overhead_s: float
    variant: str = ""

    @property
    def flop_rate(self) -> float:
        """Achieved FLOP/s."""
        return self.flops / self.seconds

    @property
    def byte_rate(self) -> float:
        """Achieved bytes/s."""
        return self.nbytes / self.seconds


class EfficiencyFit(NamedTuple):
    """The fitted table and how it was fitted.

    Attributes:
      efficiency: the ``[device.efficiency]`` table (fractions capped at 1).
      flops: dtype -> ``(fraction before capping, GEMMs fitted, GEMMs measured)``.
      memory: ``(fraction before capping, kernels fitted, kernels measured)``, or None when no
        streaming kernel was measured.
      notes: what the reader of the table should know (caps, dtypes without a GEMM).
    """

    efficiency: Efficiency
    flops: dict[str, tuple[float, int, int]]
    memory: tuple[float, int, int] | None
    notes: tuple[str, ...]


# --- kernels -----------------------------------------------------------------------------------


def _random(shapes: Sequence[tuple[int, ...]], dtype: str, seed: int = 0) -> list[jax.Array]:
    """Uniform values in [-1, 1), made on the device (a GB of them in milliseconds)."""
    keys = jax.random.split(jax.random.key(seed), len(shapes))
    return [jax.random.uniform(k, s, jnp.float32, -1.0, 1.0).astype(dtype)
            for k, s in zip(keys, shapes)]


def gemm(m: int, n: int, k: int, dtype: str, *, precision: str | None = None) -> Kernel:
    """``a[m, k] @ b[k, n]`` in `dtype` (``precision``: ``"highest"`` for true float32 on a GPU,
    whose default runs float32 matmuls on TF32 tensor cores)."""
    size = np.dtype(dtype).itemsize
    tag = f" ({precision})" if precision else ""
    return Kernel("gemm", f"gemm {m}x{n}x{k} {dtype}{tag}", dtype, (m, n, k), 2.0 * m * n * k,
                  float(size * (m * k + k * n + m * n)),
                  lambda a, b: [jnp.matmul(a, b, precision=precision)],
                  lambda: _random([(m, k), (k, n)], dtype), precision or "")


def streaming(elements: int, dtype: str) -> Kernel:
    """``x * a + b`` over `elements` elements (``a``, ``b`` scalars passed as arguments)."""
    nbytes = elements * np.dtype(dtype).itemsize

    def make_args() -> list[jax.Array]:
        return [*_random([(elements,)], dtype), jnp.asarray(0.5, dtype), jnp.asarray(0.25, dtype)]

    return Kernel("stream", f"x*a+b {_mb(nbytes)} {dtype}", dtype, (elements,), 2.0 * elements,
                  2.0 * nbytes, lambda x, a, b: [x * a + b], make_args)


def softmax(rows: int, cols: int, dtype: str) -> Kernel:
    """``softmax(x)`` over the last dim of ``x[rows, cols]``, in float32, back to `dtype`."""
    nbytes = rows * cols * np.dtype(dtype).itemsize

    def fn(x: jax.Array) -> list[jax.Array]:
        return [jax.nn.softmax(x.astype(jnp.float32), axis=-1).astype(x.dtype)]

    return Kernel("reduce", f"softmax {rows}x{cols} {dtype}", dtype, (rows, cols),
                  5.0 * rows * cols, 2.0 * nbytes, fn, lambda: _random([(rows, cols)], dtype))


def layer_norm(rows: int, cols: int, dtype: str) -> Kernel:
    """A layer norm (mean, variance, scale and shift) over the last dim of ``x[rows, cols]``."""
    nbytes = rows * cols * np.dtype(dtype).itemsize

    def fn(x: jax.Array, scale: jax.Array, shift: jax.Array) -> list[jax.Array]:
        y = x.astype(jnp.float32)
        mean = y.mean(-1, keepdims=True)
        var = jnp.square(y - mean).mean(-1, keepdims=True)
        out = (y - mean) * jax.lax.rsqrt(var + 1e-5) * scale + shift
        return [out.astype(x.dtype)]

    def make_args() -> list[jax.Array]:
        return [*_random([(rows, cols)], dtype), *_random([(cols,), (cols,)], "float32", 1)]

    return Kernel("reduce", f"layer norm {rows}x{cols} {dtype}", dtype, (rows, cols),
                  8.0 * rows * cols, 2.0 * nbytes, fn, make_args)


def attention(batch: int, seq: int, heads: int, head_dim: int, dtype: str, *,
              implementation: str | None = None, backward: bool = False,
              block: int = 512) -> Kernel:
    """Causal ``jax.nn.dot_product_attention`` over ``[batch, seq, heads, head_dim]``.

    Args:
      implementation: ``"xla"`` (einsum, softmax, einsum), ``"cudnn"`` (a fused kernel, GPUs
        only), None (JAX's choice), or ``"soapjax"``: `soapjax.base.attention.flash_attention`, the
        blockwise attention plans run (its rate is what a topology's
        ``attention_efficiency`` should say of the kernels apply runs).
      backward: time the forward and the backward (gradients of q, k and v) together.
      block: ``"soapjax"`` only: keys (and queries) per block (named when not 512).
    """
    shape = (batch, seq, heads, head_dim)
    forward = 4.0 * batch * heads * seq * seq * head_dim / 2  # the causal half
    io = 4.0 * math.prod(shape) * np.dtype(dtype).itemsize  # q, k, v, out

    def attend(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        if implementation == "soapjax":
            return flash_attention(q, k, v, block=block)
        return jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                            implementation=implementation)

    def fwd(q: jax.Array, k: jax.Array, v: jax.Array) -> list[jax.Array]:
        return [attend(q, k, v)]

    def fwd_bwd(q: jax.Array, k: jax.Array, v: jax.Array, ct: jax.Array) -> list[jax.Array]:
        out, vjp = jax.vjp(attend, q, k, v)
        return [out, *vjp(ct)]

    impl = implementation or "default"
    if implementation == "soapjax" and block != 512:
        impl = f"soapjax-b{block}"
    what = "fwd+bwd" if backward else "fwd"
    return Kernel("attention", f"attention {what} {impl} {'x'.join(map(str, shape))} {dtype}",
                  dtype, shape, forward * (3 if backward else 1), io * (2.5 if backward else 1),
                  fwd_bwd if backward else fwd,
                  lambda: _random([shape] * (4 if backward else 3), dtype), implementation or "")


def embedding_grad(vocab: int, width: int, tokens: int, dtype: str, *,
                   variant: str = "gather") -> Kernel:
    """The gradient of an embedding lookup: ``g[ids]`` of a ``[tokens, width]`` cotangent added
    into a zero ``[vocab, width]`` table (what the backward of ``table[ids]`` runs).

    Args:
      variant: ``"gather"``, `jax.vjp` of ``table[ids]`` (XLA's scatter-add, random ids);
        ``"sorted"``, the same with the ids sorted and said to be (``indices_are_sorted``);
        ``"onehot"``, ``one_hot(ids)^T @ g`` as a matmul.
    """
    size = np.dtype(dtype).itemsize
    nbytes = float(vocab * width * size + tokens * width * size + tokens * 4)

    def make_args() -> list[jax.Array]:
        (g,) = _random([(tokens, width)], dtype)
        ids = jax.random.randint(jax.random.key(1), (tokens,), 0, vocab)
        return [g, jnp.sort(ids) if variant == "sorted" else ids]

    def grad(g: jax.Array, ids: jax.Array) -> list[jax.Array]:
        if variant == "onehot":
            return [jnp.einsum("tv,tw->vw", jax.nn.one_hot(ids, vocab, dtype=g.dtype), g)]
        table = jnp.zeros((vocab, width), g.dtype)
        if variant == "sorted":
            return [table.at[ids].add(g, indices_are_sorted=True)]
        _, vjp = jax.vjp(lambda t: t[ids], table)
        return list(vjp(g))

    flops = 2.0 * vocab * width * tokens if variant == "onehot" else float(tokens * width)
    return Kernel("scatter", f"embedding grad {variant} {vocab}x{width} {tokens} tokens {dtype}",
                  dtype, (vocab, width, tokens), flops, nbytes, grad, make_args, variant)


def _mb(nbytes: float) -> str:
    return f"{nbytes / 2**20:.0f} MiB" if nbytes < 2**30 else f"{nbytes / 2**30:.2g} GiB"


# --- timing ------------------------------------------------------------------------------------


def measure(kernel: Kernel, options: TimingOptions = TimingOptions()) -> KernelTiming:
    """Times `kernel` on the default device, dispatch amortised (`soapjax.measure._timing`)."""
    args = kernel.make_args()
    t = _timing.time_forward(kernel.fn, args, options)
    del args
    return KernelTiming(kernel.kind, kernel.name, kernel.dtype, kernel.shape, kernel.flops,
                        kernel.nbytes, t.seconds, t.spread, t.overhead_s, kernel.variant)


def launch_overhead(calls: int = 200) -> float:
    """Median seconds of one jitted call of a one-element add, waited for: the dispatch and
    launch a training step pays once per call."""
    return _timing.median_call(jax.jit(lambda x: x + 1), [jnp.zeros((1,), jnp.float32)], calls)


# --- the fit -----------------------------------------------------------------------------------


def _larger_half(timings: Sequence[KernelTiming], size: Callable[[KernelTiming], float]
                 ) -> list[KernelTiming]:
    ranked = sorted(timings, key=size, reverse=True)
    return ranked[:math.ceil(len(ranked) / 2)]


def fit_efficiency(timings: Iterable[KernelTiming], device: DeviceSpec, *,
                   floor_s: float = 0.0) -> EfficiencyFit:
    """The ``[device.efficiency]`` table of `device` from measured kernels.

    Per dtype, the median of ``flop_rate / peak_flops(dtype)`` over the larger half (by FLOPs)
    of the GEMMs of that dtype at the default precision (`KernelTiming.variant` empty: models
    run at the default); for the memory bandwidth, the median of
    ``byte_rate / memory_bandwidth`` over the larger half (by bytes) of the streaming kernels.
    Kernels shorter than ``FLOOR_MARGIN * floor_s`` are left out first (but for the largest of
    each group, so a sweep of small kernels still gives a figure). Fractions are capped at 1.

    >>> from soapjax.topology.cluster import load_topology
    >>> device = load_topology("dgx-h100x8").device  # 989 TFLOP/s bf16, 3.35 TB/s
    >>> def t(kind, dtype, flops, nbytes, s):
    ...     return KernelTiming(kind, "k", dtype, (), flops, nbytes, s, 0.0, 0.0)
    >>> fit = fit_efficiency([t("gemm", "bfloat16", 1e12, 0, 1.25e-3),   # 0.81 of the peak
    ...                       t("gemm", "bfloat16", 1e11, 0, 1.40e-4),   # 0.72: the smaller half
    ...                       t("gemm", "float32", 1e12, 0, 5e-3),       # 200 TFLOP/s: TF32
    ...                       t("stream", "float32", 0, 2e9, 6.6e-4)], device)
    >>> fit.efficiency
    Efficiency(peak_flops=(('bfloat16', 0.809), ('float32', 1.0)), memory_bandwidth=0.905)
    >>> round(fit.flops["float32"][0], 2)
    2.99
    """
    timings = list(timings)
    notes: list[str] = []

    def usable(group: list[KernelTiming], size: Callable[[KernelTiming], float]
               ) -> list[KernelTiming]:
        kept = [t for t in group if t.seconds >= FLOOR_MARGIN * floor_s]
        return kept or sorted(group, key=size)[-1:]

    flops: dict[str, tuple[float, int, int]] = {}
    dtypes = sorted({t.dtype for t in timings if t.kind == "gemm"})
    for dtype in dtypes:
        group = [t for t in timings if t.kind == "gemm" and t.dtype == dtype
                 and not t.variant]
        if not group:
            continue
        chosen = _larger_half(usable(group, lambda t: t.flops), lambda t: t.flops)
        peak = device.peak_flops_for(dtype)
        flops[dtype] = (statistics.median(t.flop_rate / peak for t in chosen), len(chosen),
                        len(group))
    streams = [t for t in timings if t.kind == "stream"]
    memory = None
    if streams:
        chosen = _larger_half(usable(streams, lambda t: t.nbytes), lambda t: t.nbytes)
        memory = (statistics.median(t.byte_rate / device.memory_bandwidth for t in chosen),
                  len(chosen), len(streams))
    for dtype, (fraction, _, _) in flops.items():
        if fraction > 1:
            notes.append(f"{dtype} GEMMs reached {fraction:.2f}x the datasheet peak of "
                         f"{device.peak_flops_for(dtype) / 1e12:.4g} TFLOP/s: written as 1"
                         + (" (on NVIDIA GPUs XLA runs float32 matmuls on TF32 tensor cores at "
                            "JAX's default precision)" if dtype == "float32" else ""))
    if memory and memory[0] > 1:
        notes.append(f"streaming kernels reached {memory[0]:.2f}x the datasheet bandwidth of "
                     f"{device.memory_bandwidth / 1e9:.4g} GB/s: written as 1")
    efficiency = Efficiency(tuple((d, _fraction(f)) for d, (f, _, _) in flops.items()),
                            _fraction(memory[0]) if memory else 1.0)
    return EfficiencyFit(efficiency, flops, memory, tuple(notes))


def fit_attention_efficiency(timings: Iterable[KernelTiming], device: DeviceSpec, *,
                             variant: str = "soapjax") -> float | None:
    """The ``attention_efficiency`` of a topology's ``[device.kernels]`` that makes the kernel
    model's flash attention (`soapjax.cost.kernels.flash_time`: the computed causal tiles' FLOPs,
    3.5 times the forward's with the backward) take what soapjax's own flash attention
    (``"soapjax"``, the default block) measured forward and backward: the median over the
    larger half (by FLOPs) of those kernels; None without one. With ``variant="cudnn"``,
    cuDNN's fused kernel instead: the ``cudnn_attention_efficiency``."""
    found = []
    for t in timings:
        if t.kind != "attention" or t.variant != variant or not t.name.startswith(
                f"attention fwd+bwd {variant} "):
            continue
        b, seq, n, h = t.shape
        k = FlashKernel(b * n, seq, seq, h, h, t.dtype, 0.0, True)
        found.append((k.flops, 3.5 * k.flops / (device.peak_flops_for(t.dtype) * t.seconds)))
    if not found:
        return None
    found.sort()
    return float(np.median([e for _, e in found[len(found) // 2:]]))


def _fraction(x: float) -> float:
    """`x` rounded to 3 digits, within the (0, 1] the table allows."""
    return min(1.0, max(round(x, 3), 0.001))


def format_efficiency(fit: EfficiencyFit, *, comment: str = "") -> str:
    """The fitted table as TOML text, for a topology file's ``[device]``.

    >>> e = EfficiencyFit(Efficiency((("bfloat16", 0.8),), 0.9), {}, None, ("a note",))
    >>> print(format_efficiency(e, comment="measured today"))
    # measured today
    # a note
    [device.efficiency]
    peak_flops = { bfloat16 = 0.8 }
    memory_bandwidth = 0.9
    <BLANKLINE>
    """
    lines = [f"# {line}" for line in comment.splitlines()]
    lines += [f"# {note}" for note in fit.notes]
    lines.append("[device.efficiency]")
    peaks = ", ".join(f"{d} = {f:g}" for d, f in fit.efficiency.peak_flops)
    if peaks:
        lines.append(f"peak_flops = {{ {peaks} }}")
    lines.append(f"memory_bandwidth = {fit.efficiency.memory_bandwidth:g}")
    return "\n".join(lines) + "\n"


def with_efficiency(topology: Topology, efficiency: Efficiency) -> Topology:
    """`topology` with its device's ``[device.efficiency]`` replaced (``Efficiency()``: none,
    the datasheet peaks in full)."""
    device = dataclasses.replace(topology.device, efficiency=efficiency)
    return dataclasses.replace(topology, device=device)
