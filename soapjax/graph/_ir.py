"""The operator graph's records: operators, their operands and outputs, dim roles.

Frozen, hashable metadata that every later stage reads (`soapjax.graph.opgraph` builds them, and
re-exports them: import them from there). See `soapjax.graph.opgraph` for how they are made.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple, TypeVar

from soapjax.base._dtypes import itemsize

T = TypeVar("T")

Role = Literal["S", "A", "P", "-"]
OperandKind = Literal["activation", "param", "batch", "const"]
# Anchors whose operator holds a loop: its body's communication, if split, is per iteration.
LOOP_ANCHORS = ("scan", "while")


@dataclasses.dataclass(frozen=True)
class ReductionDim:
    """A splittable reduction dim of an operator (splitting it leaves partial sums).

    Attributes:
      size: its extent.
      role: the role of the dim it reduces (``P`` for a matmul's contracting dim against a
        weight, ``S`` for a loss's mean over the batch, ``A`` otherwise).
    """

    size: int
    role: Role


class _Tensor:
    """What `Operand` and `OutputTensor` share: their bytes, from the global shape and dtype."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.dtype)


@dataclasses.dataclass(frozen=True)
class Operand(_Tensor):
    """One input of an operator.

    Attributes:
      kind: ``activation`` (another operator's output), ``param``, ``batch`` or ``const``.
      source: the producing operator's name, or the pytree path of the parameter/batch leaf.
      index: for an activation, which of the producer's `outputs` it is; else 0.
      shape: its global shape.
      dtype: its dtype name.
      dims: for each of its dims, the operator's iteration dim it follows, or None when every
        device needs it whole along that dim.
      value: the value's id in the traced program (used to evaluate and constrain it).
      layer: for one layer's slice of a stacked parameter (a scan over layers), its index
        along the stacked leading dims; `source` then ends with it (``...['kernel'][3]``),
        and `shape` is the slice's. Likewise for an activation that is one layer's slice of a
        value stacked before the layer scan (a LoRA's merged ``W + A @ B`` of every layer):
        `source` names the operator that made the stack, `shape` is the slice's, and
        `read_of` drops the layer dims from what that operator's output has per dim.
      outside: the operator's reduction dims (iteration dims) its value does not flow into,
        as a bias added after the matmul: where a config splits only such dims, the operand's
        cotangent is whole, not a partial sum (XLA all-reduces the matmul's partial sums
        before the add).
    """

    kind: OperandKind
    source: str
    index: int
    shape: tuple[int, ...]
    dtype: str
    dims: tuple[int | None, ...]
    value: int
    layer: tuple[int, ...] = ()
    outside: tuple[int, ...] = ()

    def read_of(self, produced: Sequence[T]) -> tuple[T, ...]:
        """Of `produced` (one entry per dim of the producer's output: its spec, its dims),
        the entries of the dims this operand reads: all of them, but a layer's slice drops
        the stacked layer dims it indexes (`layer`)."""
        return tuple(produced)[len(self.layer):]

    @property
    def leaf_path(self) -> str:
        """The pytree path of the parameter or batch leaf (without the layer index)."""
        suffix = "".join(f"[{i}]" for i in self.layer)
        return self.source[: len(self.source) - len(suffix)] if suffix else self.source


@dataclasses.dataclass(frozen=True)
class OutputTensor(_Tensor):
    """A value an operator hands to other operators (or returns from the function).

    Attributes:
      shape: global shape.
      dtype: dtype name.
      dims: for each dim, the operator's iteration dim it follows, or None (replicated).
      value: the value's id in the traced program.
    """

    shape: tuple[int, ...]
    dtype: str
    dims: tuple[int | None, ...]
    value: int


@dataclasses.dataclass(frozen=True)
class Operator:
    """One node of the operator graph.

    Its derived dims (`iteration_sizes`, `iteration_roles`, `split_sizes`, `divisible_dims`)
    are computed once per operator (``functools.cached_property``: the search reads them
    millions of times); equality and hashing read the fields alone.

    Attributes:
      name: unique name from the Flax module path, e.g. ``layers_3/mlp/fc1``.
      module: the module path alone ('' for code outside any module).
      anchor: the primitive the operator is built around.
      shape: the shape of its (primary) output, `outputs[0]`.
      dtype: the dtype of that output.
      roles: one role per output dim.
      reduction_dims: its splittable reduction dims; iteration dim ``len(shape) + k`` is
        ``reduction_dims[k]``.
      flops: forward FLOPs.
      bytes_accessed: bytes read and written by the fused operator (operands and outputs).
      inputs: its operands, activations first in program order.
      outputs: the values it exports; `outputs[0]` is the primary output.
      num_equations: how many (inlined) equations were grouped into it.
      replicate_only: built around a primitive soapjax does not understand: never split.
      block_position: for an operator of one iteration of a scan over layers, its name with
        the layer index replaced by ``*`` (``layers_*/fc1``): the operators of the same
        position in every layer, which share one config (the paper's repeated blocks); ''
        otherwise.
      granularity: for each iteration dim, the greatest common divisor of the extents it
        takes inside the operator (rotary embeddings slice a head dim of 8 into halves of 4:
        4); a split must divide it, or the shards would need data from each other. () means
        `iteration_sizes`.
      halo_dims: the iteration dims a convolution or a pooling inside follows with a spatial
        dim whose windows overlap or are padded (a split would need its neighbours' rows: a
        halo). The search space leaves them whole whatever their role (a position embedding
        makes a convolution's rows P, a pooling inside the operator R): XLA computes such
        splits of a convolution wrongly (`soapjax.strategy.space.spatial_convolution`), and
        exchanges a pooling's halos with collectives the simulator does not price.
    """

    name: str
    module: str
    anchor: str
    shape: tuple[int, ...]
    dtype: str
    roles: tuple[Role, ...]
    reduction_dims: tuple[ReductionDim, ...]
    flops: float
    bytes_accessed: float
    inputs: tuple[Operand, ...]
    outputs: tuple[OutputTensor, ...]
    num_equations: int
    replicate_only: bool = False
    block_position: str = ""
    granularity: tuple[int, ...] = ()
    halo_dims: tuple[int, ...] = ()

    @functools.cached_property
    def split_sizes(self) -> tuple[int, ...]:
        """The sizes a split's degree must divide, per iteration dim (see `granularity`)."""
        return self.granularity or self.iteration_sizes

    @functools.cached_property
    def iteration_sizes(self) -> tuple[int, ...]:
        """Sizes of the iteration dims: output dims, then reduction dims."""
        return self.shape + tuple(r.size for r in self.reduction_dims)

    @functools.cached_property
    def iteration_roles(self) -> tuple[str, ...]:
        """Roles of the iteration dims; reduction dims read ``R``."""
        return self.roles + ("R",) * len(self.reduction_dims)

    @property
    def computation(self) -> tuple:
        """What the operator computes, as far as its record tells, short of tracing it: its
        anchor, iteration dims and split sizes, FLOPs, bytes, equation count and its operands'
        and outputs' kinds, shapes, dtypes and dims. Two operators of a repeated block with
        equal `computation` are priced and simulated as one (`soapjax.cost.operators`'s kernels,
        `soapjax.simulate._flatsim`'s views); the layers' `block_position` alone does not say that
        (layer 0's first norm reads the embeddings, the next layers' add a residual and
        a dropout to theirs)."""
        return (self.anchor, self.iteration_sizes, self.iteration_roles, self.granularity,
                self.replicate_only, self.flops, self.bytes_accessed, self.num_equations,
                tuple((x.kind, x.shape, x.dtype, x.dims, x.outside) for x in self.inputs),
                tuple((x.shape, x.dtype, x.dims) for x in self.outputs))

    @property
    def is_loop(self) -> bool:
        """Built around a loop (``scan``, ``while``): an LSTM layer, say."""
        return self.anchor in LOOP_ANCHORS

    @functools.cached_property
    def divisible_dims(self) -> tuple[int, ...]:
        """The iteration dims a config may split.

        A loop operator splits only its sample dims. Splitting any other dim (an LSTM's hidden
        dim, its input contraction) makes XLA communicate inside the loop body at every step:
        on rnnlm (tiny, 8 CPU devices, hidden split 4 ways) one step moved 449 KB where the
        operator-level model sees 52 KB (`soapjax check`), since the partial sums, gate
        relayouts and weight gradients are all synchronised per iteration. The simulator does
        not price communication inside an operator, so the space leaves those splits out.
        A reduction dim goes by its own role (`ReductionDim.role`): a loop whose result is
        summed over the batch (a ``fori_loop`` model grouped with its loss) splits that batch
        as data parallelism does (`soapjax.strategy.space.sample_dim`), and a transform dim
        an operator reduces ("-") is never split.
        """
        if self.replicate_only:
            return ()
        roles = self.roles + tuple(r.role for r in self.reduction_dims)
        return tuple(i for i, (r, s) in enumerate(zip(roles, self.split_sizes))
                     if r != "-" and s > 1 and (r == "S" or not self.is_loop))

    @property
    def params(self) -> tuple[str, ...]:
        """Pytree paths of the parameters it reads."""
        return tuple(o.source for o in self.inputs if o.kind == "param")

    @property
    def param_bytes(self) -> int:
        return sum(o.nbytes for o in self.inputs if o.kind == "param")


@dataclasses.dataclass(frozen=True)
class LeafInfo:
    """A parameter or batch leaf of the traced function: pytree path, shape, dtype."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    value: int


class Convolution(NamedTuple):
    """A convolution equation of an operator: which iteration dim each dim of its input
    (``lhs``), kernel (``rhs``) and result (``out``) follows (None: no iteration dim follows
    it; the equation computes that dim whole), as `read_convolutions` reads them."""

    unit: int
    eqn: Any
    lhs: tuple[int | None, ...]
    rhs: tuple[int | None, ...]
    out: tuple[int | None, ...]

    def spatial(self) -> tuple[tuple[int | None, int | None], ...]:
        """Per spatial dim, the iteration dims its input and its result follow."""
        dn = self.eqn.params["dimension_numbers"]
        return tuple((self.lhs[a], self.out[b]) for a, b in zip(dn.lhs_spec[2:], dn.out_spec[2:]))

    def local_windows(self, k: int, iteration_size: int) -> bool:
        """Whether spatial dim `k`'s windows tile it without overlap (a patch embedding: the
        stride equal to the window, no padding or dilation, the input exactly the windows),
        so that a device holding a run of whole windows of the input computes its run of the
        result by itself (no halo); `iteration_size`, the size of the iteration dim both
        follow, is the result's, so a split of it splits input and result at window edges."""
        p, dn = self.eqn.params, self.eqn.params["dimension_numbers"]
        window = self.eqn.invars[1].aval.shape[dn.rhs_spec[2 + k]]
        size_in = self.eqn.invars[0].aval.shape[dn.lhs_spec[2 + k]]
        size_out = self.eqn.outvars[0].aval.shape[dn.out_spec[2 + k]]
        return (p["window_strides"][k] == window and tuple(p["padding"][k]) == (0, 0)
                and p["lhs_dilation"][k] == 1 and p["rhs_dilation"][k] == 1
                and size_in == size_out * window and iteration_size == size_out)

    def needs_halo(self, k: int, sizes: Sequence[int]) -> bool:
        """Whether a split of spatial dim `k` (`sizes`: the operator's iteration sizes) needs
        its neighbours' rows: anything but a dim the input and result both follow, tiled by
        windows that do not overlap (`local_windows`)."""
        a, b = self.spatial()[k]
        return not (a == b and b is not None and self.local_windows(k, sizes[b]))

    def halo_dims(self, sizes: Sequence[int]) -> set[int]:
        """The iteration dims its spatial dims that need a halo follow (`needs_halo`)."""
        return {d for k, pair in enumerate(self.spatial()) if self.needs_halo(k, sizes)
                for d in pair if d is not None}


class Pooling(NamedTuple):
    """A pooling equation of an operator (``reduce_window_max``, ``reduce_window_sum``, any
    ``reduce_window``): which iteration dim each dim of its input (``lhs``) and result
    (``out``) follows (None: none), as `read_poolings` reads them."""

    unit: int
    eqn: Any
    lhs: tuple[int | None, ...]
    out: tuple[int | None, ...]

    def halo_dims(self, sizes: Sequence[int]) -> set[int]:
        """The iteration dims its windowed dims follow where a split needs its neighbours'
        elements (`sizes`: the operator's iteration sizes): every windowed dim but one the
        input and result both follow, tiled by windows that do not overlap (a 2x2 pool of
        stride 2 without padding), as `Convolution.needs_halo` reads a convolution's."""
        p = self.eqn.params
        size_in, size_out = self.eqn.invars[0].aval.shape, self.eqn.outvars[0].aval.shape
        out: set[int] = set()
        for k, (a, b) in enumerate(zip(self.lhs, self.out)):
            window, stride = p["window_dimensions"][k], p["window_strides"][k]
            plain = (tuple(p["padding"][k]) == (0, 0) and p["base_dilation"][k] == 1
                     and p["window_dilation"][k] == 1)
            if window == 1 and stride == 1 and plain:
                continue  # not a windowed dim
            tiled = (a == b and b is not None and plain and window == stride
                     and size_in[k] == size_out[k] * window and sizes[b] == size_out[k])
            if not tiled:
                out |= {d for d in (a, b) if d is not None}
        return out


def read_poolings(units: Sequence[int], program_units: Sequence[Any], lab: dict,
                  lookup: Callable[[int], int | None]) -> tuple[Pooling, ...]:
    """The pooling equations among `units` (indices into `program_units`), each dim read
    through `lookup` (a label -> its iteration dim); one whose input or result carries no
    labels left out."""
    out = []
    for i in units:
        u = program_units[i]
        if not u.eqn.primitive.name.startswith("reduce_window"):
            continue
        if any(v not in lab for v in (u.ins[0], u.outs[0])):
            continue
        lhs, res = (tuple(lookup(x) for x in lab[v]) for v in (u.ins[0], u.outs[0]))
        out.append(Pooling(i, u.eqn, lhs, res))
    return tuple(out)


def read_convolutions(units: Sequence[int], program_units: Sequence[Any], lab: dict,
                      lookup: Callable[[int], int | None]) -> tuple[Convolution, ...]:
    """The convolution equations among `units` (indices into `program_units`), each dim read
    through `lookup` (a label -> its iteration dim); one whose operands or result carry no
    labels (built from constants alone: computed whole) left out."""
    out = []
    for i in units:
        u = program_units[i]
        if u.eqn.primitive.name != "conv_general_dilated":
            continue
        if any(v not in lab for v in (*u.ins[:2], u.outs[0])):
            continue
        lhs, rhs, res = (tuple(lookup(x) for x in lab[v]) for v in (*u.ins[:2], u.outs[0]))
        out.append(Convolution(i, u.eqn, lhs, rhs, res))
    return tuple(out)
