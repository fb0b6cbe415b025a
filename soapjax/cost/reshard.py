"""Which collectives a resharding costs: an ideal model, and what XLA actually inserts.

A tensor's sharding is one tuple of mesh axis names per dim, like a `PartitionSpec`
(``(("data",), (), ("model",))``; ``()`` = not split; a `PartitionSpec` is accepted too). A
resharding moves a tensor from a source sharding to a destination one; `partial` names mesh axes
over which the source holds partial sums (an operator that split a reduction dim), which must be
summed on the way. The answer is a tuple of `Collective` (kind, bytes per device in the
`Topology.collective_time` convention, mesh axes), for the simulator to price on the topology.

Two sources of truth, as docs/design.md explains ("Which collectives a resharding costs is XLA's
decision, not ours"):

* ``mode="ideal"`` (the default, `DEFAULT_MODE`): an analytic model, instant. Per dim, the
  longest common prefix of source and destination axes stays; of the rest, an axis split in the
  source but not the destination is all-gathered, one that moves to another dim goes through
  one all-to-all, one that only the destination splits is a free local slice, one that changes
  place within a dim is a collective-permute; partial axes are reduce-scattered where the
  destination splits a dim by them and all-reduced otherwise. Slices come first where they
  can, gathers last, so every collective moves the smallest buffer it can.
* ``mode="xla"``: compile the transition on virtual CPU devices of the same mesh shape and
  read the collectives from the compiled HLO (`soapjax.measure.hlo`). On mesh ``(data=2, model=4)``
  and f32[64,1024] (256 KiB), XLA and the ideal model say:

  - ``P('model', None) -> P(None, 'model')``: both one all_to_all of 64 KiB over model.
  - ``P('data', None) -> P(None, 'model')``: XLA all-gathers the WHOLE tensor (256 KiB over
    data, "Involuntary full rematerialization") and slices; ideal: slice, then a 64 KiB gather.
  - ``P('model', None) -> P('data', None)``: XLA a 64 KiB collective_permute over (data,
    model), then a 128 KiB all_gather over half of model (``group_size=2``); ideal: one
    256 KiB all_gather over model.
  - ``P('data', None) -> P('data', 'model')``: both nothing (a local slice).
  - partial sums over model, ``P('data', None)`` to itself: both a 128 KiB all_reduce; to
    ``P('data', 'model')``: both a 128 KiB reduce_scatter; to ``P(('data', 'model'), None)``
    from ``P()``: XLA all-reduces all 256 KiB and slices, ideal reduce-scatters 128 KiB.

How a transition is compiled (in `soapjax.measure._reshard_worker`, a subprocess):

* ``jax.jit(lambda x: with_sharding_constraint(x, dst), in_shardings=src)`` on a
  `jax.sharding.Mesh` of `AxisType.Auto` axes, lowered on a `ShapeDtypeStruct` (no data).
* Partial sums: the input gets a leading dim of size ``prod(partial axis sizes)`` split over
  the partial axes, and the body sums it away (``lax.reduce``) before the constraint. The
  partitioner then holds exactly a partial-sum tensor sharded like `src` and chooses how to
  complete and reshard it. A dot whose contracting dim is split would also do it, but XLA then
  also decides how to move the dot's operands (it often gathers an operand instead), which is
  the operator's choice, not the resharding's.
* Dtype: the tensor is compiled as the unsigned integer of the same width (f32 -> u32, bf16 ->
  u16). The partitioner's choices do not depend on the dtype (checked over 121 transitions:
  identical HLO collectives for f32 and u32), but the CPU backend promotes bf16 collectives to
  f32 (the CPU's doing, not the partitioner's); the integer keeps the real dtype's bytes.
* Reduce-scatter: the CPU pipeline leaves "all-reduce, then dynamic-slice my part" as two ops;
  XLA's GPU pipeline (pass ``ReduceScatterCreator``) turns that pair into one reduce-scatter.
  With ``emulate_reduce_scatter=True`` (default) the pair is read as that reduce-scatter
  (`soapjax.measure.hlo.collectives`, ``reduce_scatter_from_slices``).
* Many transitions are compiled as one program, 32 per program, each under its own
  ``jax.named_scope`` so that a collective is attributed through its ``op_name``. The
  all-reduce combiner, which would merge the all-reduces of different transitions, is off; a
  merged or unattributable collective sends the chunk back to one program per transition.
  (Checked: 149 random 3-axis transitions, partial sums and bf16 among them, give the same
  collectives batched as alone.) The CPU backend's code generation is turned down
  (``xla_cpu_use_fusion_emitters=False``, ...), which changes no collective. A transition
  costs ~10-30 ms batched, ~130 ms alone (jit's fixed cost), plus ~2-3 s of jax import once.

The subprocess has ``XLA_FLAGS=--xla_force_host_platform_device_count=N`` for the mesh's N
devices and ``JAX_PLATFORMS=cpu``, so a 64-device mesh is planned from a process with 8. It
stays up for the `Resharder`'s life (JSON lines on stdin/stdout), so a lazy miss costs one
compile, not a jax import. Results are cached on disk, one JSON file per transition under
``$SOAPJAX_CACHE_DIR/reshard/`` (default ``~/.cache/soapjax/reshard/``), keyed by the jax and
jaxlib versions and the exact (shape, dtype width, source, destination, partial, mesh shape),
with mesh axes by position, so meshes of the same shape share entries; writes are atomic, and an
unreadable entry is recompiled (with a logged warning). A failed or timed-out compilation falls
back to the ideal model (``source="fallback"``), is not cached on disk, and never raises.

The simulator holds one `Resharder` per mesh: ``Resharder(mesh).reshard(...)`` is memoised in
memory (a repeated call is a dict lookup, ~1 us), and ``.prefetch(transitions)`` compiles every
not yet cached transition in one batch.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import tempfile
from collections.abc import Iterable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any, Literal, NamedTuple, Protocol, Self

import numpy as np

from soapjax.base._cache import cache_root
from soapjax.base._dtypes import is_key, itemsize
from soapjax.base.errors import SoapjaxError
from soapjax.cost._reshard_ideal import (
    KINDS as KINDS,
    Collective as Collective,
    NormalTransition as _Key,
    ideal,
)
from soapjax.measure._reshard_worker import CHUNK, Worker
from soapjax.strategy.space import MeshLike, MeshShape

__all__ = ["DEFAULT_MODE", "KINDS", "Collective", "Mode", "ReshardError", "ReshardModel",
           "Resharder", "Resharding", "Source", "Spec", "Transition", "ideal_collectives",
           "permute_free", "reshard"]

log = logging.getLogger(__name__)

Mode = Literal["xla", "ideal"]
Source = Literal["xla", "ideal", "fallback"]

# The one resharding default of soapjax: `Resharder`, `reshard`, `soapjax.search.find.find_plan`,
# `soapjax.simulate.front.simulate` and `compare`, `soapjax check`, `soapjax simulate`,
# `soapjax plan` and the training helper all use it. Why the ideal model and not XLA's choices: the
# search scores thousands of proposals per second with it, and a few per second compiling (numbers
# in `soapjax.search.find.find_plan`); ``mode="xla"`` is there when XLA's exact choices matter.
DEFAULT_MODE: Mode = "ideal"
Spec = Sequence[Sequence[str] | str | None]

_CACHE_VERSION = 1  # bump when the compiled construction or the stored format changes
class ReshardModel(Protocol):
    """What the simulator asks of a resharder: `Resharder` is one, a recording stub another.

    A model may also offer ``prefetch(transitions) -> int`` (answer many at once).
    """

    def reshard(
        self, shape: Sequence[int], dtype: Any, src: Spec, dst: Spec, *, partial: Sequence[str] = ()
    ) -> Sequence[Collective]: ...


class ReshardError(SoapjaxError, ValueError):
    """A sharding spec, partial-sum axes or shape that does not fit the tensor or the mesh."""


class Resharding(NamedTuple):
    """The collectives of one transition and where they came from.

    Attributes:
      collectives: in program order.
      source: ``"xla"`` (compiled, now or from the disk cache; or a transition that moves
        nothing), ``"ideal"`` (the analytic model was asked for), or ``"fallback"`` (the
        compilation failed or timed out; the analytic model stands in).
      note: why it fell back, else "".
    """

    collectives: tuple[Collective, ...]
    source: Source
    note: str = ""


class Transition(NamedTuple):
    """A resharding to price: what `Resharder.prefetch` takes (plain tuples work too)."""

    shape: Sequence[int]
    dtype: Any
    src: Any
    dst: Any
    partial: Sequence[str] = ()


# --- public functions ----------------------------------------------------------------------------


def permute_free(src: Spec, dst: Spec, mesh: MeshShape | None = None) -> bool:
    """Whether XLA's SPMD partitioner makes the layout change `src` -> `dst` with no
    collective-permute: every mesh axis both split stays in its dim at its place, and no axis
    is gathered while another is sliced; or, nothing gathered or sliced, the axes that change
    place leave one dim together and arrive in another together, in order (one all-to-all).
    A place is a dim and the position in it: an axis that stays in its dim while one before
    it leaves has moved (XLA then permutes the tiles). Axes of size 1 on `mesh` split
    nothing.

    Outside this class XLA often exchanges tiles between devices with collective-permutes
    (on ``data=2 x model=2``, 87 of 200 random transitions; the ideal model predicts 16),
    which a pipeline stage cannot run inside its own action
    (`soapjax.apply._pipelined.check_compiled`); inside it, none of 700 random transitions
    compiled on three meshes had one (docs/checks.md, "Collective-permutes inside a stage").
    Partial sums do not change the answer.

    >>> permute_free((("data",), ()), (("data",), ("model",)))    # a local slice
    True
    >>> permute_free((("model",), ()), ((), ("model",)))          # one all-to-all
    True
    >>> permute_free((("model",), ()), ((), ("data",)))           # gather one, slice another
    False
    >>> permute_free(((), ("node", "model")), (("node",), ("model",)))  # model's place moves
    False
    """
    def places(spec: Spec) -> dict[str, tuple[int, int]]:
        out = {}
        for d, entry in enumerate(spec):
            axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
            axes = [a for a in axes if mesh is None or mesh.axis_size(a) > 1]
            out.update((a, (d, k)) for k, a in enumerate(axes))
        return out

    s, d = places(src), places(dst)
    moved = sorted((a for a in s if a in d and s[a] != d[a]), key=lambda a: s[a])
    gathered = any(a not in d for a in s)
    sliced = any(a not in s for a in d)
    if not moved:
        return not (gathered and sliced)
    if gathered or sliced:
        return False
    # one all-to-all: the moved axes leave one dim together and arrive in another in order
    (d1, k1), (d2, k2) = s[moved[0]], d[moved[0]]
    return d1 != d2 and all(s[a] == (d1, k1 + i) and d[a] == (d2, k2 + i)
                            for i, a in enumerate(moved))


def reshard(
    shape: Sequence[int],
    dtype: Any,
    src: Spec,
    dst: Spec,
    mesh: MeshLike,
    *,
    partial: Sequence[str] = (),
    mode: Mode = DEFAULT_MODE,
    cache_dir: str | os.PathLike | None = None,
) -> tuple[Collective, ...]:
    """The collectives that move a tensor from sharding `src` to `dst` on `mesh`.

    One-off use; a caller that asks often holds a `Resharder` (memoised, one subprocess).

    >>> mesh = MeshShape(("data", "model"), (2, 4))
    >>> reshard((64, 1024), "float32", (("model",), ()), ((), ("model",)), mesh)
    (Collective(kind='all_to_all', nbytes=65536.0, axes=('model',), group_size=0),)
    >>> reshard((64, 1024), "float32", (("data",), ()), (("data",), ()), mesh,
    ...         partial=("model",))
    (Collective(kind='all_reduce', nbytes=131072.0, axes=('model',), group_size=0),)

    Args:
      shape: the tensor's global shape.
      dtype: its dtype (anything `numpy.dtype` takes, bfloat16 included).
      src: the source sharding: per dim a tuple of mesh axes (or one name, or None), or a
        `PartitionSpec`; shorter than the rank means the remaining dims are not split.
      dst: the destination sharding, likewise.
      mesh: a `MeshShape`, `Topology`, `jax.sharding.Mesh` or `AbstractMesh`.
      partial: mesh axes over which the source holds partial sums; none of them may split a
        source dim.
      mode: ``"ideal"`` (default) or ``"xla"`` (module doc).
      cache_dir: the soapjax cache root (default ``$SOAPJAX_CACHE_DIR``, else
        ``~/.cache/soapjax``); entries live in its ``reshard/`` folder.

    Raises:
      ReshardError: a spec or partial axes that do not fit the tensor or the mesh.
    """
    with Resharder(mesh, mode, cache_dir) as resharder:
        return resharder.reshard(shape, dtype, src, dst, partial=partial)


def ideal_collectives(shape: Sequence[int], dtype: Any, src: Spec, dst: Spec, mesh: MeshLike, *,
                      partial: Sequence[str] = ()) -> tuple[Collective, ...]:
    """The analytic model alone (``reshard(..., mode="ideal")`` without a Resharder)."""
    mesh = MeshShape.of(mesh)
    return ideal(_normalise(shape, dtype, src, dst, partial, mesh), mesh)


class Resharder:
    """Answers `reshard` for one mesh, memoised; what the simulator holds.

    >>> from jax.sharding import PartitionSpec as P
    >>> r = Resharder(MeshShape(("data", "model"), (2, 4)))  # the ideal model
    >>> r.reshard((64, 1024), "float32", P("data", None), P(None, "model"))
    (Collective(kind='all_gather', nbytes=65536.0, axes=('data',), group_size=0),)
    >>> r.lookup((64, 1024), "float32", P("data", None), P(None, "model")).source
    'ideal'

    With ``mode="xla"`` the same transition is one all_gather of the whole 256 KiB tensor
    (module doc), and ``r.prefetch([...])`` compiles a batch of transitions in one program.

    Not thread-safe. The compiling subprocess lives until `close` (or the end of a ``with``
    block, or garbage collection).

    Args:
      mesh: a `MeshShape`, `Topology`, `jax.sharding.Mesh` or `AbstractMesh`.
      mode: ``"ideal"`` (analytic model; the default, `DEFAULT_MODE`) or ``"xla"`` (compile).
      cache_dir: the soapjax cache root (see `reshard`).
      emulate_reduce_scatter: read the CPU's "all-reduce, then dynamic-slice" as the
        reduce-scatter XLA's GPU pipeline makes of it (module doc).
      timeout_s: seconds one batch may take before the rest falls back to the ideal model,
        plus `per_transition_s` per transition in the batch.
      per_transition_s: see `timeout_s`.
    """

    def __init__(
        self,
        mesh: MeshLike,
        mode: Mode = DEFAULT_MODE,
        cache_dir: str | os.PathLike | None = None,
        *,
        emulate_reduce_scatter: bool = True,
        timeout_s: float = 120.0,
        per_transition_s: float = 2.0,
    ):
        if mode not in ("xla", "ideal"):
            raise ReshardError(f"Resharder mode {mode!r}: expected 'xla' or 'ideal'")
        self.mesh = MeshShape.of(mesh)
        self.mode = mode
        self.cache_dir = cache_root(cache_dir) / "reshard"
        self.emulate_reduce_scatter = emulate_reduce_scatter
        self.timeout_s = timeout_s
        self.per_transition_s = per_transition_s
        self._memo: dict[Any, tuple[Collective, ...]] = {}
        self._info: dict[_Key, Resharding] = {}
        self._worker: Worker | None = None
        self._broken = ""  # why the compiling subprocess cannot start, once it could not
        self._versions = _versions()
        self._stats = {
            "requests": 0,
            "worker_starts": 0,
            "compiled": 0,
            "disk_hits": 0,
            "fallbacks": 0,
        }

    def reshard(
        self, shape: Sequence[int], dtype: Any, src: Spec, dst: Spec, *, partial: Sequence[str] = ()
    ) -> tuple[Collective, ...]:
        """The collectives of one transition (see the module function `reshard`)."""
        raw = (shape, dtype, src, dst, partial)
        try:
            return self._memo[raw]
        except KeyError:
            out = self.lookup(shape, dtype, src, dst, partial=partial).collectives
            self._memo[raw] = out
            return out
        except TypeError:  # an unhashable argument (a list): no fast path
            return self.lookup(shape, dtype, src, dst, partial=partial).collectives

    def lookup(
        self, shape: Sequence[int], dtype: Any, src: Spec, dst: Spec, *, partial: Sequence[str] = ()
    ) -> Resharding:
        """Like `reshard`, with the source of the answer (xla, ideal or fallback)."""
        key = _normalise(shape, dtype, src, dst, partial, self.mesh)
        if key not in self._info:
            self._resolve([key])
        return self._info[key]

    def replicates_whole(
        self, shape: Sequence[int], dtype: Any, src: Spec, dst: Spec, *, partial: Sequence[str] = ()
    ) -> bool:
        """Whether this resharder's answer makes the transition by gathering the whole tensor on
        every device where its destination still splits it: XLA's "Involuntary full
        rematerialization" (replicate, then slice), which the ideal model never prices
        (docs/checks.md, "Reshardings checked against XLA")."""
        key = _normalise(shape, dtype, src, dst, partial, self.mesh)
        if not any(key.dst):
            return False  # a replicated destination is gathered whole by any model
        whole = math.prod(key.shape) * itemsize(key.dtype)
        return any(c.kind == "all_gather" and c.nbytes >= whole
                   for c in self.lookup(shape, dtype, src, dst, partial=partial).collectives)

    def prefetch(self, transitions: Iterable[Transition | Sequence[Any]]) -> int:
        """Answer many transitions at once: one subprocess batch for all not yet cached.

        Args:
          transitions: `Transition`s or tuples ``(shape, dtype, src, dst[, partial])``.

        Returns:
          How many transitions were compiled (neither memoised nor on disk).
        """
        keys = []
        for t in transitions:
            t = Transition(*t)
            keys.append(_normalise(t.shape, t.dtype, t.src, t.dst, t.partial, self.mesh))
        before = self._stats["compiled"]
        self._resolve([k for k in dict.fromkeys(keys) if k not in self._info])
        return self._stats["compiled"] - before

    @property
    def stats(self) -> dict[str, int]:
        """Counters: subprocess ``requests``, ``worker_starts``, transitions ``compiled``,
        ``disk_hits``, ``fallbacks``."""
        return dict(self._stats)

    def fallbacks(self) -> dict[Transition, str]:
        """Transitions answered by the ideal model because compiling failed, and why."""
        return {Transition(*k): r.note for k, r in self._info.items() if r.source == "fallback"}

    def close(self) -> None:
        """Stop the compiling subprocess (a later miss starts a new one)."""
        if self._worker is not None:
            self._worker.close()
            self._worker = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- resolution ---

    def _resolve(self, keys: list[_Key]) -> None:
        if self.mode == "ideal":
            for k in keys:
                self._info[k] = Resharding(ideal(k, self.mesh), "ideal")
            return
        pending = []
        for k in keys:
            if (k.src == k.dst and not k.partial) or self.mesh.num_devices == 1:
                self._info[k] = Resharding((), "xla")
            elif (hit := self._read_cache(k)) is not None:
                self._stats["disk_hits"] += 1
                self._info[k] = Resharding(hit, "xla")
            else:
                pending.append(k)
        if pending:
            self._compile(pending)

    def _compile(self, keys: list[_Key]) -> None:
        results, failures = self._run_worker(keys)
        for k in keys:
            if k in results:
                self._stats["compiled"] += 1
                self._info[k] = Resharding(self._decode(results[k]), "xla")
                self._write_cache(k, results[k])
            else:
                self._stats["fallbacks"] += 1
                note = failures.get(k, "no result from the compiling subprocess")
                self._info[k] = Resharding(ideal(k, self.mesh), "fallback", note)

    def _run_worker(self, keys: list[_Key]) -> tuple[dict[_Key, list], dict[_Key, str]]:
        """Compile `keys` in the subprocess; a crash costs the chunk it was in, then retries."""
        results: dict[_Key, list] = {}
        failures: dict[_Key, str] = {}
        todo = list(keys)
        for _attempt in range(3):
            if not todo or self._broken:
                break
            if self._worker is None:
                self._worker = Worker(self.mesh.num_devices)
                self._stats["worker_starts"] += 1
            self._stats["requests"] += 1
            request = {
                "mesh": list(self.mesh.axis_sizes),
                "rs": self.emulate_reduce_scatter,
                "items": [self._encode(k) for k in todo],
            }
            timeout = self.timeout_s + self.per_transition_s * len(todo)
            got, error = self._worker.request(request, timeout)
            for i, res in got.items():
                if "error" in res:
                    failures[todo[i]] = res["error"]
                else:
                    results[todo[i]] = res["collectives"]
            rest = [k for i, k in enumerate(todo) if i not in got]
            if error is None:
                break
            if not self._worker.ready:  # it died before jax was up: no use trying again
                self._broken = f"the compiling subprocess cannot start: {error}"
            self.close()
            for k in rest[: CHUNK if error.startswith("crash") else len(rest)]:
                failures[k] = error
            todo = [k for k in rest if k not in failures]
        for k in todo:
            if k not in results and k not in failures and self._broken:
                failures[k] = self._broken
        return results, failures

    # --- encoding: mesh axes by position, so meshes of one shape share the disk cache ---

    def _encode(self, k: _Key) -> dict[str, Any]:
        index = self.mesh.axis_names.index
        return {
            "shape": list(k.shape),
            "dtype": _compile_dtype(k.dtype),
            "src": [[index(a) for a in d] for d in k.src],
            "dst": [[index(a) for a in d] for d in k.dst],
            "partial": [index(a) for a in k.partial],
        }

    def _decode(self, records: list) -> tuple[Collective, ...]:
        names = self.mesh.axis_names
        return tuple(
            Collective(kind, float(nbytes), tuple(names[i] for i in axes), int(gs))
            for kind, nbytes, axes, gs in records
        )

    # --- disk cache ---

    def _cache_key(self, k: _Key) -> dict[str, Any]:
        return {
            "version": _CACHE_VERSION,
            **self._versions,
            "mesh": list(self.mesh.axis_sizes),
            "reduce_scatter": self.emulate_reduce_scatter,
            **self._encode(k),
        }

    def _cache_path(self, key: dict[str, Any]) -> Path:
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
        return self.cache_dir / digest[:2] / f"{digest}.json"

    def _read_cache(self, k: _Key) -> tuple[Collective, ...] | None:
        key = self._cache_key(k)
        path = self._cache_path(key)
        try:
            entry = json.loads(path.read_text())
            if entry["key"] != key:
                return None
            return self._decode(_checked_records(entry["collectives"], len(self.mesh.axis_names)))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
            # unreadable or corrupt: compile again, and overwrite it
            log.warning("reshard cache entry %s is unreadable (%s: %s); compiling again", path,
                        type(e).__name__, e)
            return None

    def _write_cache(self, k: _Key, records: list) -> None:
        key = self._cache_key(k)
        path = self._cache_path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(
                "w", dir=path.parent, suffix=".tmp", delete=False
            ) as f:
                json.dump({"key": key, "collectives": records}, f)
            os.replace(f.name, path)
        except OSError:
            pass  # a read-only or full disk costs a recompilation later, nothing else


# --- normalisation -------------------------------------------------------------------------------


def _normalise(
    shape: Sequence[int], dtype: Any, src: Spec, dst: Spec, partial: Sequence[str], mesh: MeshShape
) -> _Key:
    try:
        shape = tuple(int(s) for s in shape)
    except (TypeError, ValueError):
        raise ReshardError(f"shape {shape!r}: expected a sequence of ints") from None
    if any(s < 0 for s in shape):
        raise ReshardError(f"shape {shape}: dims must be >= 0")
    if is_key(str(dtype)):
        # A typed PRNG key (dropout's per-step keys) moves as its raw words: priced, and
        # compiled, as an unsigned integer array of the same bytes per element.
        dtype = {4: "uint32", 8: "uint64"}.get(itemsize(dtype), "uint64")
    try:
        dtype_name = np.dtype(dtype).name
    except TypeError:
        raise ReshardError(f"dtype {dtype!r} is not a numpy/jax dtype") from None
    s = _spec(src, len(shape), mesh, "source")
    d = _spec(dst, len(shape), mesh, "destination")
    if isinstance(partial, str):
        partial = (partial,)
    for a in partial:
        _check_axis(a, mesh, "partial")
    if len(set(partial)) != len(partial):
        raise ReshardError(f"partial axes {tuple(partial)} name an axis twice")
    p = tuple(a for a in mesh.axis_names if a in partial and mesh.axis_size(a) > 1)
    for dim, axes in enumerate(s):
        if clash := set(axes) & set(p):
            raise ReshardError(
                f"partial axes {p} also split dim {dim} of the source sharding {s}; a mesh axis "
                f"holds either partial sums or a slice of a dim, not both ({sorted(clash)})"
            )
    return _Key(shape, dtype_name, s, d, p)


def _spec(spec: Any, rank: int, mesh: MeshShape, what: str) -> tuple[tuple[str, ...], ...]:
    entries = tuple(spec)
    if len(entries) > rank:
        raise ReshardError(
            f"{what} sharding {spec} is only valid for values of rank at least {len(entries)}, "
            f"but was applied to a value of rank {rank}"
        )
    out = []
    for e in entries + (None,) * (rank - len(entries)):
        axes = () if e is None else (e,) if isinstance(e, str) else tuple(e)
        for a in axes:
            _check_axis(a, mesh, f"{what} sharding {spec}")
        out.append(axes)
    used = [a for axes in out for a in axes]
    if len(used) != len(set(used)):
        raise ReshardError(
            f"{what} sharding {spec} uses a mesh axis twice; each axis splits at most one dim"
        )
    return tuple(tuple(a for a in axes if mesh.axis_size(a) > 1) for axes in out)


def _check_axis(axis: Any, mesh: MeshShape, where: str) -> None:
    if axis not in mesh.axis_names:
        raise ReshardError(
            f"{where}: unknown mesh axis {axis!r}; the mesh has {', '.join(mesh.axis_names)}"
        )


def _compile_dtype(dtype: str) -> str:
    """The unsigned integer of the same width (module doc: the CPU promotes bf16)."""
    size = itemsize(dtype)
    return f"uint{8 * size}" if size in (1, 2, 4, 8) else dtype


# --- the disk cache location and versions --------------------------------------------------------


def _versions() -> dict[str, str]:
    out = {}
    for package in ("jax", "jaxlib"):
        try:
            out[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            out[package] = "unknown"
    return out


def _checked_records(records: Any, num_axes: int) -> list:
    """Cache or worker records ``[kind, nbytes, [axis index...], group_size]``, validated."""
    out = []
    for kind, nbytes, axes, gs in records:
        if kind not in KINDS or not all(isinstance(a, int) and 0 <= a < num_axes for a in axes) \
                or not math.isfinite(float(nbytes)) or float(nbytes) < 0 or int(gs) < 0:
            raise ValueError(f"bad collective record {[kind, nbytes, axes, gs]}")
        out.append([kind, float(nbytes), list(axes), int(gs)])
    return out
