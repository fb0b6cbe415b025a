"""The SOAP search space on named mesh axes: the configs of an operator, and strategies.

A `Config` of an operator says, for each of its iteration dims (its output dims, then its
reduction dims; see `soapjax.graph.opgraph.Operator`), which mesh axes split it. A mesh axis is used
at most once per operator; the degree of a dim is the product of its axes' sizes; axes the config
does not use replicate the operator. The output dims' part is exactly a `PartitionSpec`:

    >>> import jax, jax.numpy as jnp
    >>> from soapjax.graph.opgraph import trace
    >>> def loss(w, x):
    ...     return jnp.mean(jax.nn.relu(x @ w["kernel"]) @ w["out"])
    >>> f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    >>> graph = trace(loss, {"kernel": f32(512, 1024), "out": f32(1024, 1)}, f32(64, 512))
    >>> op = graph.operators[0]                   # a Dense layer: [batch, in] @ [in, out]
    >>> op.shape, op.roles, op.reduction_dims
    ((64, 1024), ('S', 'P'), (ReductionDim(size=512, role='P'),))
    >>> mesh = MeshShape(("data", "model"), (2, 4))
    >>> c = Config((("data",), ("model",), ()))   # batch over data, features over model
    >>> c.output_spec(op)
    P('data', 'model')
    >>> c.shard_sizes(op, mesh)
    (32, 256, 512)

Splitting a reduction dim (``R``, beyond the paper) leaves partial sums that an all-reduce over
those axes completes: Megatron's row-parallel layer is ``Config(((), (), ("model",)))``.

A `Strategy` is one config per operator of a graph, in the graph's operator order, plus the
mesh axes over which parameters are stored sharded beyond what the configs need (ZeRO-3).

The module stays one: it is the vocabulary every later stage reads (configs, strategies, the
specs they give parameters, batches and optimizer state, and a scan's layers tied to one config).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Literal, get_args

from jax.sharding import AbstractMesh, Mesh, PartitionSpec

from soapjax.base.errors import PlanError
from soapjax.graph._inner import split_windows
from soapjax.graph.opgraph import Operand, Operator, OpGraph
from soapjax.strategy.pipeline import (
    DEFAULT_SCHEDULE,
    ScheduleName,
    check_pipeline,
    check_stage_layers,
)
from soapjax.topology.cluster import Topology

__all__ = ["Config", "MeshLike", "MeshShape", "RECOMPUTE_POLICIES", "RecomputePolicy",
           "SpaceLimits", "Spec", "Strategy", "batch_axes", "batch_readers", "batch_specs",
           "configs", "data_parallel", "dividing_axes", "fit_spec", "param_specs", "reduces_into",
           "sample_dim", "spatial_convolution", "storage_spec", "strategy_from_names", "tie_blocks",
           "to_partition_spec", "validate_config", "within_limits"]


@dataclasses.dataclass(frozen=True)
class MeshShape:
    """Named mesh axes and their sizes: a hashable `jax.sharding.AbstractMesh` without devices.

    The planner's stages key caches and plans by it, so it is frozen and compares by value; it
    converts both ways with JAX's own device-free mesh (`abstract_mesh`, `of`) and says what
    JAX says (`axis_names`, `axis_sizes`, `shape`, `size`).

    >>> mesh = MeshShape(("node", "gpu"), (4, 4))
    >>> mesh.size, mesh.axis_size("gpu"), mesh.degree(("node", "gpu"))
    (16, 4, 16)
    >>> mesh.abstract_mesh
    AbstractMesh('node': 4, 'gpu': 4, axis_types=(Auto, Auto))
    >>> MeshShape.of(mesh.abstract_mesh) == mesh
    True
    """

    axis_names: tuple[str, ...]
    axis_sizes: tuple[int, ...]

    def __post_init__(self):
        if len(self.axis_names) != len(self.axis_sizes):
            raise ValueError(f"{len(self.axis_names)} axis names {self.axis_names} but "
                             f"{len(self.axis_sizes)} sizes {self.axis_sizes}")
        if len(set(self.axis_names)) != len(self.axis_names):
            raise ValueError(f"mesh axis names must be distinct, got {self.axis_names}")
        # `degree` by axes, worked out once (not a field: equality and hashing ignore it)
        object.__setattr__(self, "_degrees", {})

    @classmethod
    def of(cls, mesh: MeshLike) -> MeshShape:
        """The axes of a `jax.sharding.Mesh` or `AbstractMesh`, a `Topology`, or a MeshShape."""
        if isinstance(mesh, MeshShape):
            return mesh
        return cls(tuple(mesh.axis_names), tuple(int(s) for s in mesh.axis_sizes))

    @property
    def abstract_mesh(self) -> AbstractMesh:
        """JAX's device-free mesh of these axes (Auto axis types)."""
        return AbstractMesh(self.axis_sizes, self.axis_names)

    @property
    def shape(self) -> dict[str, int]:
        """``{axis name: size}`` in mesh order, like ``jax.sharding.Mesh.shape``."""
        return dict(zip(self.axis_names, self.axis_sizes))

    @property
    def size(self) -> int:
        """The number of devices, like ``jax.sharding.Mesh.size``."""
        return math.prod(self.axis_sizes)

    num_devices = size  # the older name, kept for callers

    def axis_size(self, axis: str) -> int:
        """The size of one mesh axis."""
        return self.axis_sizes[self.axis_names.index(axis)]

    def degree(self, axes: Sequence[str]) -> int:
        """How many shards splitting over `axes` makes: the product of their sizes."""
        key = axes if isinstance(axes, tuple) else tuple(axes)
        out = self._degrees.get(key)
        if out is None:
            out = self._degrees[key] = math.prod(self.axis_size(a) for a in key)
        return out


# Anything with named mesh axes and their sizes: what a stage accepts where a mesh is meant.
MeshLike = MeshShape | AbstractMesh | Mesh | Topology


@dataclasses.dataclass(frozen=True)
class Config:
    """Which mesh axes split each iteration dim of one operator.

    Attributes:
      axes: one tuple of mesh axis names per iteration dim (output dims, then reduction dims).
    """

    axes: tuple[tuple[str, ...], ...]

    def __post_init__(self):
        used = [a for dim in self.axes for a in dim]
        if len(used) != len(set(used)):
            raise ValueError(f"config {self.axes} uses a mesh axis twice; each axis splits at "
                             "most one dim of an operator")

    @classmethod
    def replicated(cls, op: Operator) -> Config:
        return cls(((),) * len(op.iteration_sizes))

    @property
    def used_axes(self) -> frozenset[str]:
        return frozenset(a for dim in self.axes for a in dim)

    def degrees(self, mesh: MeshShape) -> tuple[int, ...]:
        return tuple(mesh.degree(d) for d in self.axes)

    def parallelism(self, mesh: MeshShape) -> int:
        """How many devices hold distinct shards (the paper's |c_i|)."""
        return math.prod(self.degrees(mesh))

    def shard_sizes(self, op: Operator, mesh: MeshShape) -> tuple[int, ...]:
        """Iteration dim sizes of one device's shard."""
        return tuple(s // d for s, d in zip(op.iteration_sizes, self.degrees(mesh)))

    def output_spec(self, op: Operator, k: int = 0) -> PartitionSpec:
        """The PartitionSpec of `op.outputs[k]` under this config (complete: R sums done)."""
        return _spec(self._dim_axes(op.outputs[k].dims))

    def operand_axes(self, dims: Sequence[int | None]) -> tuple[tuple[str, ...], ...]:
        """Per operand dim, the axes splitting it (dims from `Operand.dims`)."""
        return self._dim_axes(dims)

    def operand_spec(self, dims: Sequence[int | None]) -> PartitionSpec:
        return _spec(self._dim_axes(dims))

    def reduction_axes(self, op: Operator) -> tuple[str, ...]:
        """Mesh axes over which the output holds partial sums before the all-reduce."""
        return tuple(a for dim in self.axes[len(op.shape):] for a in dim)

    def cotangent_partials(self, operand: Operand, axis_names: Sequence[str]
                           ) -> tuple[str, ...]:
        """Mesh axes (in `axis_names` order) over which `operand`'s cotangent is a partial sum
        under this config: those splitting an iteration dim the operand does not have and
        its value flows into (every output dim; a reduction dim unless `Operand.outside`, as
        a bias added after a row-parallel matmul, whose gradient XLA sums over the batch
        axes only)."""
        own = {a for d in operand.dims if d is not None for a in self.axes[d]}
        skip = {a for d in operand.outside for a in self.axes[d]}
        used = self.used_axes
        return tuple(a for a in axis_names if a in used and a not in own and a not in skip)

    def _dim_axes(self, dims: Sequence[int | None]) -> tuple[tuple[str, ...], ...]:
        return tuple(self.axes[d] if d is not None else () for d in dims)

    def describe(self, op: Operator) -> str:
        """Compact text, e.g. ``[S:data, P:model | R:-]``."""
        return self.describe_roles(op.iteration_roles, len(op.shape))

    def describe_roles(self, roles: Sequence[str], num_outputs: int) -> str:
        """`describe` from the iteration dims' roles, the first `num_outputs` being output dims."""
        parts = [f"{r}:{'+'.join(a) or '-'}" for r, a in zip(roles, self.axes)]
        n = num_outputs
        reduction = " | " + ", ".join(parts[n:]) if parts[n:] else ""
        return "[" + ", ".join(parts[:n]) + reduction + "]"


# What an operator recomputes in the backward pass, lightest first (`soapjax.strategy.memory` says
# what each drops and runs again). The one spelling: memory, search, the baselines and the pipelined
# step all read these.
RecomputePolicy = Literal["none", "selective", "full"]
RECOMPUTE_POLICIES: tuple[RecomputePolicy, ...] = get_args(RecomputePolicy)


def _spec(axes: Sequence[tuple[str, ...]]) -> PartitionSpec:
    return PartitionSpec(*[(a[0] if len(a) == 1 else a) if a else None for a in axes])


@dataclasses.dataclass(frozen=True)
class Strategy:
    """A config for every operator of a graph, and how parameters are stored.

    Attributes:
      configs: one config per operator, in `OpGraph.operators` order.
      zero_axes: ZeRO-3 / fully sharded data parallel: parameters, gradients and optimizer
        state are additionally split over these mesh axes where they are replicated; each
        operator all-gathers its parameters before use and gradients are reduce-scattered.
      microbatches: M: the global batch runs as M microbatches, gradients summed over a
        ``lax.scan`` and synchronised once (`soapjax.strategy.memory`).
      recompute: per operator, in graph order, ``"none"``, ``"selective"`` or ``"full"``
        (`soapjax.strategy.memory` says what each recomputes); () means none anywhere.
      stages: S pipeline stages (`soapjax.strategy.pipeline`): the layers cut into S consecutive
        parts on S groups of devices (the outermost mesh axis, ``node``, split S ways; the configs
        are over one stage's devices); 1 means no pipeline.
      virtual_stages: v model chunks per stage (the interleaved schedule); 1 otherwise.
      schedule: the pipeline schedule, one of `soapjax.strategy.pipeline.SCHEDULES` (used when
        ``stages > 1``).
      optimizer_axes: Megatron's distributed optimizer (ZeRO-1): the optimizer state (and
        the update's work) is additionally split over these mesh axes where the parameters
        are replicated, while parameters and gradients keep their layout. The gradient
        synchronisation becomes a reduce-scatter into the optimizer state's layout
        (`optimizer_specs`), each device updates its shard, and the updated parameters are
        all-gathered back: the bytes of the all-reduce, 1/degree of the optimizer state.
      ring_attention: context parallelism's ring form: every attention operator
        (`soapjax.base.attention.flash_attention`) whose query sequence is split passes its keys
        and values around the ring of those axes (`soapjax.base.attention.ring_attention`)
        instead of all-gathering them. Not with pipeline stages.
      stage_layers: layers per pipeline stage, first to last, where the stages are uneven
        (`soapjax.strategy.pipeline.check_stage_layers`: one virtual stage; the last stage lighter
        where the head weighs); () for ``L / S`` each.
    """

    configs: tuple[Config, ...]
    zero_axes: tuple[str, ...] = ()
    microbatches: int = 1
    recompute: tuple[RecomputePolicy, ...] = ()
    stages: int = 1
    virtual_stages: int = 1
    schedule: ScheduleName = DEFAULT_SCHEDULE
    optimizer_axes: tuple[str, ...] = ()
    ring_attention: bool = False
    stage_layers: tuple[int, ...] = ()

    def __post_init__(self):
        if not isinstance(self.ring_attention, bool):
            raise PlanError(f"Strategy.ring_attention must be True or False, got "
                            f"{self.ring_attention!r}")
        if self.ring_attention and (self.stages > 1 or self.virtual_stages > 1):
            raise PlanError("Strategy.ring_attention is not supported with pipeline stages yet "
                            "(the stages run attention in their own shard_map); use the "
                            "gathered form (ring_attention=False) or no stages")
        for name in ("zero_axes", "optimizer_axes"):
            axes = getattr(self, name)
            if isinstance(axes, str) or not all(isinstance(a, str) for a in axes):
                raise PlanError(f"Strategy.{name} must be a sequence of mesh axis names, got "
                                f"{axes!r}")
            if not isinstance(axes, tuple):
                object.__setattr__(self, name, tuple(axes))
        m = self.microbatches
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise PlanError(f"Strategy.microbatches must be an integer >= 1 (the global batch "
                            f"as that many microbatches), got {m!r}")
        if not isinstance(self.recompute, tuple):
            object.__setattr__(self, "recompute", tuple(self.recompute))
        bad = [(k, p) for k, p in enumerate(self.recompute) if p not in RECOMPUTE_POLICIES]
        if bad:
            raise PlanError(f"Strategy.recompute[{bad[0][0]}] is {bad[0][1]!r}; expected one of "
                            f"{RECOMPUTE_POLICIES} per operator (or () for none anywhere)")
        if self.recompute and len(self.recompute) != len(self.configs):
            raise PlanError(f"Strategy.recompute has {len(self.recompute)} policies for "
                            f"{len(self.configs)} operators; give one per operator, in graph "
                            "order, or () for none")
        if all(p == "none" for p in self.recompute):
            object.__setattr__(self, "recompute", ())  # one spelling of "none anywhere"
        if self.stages != 1 or self.virtual_stages != 1 or self.schedule != DEFAULT_SCHEDULE:
            check_pipeline(self.schedule, self.stages, m, self.virtual_stages)
        if not isinstance(self.stage_layers, tuple):
            object.__setattr__(self, "stage_layers", tuple(self.stage_layers))
        if len(set(self.stage_layers)) == 1:
            object.__setattr__(self, "stage_layers", ())  # one spelling of "equal stages"
        check_stage_layers(self.stage_layers, self.stages, self.virtual_stages)

    @property
    def pipelined(self) -> bool:
        """Whether the strategy has pipeline stages."""
        return self.stages > 1 or self.virtual_stages > 1

    def __len__(self) -> int:
        return len(self.configs)

    def __getitem__(self, i: int) -> Config:
        return self.configs[i]

    def replace(self, i: int, config: Config) -> Strategy:
        """This strategy with operator `i` given `config`."""
        configs = self.configs[:i] + (config,) + self.configs[i + 1:]
        return dataclasses.replace(self, configs=configs)

    def recompute_of(self, i: int) -> RecomputePolicy:
        """Operator `i`'s recompute policy (``"none"`` when `recompute` is ())."""
        return self.recompute[i] if self.recompute else "none"

    def with_recompute(self, i: int, policy: RecomputePolicy) -> Strategy:
        """This strategy with operator `i` recomputing under `policy`."""
        r = list(self.recompute or ("none",) * len(self.configs))
        r[i] = policy
        return dataclasses.replace(self, recompute=tuple(r))

    def with_pipeline(self, stages: int, virtual_stages: int = 1,
                      schedule: ScheduleName = DEFAULT_SCHEDULE,
                      stage_layers: tuple[int, ...] = ()) -> Strategy:
        """This strategy with `stages` pipeline stages of `virtual_stages` chunks each, run in
        `schedule` (`soapjax.strategy.pipeline`), `stage_layers` layers each where uneven."""
        return dataclasses.replace(self, stages=stages, virtual_stages=virtual_stages,
                                   schedule=schedule, stage_layers=tuple(stage_layers))

    @property
    def pipeline(self) -> tuple[int, int, str, tuple[int, ...]]:
        """``(stages, virtual_stages, schedule, stage_layers)``: what a pipeline's simulation
        and apply's step are built for."""
        return (self.stages, self.virtual_stages, self.schedule, self.stage_layers)

    def with_microbatches(self, microbatches: int) -> Strategy:
        """This strategy as `microbatches` microbatches of gradient accumulation."""
        return dataclasses.replace(self, microbatches=microbatches)


@dataclasses.dataclass(frozen=True)
class SpaceLimits:
    """Narrows the SOAP space, to compare with the paper's own or with simpler spaces.

    Attributes:
      allow_reduction: split reduction dims (R; FlexFlow cannot).
      allow_attribute: split attribute dims (A: sequence, height, width).
      allow_parameter: split parameter dims (P).
      allow_spatial: split the height and width of image-like operators (convolutions,
        pooling, norms over NHWC images). Off by default: XLA miscompiles
        convolutions split that way (`soapjax.apply.step` refuses such plans; see
        `tests/test_apply.py::test_xla_still_miscompiles_spatially_split_convolutions`).
      max_axes_per_dim: how many mesh axes may split one dim.
      max_dims: how many of an operator's divisible dims its configs split, the largest
        first. An operator has (1 + dims) ** axes configs: a loss that sums 32 layers'
        router statistics (the zoo's MoE) has 196 divisible dims, 7.6 million configs on a
        3-axis mesh, and splitting its small dims saves nothing.
    """

    allow_reduction: bool = True
    allow_attribute: bool = True
    allow_parameter: bool = True
    allow_spatial: bool = False
    max_axes_per_dim: int = 2
    max_dims: int = 10


def within_limits(op: Operator, config: Config, limits: SpaceLimits) -> bool:
    """Whether `config` splits only dims of roles `limits` allows (spatial dims of image-like
    operators included), however many axes it puts on a dim."""
    spatial = not limits.allow_spatial and _image_like(op)
    roles = op.iteration_roles
    return all(not axes or (_allowed(roles[d], limits) and not (spatial and roles[d] == "A"))
               for d, axes in enumerate(config.axes))


def configs(op: Operator, mesh: MeshShape,
            limits: SpaceLimits = SpaceLimits()) -> tuple[Config, ...]:
    """Every config of `op` on `mesh`: each axis splits at most one divisible dim, or none.

    Degrees always divide the dim (and every extent it takes inside the operator:
    `Operator.split_sizes`). Axes on one dim appear in mesh order (the order changes
    only which device holds which shard, not any cost). The replicated config comes first.
    Only the `SpaceLimits.max_dims` largest allowed dims are split (ties: the first).
    """
    # the same for every operator of the same dims (the layers of a model: one list for all)
    spatial = not limits.allow_spatial
    return _configs(op.divisible_dims, op.iteration_roles, op.split_sizes, op.iteration_sizes,
                    spatial and _image_like(op), op.halo_dims if spatial else (), mesh, limits)


@functools.lru_cache(maxsize=1 << 16)
def _configs(divisible: tuple[int, ...], roles: tuple[str, ...], sizes: tuple[int, ...],
             iteration_sizes: tuple[int, ...], spatial: bool, halo: tuple[int, ...],
             mesh: MeshShape, limits: SpaceLimits) -> tuple[Config, ...]:
    dims = [d for d in divisible if _allowed(roles[d], limits)
            and not (spatial and roles[d] == "A") and d not in halo]
    if len(dims) > limits.max_dims:
        largest = sorted(dims, key=lambda d: -iteration_sizes[d])[:limits.max_dims]
        dims = sorted(largest)
    out = []
    # Each axis goes to one of the allowed dims or to none (replicate over it).
    for choice in itertools.product([None, *dims], repeat=len(mesh.axis_names)):
        per_dim: dict[int, list[str]] = {}
        for axis, d in zip(mesh.axis_names, choice):
            if d is not None:
                per_dim.setdefault(d, []).append(axis)
        if any(len(a) > limits.max_axes_per_dim for a in per_dim.values()):
            continue
        if any(sizes[d] % mesh.degree(a) for d, a in per_dim.items()):
            continue
        out.append(Config(tuple(tuple(per_dim.get(d, ())) for d in range(len(sizes)))))
    return tuple(out)


def validate_config(graph: OpGraph, i: int, config: Config, mesh: MeshShape) -> None:
    """Raises PlanError unless `config` fits operator `i` and the mesh (names the operator)."""
    op = graph.operators[i]
    sizes = op.iteration_sizes
    if len(config.axes) != len(sizes):
        raise PlanError(f"operator {op.name!r}: config {list(map(list, config.axes))} has "
                        f"{len(config.axes)} dims, expected {len(sizes)} (its output dims "
                        f"{list(op.shape)} then reduction dims "
                        f"{[r.size for r in op.reduction_dims]})")
    for d, axes in enumerate(config.axes):
        unknown = [a for a in axes if a not in mesh.axis_names]
        if unknown:
            raise PlanError(f"operator {op.name!r}: dim {d} uses unknown mesh axes {unknown}; "
                            f"the mesh has {list(mesh.axis_names)}")
        if axes and (sizes[d] % mesh.degree(axes) or d not in op.divisible_dims):
            raise PlanError(f"operator {op.name!r}: dim {d} of size {sizes[d]} (role "
                            f"{op.iteration_roles[d]}) cannot be split {mesh.degree(axes)} ways "
                            f"over {list(axes)}")


def spatial_convolution(graph: OpGraph, strategy: Strategy) -> tuple[str, str] | None:
    """(name, why) of the first convolution that splits, or receives split, a spatial dim
    with a halo (`Operator.halo_dims`; read from the convolution itself, whatever the dims'
    roles: a split at the edges of windows that do not overlap, a patch embedding's, is exact).

    `soapjax.apply.step` refuses such strategies (XLA computes them wrongly) and the search never
    returns one: an operator of another kind may split a dim that flows into a convolution's
    height or width, which no per-operator space can see.
    """
    position = {op.name: i for i, op in enumerate(graph.operators)}
    for k, (op, cfg) in enumerate(zip(graph.operators, strategy.configs)):
        if "conv" not in op.anchor:
            continue
        halo = split_windows(graph, k, cfg.axes)
        if halo is not None:  # whatever the dims' roles (a position embedding's make them P)
            return op.name, f"its config {cfg.describe(op)}: {halo[1]}"
        for operand in op.inputs:
            if operand.kind != "activation":
                continue
            i = position[operand.source]
            produced = operand.read_of(graph.operators[i].outputs[operand.index].dims)
            for j, (it, src) in enumerate(zip(operand.dims, produced)):
                axes = strategy.configs[i].axes[src] if src is not None else ()
                if axes and (it is None or it in op.halo_dims):
                    where = (f"spatial dim {j}" if it is not None else
                             f"dim {j}, which it reads whole (no dim of its own follows it: "
                             "merged into its features or its window)")
                    return op.name, (f"its input from {operand.source!r} arrives split over "
                                     f"{axes} along {where}")
    return None


def _image_like(op: Operator) -> bool:
    """A convolution, a pooling, or a norm over NHWC images (their height/width are A dims)."""
    if op.anchor.startswith(("conv", "reduce_window", "select_and")):
        return True
    return (len(op.shape) == 4 and op.roles[1:3] == ("A", "A")
            and op.anchor not in ("dot_general", "attention"))  # [B, T, N, H]: not an image


def _allowed(role: str, limits: SpaceLimits) -> bool:
    return {"R": limits.allow_reduction, "A": limits.allow_attribute,
            "P": limits.allow_parameter}.get(role, True)


def strategy_from_names(graph: OpGraph, configs: Mapping[str, Config], *,
                        zero_axes: Sequence[str] = (), default: Strategy | None = None,
                        microbatches: int = 1, recompute: Mapping[str, str] | None = None,
                        pipeline: tuple[int, int, str] | None = None,
                        optimizer_axes: Sequence[str] = (),
                        ring_attention: bool = False,
                        stage_layers: Sequence[int] = ()) -> Strategy:
    """A `Strategy` from configs keyed by operator name (as plan files and hand-written
    strategies name them): the one place names become a strategy
    (`soapjax.strategy.plan.Plan.strategy`, `soapjax.simulate.front.parse_strategy` and the apply
    stage call it).

    Args:
      graph: the traced operator graph.
      configs: operator name -> config, in any order.
      zero_axes: see `Strategy.zero_axes`.
      default: configs (and recompute policies) for operators `configs` leaves out; without it
        every operator must be named.
      microbatches: see `Strategy.microbatches`.
      recompute: operator name -> recompute policy (operators left out: ``"none"``, or the
        default's).
      pipeline: ``(stages, virtual_stages, schedule)``, or None for no pipeline.
      optimizer_axes: see `Strategy.optimizer_axes`.
      ring_attention: see `Strategy.ring_attention`.
      stage_layers: see `Strategy.stage_layers`.

    Raises:
      PlanError: a name that is not an operator of `graph` (with close matches), or operators
        left out and no `default`.
    """
    known = [op.name for op in graph.operators]
    for name in list(configs) + list(recompute or ()):
        if name not in known:
            near = difflib.get_close_matches(name, known, n=3)
            hint = f"; did you mean {', '.join(map(repr, near))}?" if near else ""
            raise PlanError(f"the strategy names operator {name!r}, which graph {graph.name!r} "
                            f"does not have ({len(known)} operators: {_abbrev(known)}){hint}")
    missing = [n for n in known if n not in configs]
    if missing and default is None:
        raise PlanError(f"the strategy has no config for {len(missing)} operator(s) of graph "
                        f"{graph.name!r}: {_abbrev(missing)}; give every operator a config, or "
                        "pass default=")
    cfgs = tuple(configs[n] if n in configs else default.configs[i] for i, n in enumerate(known))
    policies: tuple[str, ...] = ()
    if recompute or (default is not None and default.recompute):
        base = default.recompute if default is not None and default.recompute else None
        policies = tuple((recompute or {}).get(n, base[i] if base else "none")
                         for i, n in enumerate(known))
    return Strategy(cfgs, tuple(zero_axes), microbatches, policies,
                    *(pipeline or (1, 1, DEFAULT_SCHEDULE)),
                    optimizer_axes=tuple(optimizer_axes), ring_attention=ring_attention,
                    stage_layers=tuple(stage_layers))


def _abbrev(names: Sequence[str], n: int = 6) -> str:
    shown = ", ".join(repr(x) for x in names[:n])
    return shown + (f", ... ({len(names) - n} more)" if len(names) > n else "")


def tie_blocks(graph: OpGraph, strategy: Strategy, layer: int = 0) -> Strategy:
    """`strategy` with every layer of a repeated block (`OpGraph.repeated_blocks`) given the
    config and recomputation of its layer `layer` (0: the first; -1: the last).

    A scan's layers stack their weights, one sharding for all of them: a layer split
    otherwise has XLA move its slice of the stack every step (all-to-alls that no operator's
    price holds). The search's chains move a block's layers together and tie their starts to
    the first layer; the baselines, which walk the graph in order (the first layer's input
    arrives from the embedding, the others' from a layer), tie to the last, the steady state."""
    configs, recompute = list(strategy.configs), list(strategy.recompute)
    for group in graph.repeated_blocks():
        for j in group:
            configs[j] = configs[group[layer]]
            if recompute:
                recompute[j] = recompute[group[layer]]
    return dataclasses.replace(strategy, configs=tuple(configs), recompute=tuple(recompute))


def data_parallel(graph: OpGraph, mesh: MeshShape) -> Strategy:
    """Every operator split over its sample dim by as many mesh axes as divide it.

    The sample dim is the first output dim with role ``S``, or for an operator whose output
    has none (the loss, a mean over the batch), its first reduction dim with role ``S``.
    """
    return Strategy(tuple(_split_sample(op, mesh, mesh.axis_names) for op in graph.operators))


def _split_sample(op: Operator, mesh: MeshShape, axes: Sequence[str]) -> Config:
    axes_of: list[tuple[str, ...]] = [()] * len(op.iteration_sizes)
    d = sample_dim(op)
    if d is not None and not op.replicate_only:
        axes_of[d] = dividing_axes(op.split_sizes[d], axes, mesh)
    return Config(tuple(axes_of))


def sample_dim(op: Operator) -> int | None:
    """The iteration dim that follows the batch, if any (worked out once per operator)."""
    memo = getattr(op, "__dict__", None)
    if memo is not None and "_sample_dim" in memo:
        return memo["_sample_dim"]
    roles = op.roles + tuple(r.role for r in op.reduction_dims)
    out = next((i for i, r in enumerate(roles) if r == "S"), None)
    if memo is not None:
        memo["_sample_dim"] = out  # (a frozen dataclass's __dict__; not a field)
    return out


def dividing_axes(size: int, axes: Sequence[str], mesh: MeshShape) -> tuple[str, ...]:
    """The longest prefix of `axes` whose degree divides `size`."""
    out: list[str] = []
    for a in axes:
        if size % (mesh.degree(out) * mesh.axis_size(a)) == 0:
            out.append(a)
    return tuple(out)


Spec = tuple[tuple[str, ...], ...]


def param_specs(graph: OpGraph, strategy: Strategy, mesh: MeshShape) -> dict[str, Spec]:
    """How each parameter is stored: per dim, the mesh axes splitting it.

    A parameter is stored as the first operator that reads it needs it (its operand spec under
    that operator's config), so the forward pass moves no parameters. A stacked parameter of a
    scan over layers is stored as its first layer's slice is read, with the layer dims unsplit.
    Under ZeRO-3 (`strategy.zero_axes`), it is further split over those axes it is still
    replicated on, each on its largest dim that stays divisible; readers then all-gather it
    before use.

    Returns:
      Parameter pytree path (`LeafInfo.path`) -> spec; parameters no operator reads are
      replicated.
    """
    out: dict[str, Spec] = {}
    for op, config in zip(graph.operators, strategy.configs):
        for operand in op.inputs:
            if operand.kind == "param" and operand.leaf_path not in out:
                # A stacked parameter (scan over layers) is stored as its first layer's slice
                # is read, unsplit along the layer dims.
                out[operand.leaf_path] = ((),) * len(operand.layer) + storage_spec(
                    config.operand_axes(operand.dims), operand.shape, strategy.zero_axes, mesh)
    for leaf in graph.params:
        out.setdefault(leaf.path, storage_spec(((),) * len(leaf.shape), leaf.shape,
                                               strategy.zero_axes, mesh))
    return out


def optimizer_specs(graph: OpGraph, strategy: Strategy, mesh: MeshShape) -> dict[str, Spec]:
    """How each parameter's optimizer state is stored (Adam's moments; the gradient the update
    reads is reduce-scattered to it): `param_specs` split further over
    `strategy.optimizer_axes` as ZeRO splits over `zero_axes` (each axis the parameter is still
    replicated on, on its largest dim that stays divisible). Without optimizer axes these are
    the parameters' specs.

    Example: ``fc1``'s kernel [16, 32] under Megatron (column parallel over ``model``) with
    ``optimizer_axes=("data",)`` on ``data=2, model=4``: the parameter ``P(None, 'model')``,
    its moments ``P('data', 'model')``.
    """
    return param_specs(graph, dataclasses.replace(
        strategy, zero_axes=optimizer_state_axes(strategy)), mesh)


def optimizer_state_axes(strategy: Strategy) -> tuple[str, ...]:
    """The axes the optimizer state is split over: ZeRO's, then the distributed optimizer's
    it does not name already."""
    return tuple(strategy.zero_axes) + tuple(a for a in strategy.optimizer_axes
                                             if a not in strategy.zero_axes)


def reduces_into(spec: Spec, producer: Spec, partials: Sequence[str]) -> bool:
    """Whether a cotangent laid out as `spec`, a partial sum over `partials`, is reduced
    straight into its producer's layout `producer` (a reduce-scatter) rather than all-reduced
    where it is made: every dim keeps its axes and gains only partial ones, only one dim
    gains, and where that dim is already split it gains every partial axis (Megatron's
    sequence parallelism: the sequence dim gains ``model``). Apply constrains the cotangent so
    only then (`soapjax.apply._flatstep`), and the simulator prices it so: an axis moving
    between dims, partial axes scattered into two dims at once, or some partial axes
    scattered into an already split dim and the others left to an all-reduce, made XLA
    compute wrong gradients upstream (docs/xla-workarounds.md)."""
    n = max(len(spec), len(producer))
    pairs = list(zip(tuple(spec) + ((),) * (n - len(spec)),
                     tuple(producer) + ((),) * (n - len(producer))))
    gaining = [(f, set(b[len(f):])) for f, b in pairs if len(b) > len(f)]
    return (len(gaining) <= 1 and all(not f or g == set(partials) for f, g in gaining)
            and all(tuple(b[:len(f)]) == tuple(f) and set(b[len(f):]) <= set(partials)
                    for f, b in pairs))


def fit_spec(spec: Spec, shape: Sequence[int], mesh: MeshShape) -> Spec:
    """`spec` with axes used twice dropped, and on each dim the longest prefix that divides it.

    An operand dim can follow an iteration dim of another extent (a sliced or padded dim), and
    stored arrays need even shards.
    """
    used: set[str] = set()
    out = []
    for axes, size in zip(spec, shape):
        kept: list[str] = []
        for a in axes:
            if a not in used and size % (mesh.degree(kept) * mesh.axis_size(a)) == 0:
                kept.append(a)
                used.add(a)
        out.append(tuple(kept))
    return tuple(out)


def storage_spec(operand_axes: Spec, shape: Sequence[int], zero_axes: Sequence[str],
                 mesh: MeshShape, avoid: Sequence[int] = ()) -> Spec:
    """How a parameter read with `operand_axes` is stored (see `param_specs`); the zero axes
    never on the dims `avoid`."""
    return _with_zero(fit_spec(operand_axes, shape, mesh), shape, zero_axes, mesh, avoid)


def batch_readers(graph: OpGraph) -> dict[str, tuple[int, int]]:
    """Each read batch leaf's first reader, ``(operator, operand)`` by the leaf's path, in
    the order they are first read: what the leaf's layout follows (`batch_specs`). Worked out
    once per graph (`OpGraph.memo`); not to be changed."""
    def first() -> dict[str, tuple[int, int]]:
        out: dict[str, tuple[int, int]] = {}
        for j, op in enumerate(graph.operators):
            for o, x in enumerate(op.inputs):
                if x.kind == "batch":
                    out.setdefault(x.source, (j, o))
        return out
    return graph.memo("batch_readers", first)


def batch_specs(graph: OpGraph, strategy: Strategy) -> dict[str, Spec]:
    """How each batch leaf is fed: as its first consumer needs it (replicated if unread)."""
    ops = graph.operators
    out: dict[str, Spec] = {
        leaf: strategy.configs[j].operand_axes(ops[j].inputs[o].dims)
        for leaf, (j, o) in batch_readers(graph).items()}
    for leaf in graph.batch:
        out.setdefault(leaf.path, ((),) * len(leaf.shape))
    return out


def batch_axes(graph: OpGraph, strategy: Strategy) -> tuple[str, ...]:
    """The mesh axes a pipelined plan's stages take as their data groups: those some layer
    operator (one with a `block_position`) of `strategy` splits its sample dim over and no
    layer operator splits another dim over, in the order they first appear. Megatron's 3D
    strategy on stage x data x model: ``("data",)``. `soapjax.apply._pipelined`'s groups run
    every operator of a stage on their share of the samples, manual in its `jax.shard_map`,
    and sum their gradients once, after the pipeline; the simulator's guard against
    collective-permutes inside a stage leaves them out
    (`soapjax.simulate.pipesim.PipelinedSimulation.stage_permutes`).

    An axis a layer operator splits another dim over (Megatron's features over ``model``)
    is not one the groups may take: there the plan's own layouts hold. (A plan splitting the
    tokens over ``model`` at the embedding and the layers' features over ``model`` ran as data
    parallel over ``model`` inside the stages, its weights gathered, where the simulator
    priced the plan: docs/checks.md.) An axis some layer operator splits its samples over is
    one, whether or not the batch arrives split over it and whether or not every layer
    operator splits its samples so: left automatic inside a stage, XLA all-reduced the layers'
    gradients over it at every microbatch's backward, where the simulator priced one sum
    (docs/checks.md); a layer operator the plan runs on all the samples runs on its group's
    share, and is priced so (`soapjax.strategy._stage_groups.as_run`)."""
    layers = graph.memo("layer_sample_dims", lambda: tuple(
        (j, sample_dim(op)) for j, op in enumerate(graph.operators) if op.block_position))
    configs, seen = strategy.configs, set()
    samples: dict[str, None] = {}
    other: set[str] = set()
    for j, d in layers:  # (tied layers repeat their configs: each distinct one read once)
        axes = configs[j].axes
        if (axes, d) in seen:
            continue
        seen.add((axes, d))
        for k, split in enumerate(axes):
            if k == d:
                samples.update(dict.fromkeys(split))
            else:
                other.update(split)
    return tuple(a for a in samples if a not in other)


def _with_zero(spec: Spec, shape: Sequence[int], zero_axes: Sequence[str], mesh: MeshShape,
               avoid: Sequence[int] = ()) -> Spec:
    axes = [list(a) for a in spec]
    used = {a for dim in spec for a in dim}
    for axis in zero_axes:
        if axis in used:
            continue
        order = sorted((d for d in range(len(shape)) if d not in avoid),
                       key=lambda d: -shape[d] // max(1, mesh.degree(axes[d])))
        for d in order:
            if shape[d] % (mesh.degree(axes[d]) * mesh.axis_size(axis)) == 0:
                axes[d].append(axis)
                used.add(axis)
                break
    return tuple(tuple(a) for a in axes)


def to_partition_spec(spec: Spec) -> PartitionSpec:
    """A per-dim axes spec as a `PartitionSpec`."""
    return _spec(spec)
