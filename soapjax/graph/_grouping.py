"""Operator grouping and dim analysis: the program's equations become operators.

Equations are grouped around anchor primitives (matmuls, convolutions, embedding gathers,
pooling, loops), the cheap elementwise, broadcast and reshape equations next to an anchor
folded into it as XLA's fusion would; each group becomes an `Operator` named by its Flax module
path, with its iteration dims, their roles, and how each operand's dims follow them.

One module past ~600 lines, on purpose: `_Builder` (most of it) is one pass over the program,
grouping, dim roles and attention's granularity read from the same union-find of dim labels;
the labels themselves live apart (`soapjax.graph._dims`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Callable, Sequence

from soapjax.base.attention import attention_call
from soapjax.graph import _dims
from soapjax.graph._ir import (
    LeafInfo,
    Operand,
    OperandKind,
    Operator,
    OutputTensor,
    ReductionDim,
    Role,
    read_convolutions,
    read_poolings,
)
from soapjax.graph._program import OperatorLabels, Program

# Primitives an operator is built around, strongest first (an equation that contains one of
# them, e.g. a remat2 or custom_jvp_call around a matmul, is anchored on it).
_ANCHORS = ("scan", "while", "cond", "conv_general_dilated", "dot_general", "ragged_dot_general",
            "reduce_window_max", "reduce_window_sum", "reduce_window_min", "reduce_window",
            "select_and_gather_add",
            "sort", "cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp", "fft",
            "scatter", "scatter-add", "scatter_add", "scatter-mul", "scatter-min", "scatter-max",
            "dynamic_update_slice", "top_k")
# Anchors only when they start a new module: a reduction opening a layer norm or a loss starts
# an operator, one inside a softmax folds into the matmul before it. A gather that reads a
# parameter (an embedding lookup) is a full anchor.
_SOFT_ANCHORS = ("reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "argmax", "argmin",
                 "reduce_and", "reduce_or", "gather", "psum")
# What `_sink_side_branches` never moves to a later operator: anchors and reductions.
_STAYS = frozenset(_ANCHORS) | {p for p in _SOFT_ANCHORS if p not in ("gather", "psum")}
# Primitives that only print or call back, returning nothing: no operator of their own.
_DEBUG_PRINTS = frozenset({"debug_print", "debug_callback"})
# Cheap primitives folded into their neighbours (XLA fuses them).
_CHEAP = frozenset("""
add add_any sub mul div rem pow integer_pow max min neg sign floor ceil round is_finite exp exp2 log
log1p expm1 tanh logistic sin cos tan asin acos atan atan2 sinh cosh asinh acosh atanh sqrt
rsqrt cbrt abs erf erfc erf_inv lgamma digamma square eq ne lt le gt ge and or not xor select_n
clamp convert_element_type bitcast_convert_type nextafter shift_left shift_right_logical
shift_right_arithmetic population_count real imag conj complex stop_gradient copy copy_p
broadcast_in_dim reshape squeeze expand_dims transpose rev slice dynamic_slice concatenate stack
unstack pad
iota split sharding_constraint mesh_cast reduce_precision random_seed random_bits random_split
random_fold_in random_wrap random_unwrap threefry2x32 custom_jvp_call custom_vjp_call remat2
checkpoint pjit jit closed_call optimization_barrier platform_index name
""".split())
# Identities that name their operand (`checkpoint_name`: what a remat policy keeps): they stay
# with the operator that made the value, whichever module names it.
_NAMES_VALUES = frozenset({"name"})
# Name-stack entries that are module names (not `jit(...)` or an einsum's `...qhd,...khd->...`).
# A name may be a number: libraries name the layers they hold in a Python list "0", "1", ...
_MODULE_NAME = re.compile(r"[\w][\w.\-]*")
_PARAM_LEAF_NAMES = ("value",)  # nnx.Variable's attribute in state paths


@functools.lru_cache(maxsize=1 << 16)
def module_of_param(path: str) -> str:
    """The module path of a parameter leaf path.

    ``"['params']['layers_3']['attn']['query']['kernel']"`` (linen) and
    ``"['layers_3']['attn']['query']['kernel'].value"`` (nnx) both give
    ``"layers_3/attn/query"``.
    """

    parts = re.findall(r"\['([^']*)'\]|\[(\d+)\]|\.(\w+)", path)
    keys = [a or b or c for a, b, c in parts]
    if keys and keys[-1] in _PARAM_LEAF_NAMES:
        keys = keys[:-1]
    if keys and keys[0] == "params":
        keys = keys[1:]
    return "/".join(keys[:-1])


# What jnp.fft does to its input between moving the axis last and transforming it (`n=`).
_LENGTHS = frozenset({"pad", "slice", "convert_element_type", "copy"})


def _fft_axes(params: dict, rank: int) -> range:
    """The axes an ``fft`` equation of `params` transforms along, of an operand of `rank`
    dims: its last ``len(fft_lengths)``."""
    return range(rank - len(params["fft_lengths"]), rank)


def _per_operator_role(global_role: Role, splits_param: bool) -> Role:
    if global_role in ("S", "-"):
        return global_role
    return "P" if splits_param else "A"


def _attention_granularity(out_shape, red_dims, granularity) -> tuple[int, ...]:
    """An attention operator (`soapjax.base.attention.flash_attention`, output ``[B, T, N, H]``)
    splits its batch, its query sequence (context parallelism: the keys and values gathered
    whole) and its heads; not the head dim, nor its reductions (the head dim of ``q k^T`` and
    the keys' sequence, whose partial results a softmax joins, which no all-reduce does)."""
    sizes = list(granularity or (tuple(out_shape) + tuple(r.size for r in red_dims)))
    return tuple(s if d < 3 else 1 for d, s in enumerate(sizes))


def attention_heads(dims: tuple[int | None, ...], shape: tuple[int, ...], heads: int
                    ) -> tuple[int | None, ...]:
    """The dims of a value an attention operator's equation reads, its heads following
    iteration dim 2, the output's heads, though no label ties them to it: its queries'
    (``[B, T, N, H]``, which the equation regroups by key/value head) and its grouped keys'
    and values' (``[B, S, K, H]``). A split of the ``N`` query heads over d devices gives each
    the ``K / d`` key/value heads they use (query head n uses key/value head
    ``n // (N / K)``). Other values' dims are returned as they are."""
    if len(dims) == 4 and dims[2] is None and dims[1] is not None and heads % shape[2] == 0:
        return (dims[0], dims[1], 2, dims[3])
    return dims


def _attention_heads(operands: list[Operand], out_shape, granularity: tuple[int, ...]
                     ) -> tuple[list[Operand], tuple[int, ...]]:
    """An attention operator's operands with their heads following its output's
    (`attention_heads`); a split of the heads must then divide every operand's heads too."""
    grain = list(granularity)
    out = []
    for o in operands:
        dims = attention_heads(o.dims, o.shape, out_shape[2])
        if o.kind == "activation" and dims != o.dims:
            o = dataclasses.replace(o, dims=dims)
            grain[2] = math.gcd(grain[2], o.shape[2])
        out.append(o)
    return out, tuple(grain)


def _through_reshapes(loc: OperatorLabels, shapes, grain: Sequence[int]) -> tuple[int, ...]:
    """`grain` (per iteration dim, the size its splits must divide) cut to where each dim a
    reshape ties to iteration dims, not one itself, splits evenly at every extent it takes.

    Swin's shifted block rolls ``[B, H, W, C]`` along H (slices of 7 and 1 rows concatenated)
    and partitions H into (windows, rows per window), the rows merged into each window's
    tokens: splitting the tokens splits H, which its 7-row slice cannot follow (the shard
    program failed to build). A degree is kept while every smaller one works too."""
    ls = loc.labels
    extents: dict[int, set[int]] = {}  # label class -> the sizes it takes
    for v, labels in loc.lab.items():
        for lbl, size in zip(labels, shapes[v]):
            if size > 1:
                extents.setdefault(ls.find(lbl), set()).add(size)
    uneven = {lbl for labels in loc.lab.values() for lbl in labels
              if len(extents.get(ls.find(lbl), ())) > 1 and ls.lookup(lbl, loc.iter_of) is None}
    out = list(grain)
    for d, g in enumerate(grain if uneven else ()):
        degrees = [1] * len(grain)
        for k in (k for k in range(2, g + 1) if g % k == 0):
            degrees[d] = k
            if any(e % loc.split_degree(lbl, degrees) for lbl in uneven
                   for e in extents[ls.find(lbl)]):
                out[d] = max(j for j in range(1, k) if g % j == 0)
                break
    return tuple(out)


def _merged_major(ls: _dims.LabelSet, x: int, iter_of: dict[int, int | None]) -> int | None:
    """The iteration dim a reshape merges dim `x` into as its major part, if any (asked of
    the samples alone: `_Builder._operator`).

    Swin partitions ``[B, H, W, C]`` into windows ``[B * H/w * W/w, w * w, C]`` inside its qkv
    projection's operator (a PyTorch port flattens ``[B, T, D]`` to ``[B * T, D]`` before a
    linear layer the same way): the operator's first dim is the merged one, and the operand's
    B, read whole before, is split with it: a degree that divides B splits B alone (the
    operator's granularity keeps it so). Asked of other dims, it would cap their splits where
    reading them whole is the better plan: grouped-query attention's query heads merge the
    key-value heads with the group (``repeat``), and Megatron splits 8 heads 4 ways over 2
    key-value heads, replicated."""
    for whole, parts in ls.merged_into(x):
        d = ls.lookup(whole, iter_of)
        if d is not None and ls.find(parts[0]) == ls.find(x):
            return d
    return None


def _common_prefix(paths: Sequence[str]) -> str:
    split = [p.split("/") for p in paths if p]
    if not split:
        return ""
    out = []
    for parts in zip(*split):
        if len(set(parts)) != 1:
            break
        out.append(parts[0])
    return "/".join(out)


class _Builder:
    """Groups the program's units into operators and works out their dims."""

    def __init__(self, program: Program, params: list[LeafInfo], batch: list[LeafInfo],
                 fname: str):
        self.p = program
        self.fname = fname
        self.param_of = {leaf.value: leaf for leaf in params}
        self._scan_blocks: dict[int, str] = {}  # `_scan_block` by scan
        self.batch_of = {leaf.value: leaf for leaf in batch}
        self.consumers: dict[int, list[int]] = {}
        for i, u in enumerate(program.units):
            for v in u.ins:
                self.consumers.setdefault(v, []).append(i)
        self.is_output = set(program.outputs)

    def sample_coupling(self) -> str:
        """Where the traced step's samples interact, or '' (see `_Coupling`)."""
        return _Coupling(self).find()

    def sample_sums(self) -> tuple[int, ...] | None:
        """The sums over the samples the step's statistics start from (`_Coupling.sums`)."""
        return _Coupling(self).sums()

    def build(self) -> tuple[list[Operator], list[str]]:
        self._global_labels()
        self._stacks()
        groups, anchors, unsupported = self._group()
        names = self._names(groups, anchors)
        self.exported: dict[int, tuple[str, int]] = {}  # value id -> (operator, output index)
        ops = []
        for g in range(len(groups)):  # producers come first, so their exports are known
            op = self._operator(names[g], groups[g], anchors[g], g)
            self.exported.update({t.value: (op.name, k) for k, t in enumerate(op.outputs)})
            ops.append(op)
        return mark_unrolled_layers(ops), unsupported

    # The whole program once: roles of every dim, per-unit FLOPs and reductions.
    def _global_labels(self) -> None:
        ls = _dims.LabelSet()
        self.gl: dict[int, tuple[int, ...]] = {}
        for vid in range(len(self.p.shapes)):
            if vid in self.p.literals or vid in self.p.consts or vid in self.p.inputs:
                self.gl[vid] = ls.fresh_many(self.p.shapes[vid])
        for vid, leaf in self.batch_of.items():
            ls.mark(self.gl[vid][0], "S")
        for vid in self.param_of:
            for lbl in self.gl[vid]:
                ls.mark(lbl, "P")
        self.info: list[_dims.EqnInfo] = []
        env: dict = {}
        for u in self.p.units:
            info = _dims.eqn_labels(ls, u.eqn, [self.gl[v] for v in u.ins], env)
            for vid, lb in zip(u.outs, info.outs):
                if vid is not None:
                    self.gl[vid] = lb
            self.info.append(info)
        self.gls = ls

    def role(self, vid: int, d: int) -> Role:
        lbl = self.gl[vid][d]
        if self.gls.size[lbl] <= 1:
            return "-"
        marks = self.gls.marks(lbl)
        return "S" if "S" in marks else "P" if "P" in marks else "-" if "seq" in marks else "A"

    def _stacks(self) -> None:
        """Module path of each unit: its name stack without the root module's class name."""
        stacks = [u.stack.split("/") if u.stack else [] for u in self.p.units]
        roots = {s[0] for s in stacks if s}
        top_modules = {module_of_param(leaf.path).split("/")[0]
                       for leaf in self.param_of.values()}
        strip = len(roots) == 1 and not (roots & top_modules)
        self.module = []
        self.position: list[str] = []
        for i, s in enumerate(stacks):
            s = [c for c in (s[1:] if strip and s else s) if _MODULE_NAME.fullmatch(c)]
            mod = "/".join(s)
            if not mod:
                mod = _common_prefix([module_of_param(self._param_leaf(v).path)
                                      for v in self.p.units[i].ins if self._param_leaf(v)])
            it = self.p.units[i].iteration
            self.module.append(self._iteration_module(mod, it))
            self.position.append(self._iteration_module(mod, it, lambda _: "*") if it else "")

    def _param_leaf(self, vid: int) -> LeafInfo | None:
        """The parameter leaf a value is, or is a layer slice of."""
        return self.param_of.get(self.p.slice_of.get(vid, (vid, ()))[0])

    def _iteration_module(self, mod: str, iteration: tuple[tuple[int, int], ...],
                          index: Callable[[int], str] = str) -> str:
        """The module path of a unit of unrolled layer-scan iterations: ``layers/fc1`` in
        iteration 3 of the scan over ``layers`` is ``layers_3/fc1``, as unrolled layers are
        named; a path outside the scanned module gets the index as a new leading component."""
        for scan, t in iteration:
            block = self._scan_block(scan)
            for done_scan, done_t in iteration[:[s for s, _ in iteration].index(scan)]:
                block = self._rename(block, self._scan_block(done_scan), done_t)
            mod = self._rename(mod, block, index(t))
        return mod

    @staticmethod
    def _rename(mod: str, block: str, t: int | str) -> str:
        if block and (mod == block or mod.startswith(block + "/")):
            return f"{block}_{t}{mod[len(block):]}"
        return "/".join(x for x in (f"{block or 'layer'}_{t}", mod) if x)

    def _scan_block(self, scan: int) -> str:
        """The module a layer scan iterates over: the common prefix of its stacked leaves
        (worked out once per scan)."""
        memo = self._scan_blocks
        if scan not in memo:
            memo[scan] = _common_prefix([module_of_param(leaf.path) for v in self.p.scans[scan]
                                         if (leaf := self._param_leaf(v)) is not None])
        return memo[scan]

    def _kind(self, i: int) -> str:
        u, prims = self.p.units[i], self.info[i].primitives
        name = u.eqn.primitive.name
        if not prims <= (_CHEAP | set(_ANCHORS) | set(_SOFT_ANCHORS)):
            return "unknown"
        if any(a in prims for a in _ANCHORS):
            return "anchor"
        if name == "gather" and self._reads_param(i):
            return "anchor"
        if name in _SOFT_ANCHORS:
            return "soft"
        return "cheap"

    def _reads_param(self, i: int, depth: int = 4) -> bool:
        """Whether unit `i`'s first operand is a parameter, possibly through cheap units."""
        vid = self.p.units[i].ins[0]
        for _ in range(depth):
            if self._param_leaf(vid) is not None:
                return True
            prod = self._producer.get(vid)
            if prod is None or not self.p.units[prod].ins:
                return False
            vid = self.p.units[prod].ins[0]
        return False

    def _group(self) -> tuple[list[list[int]], list[int], list[str]]:
        units = self.p.units
        self._producer = {v: i for i, u in enumerate(units) for v in u.outs if v is not None}
        group_of: list[int | None] = [None] * len(units)
        groups: list[list[int]] = []
        anchors: list[int] = []
        unsupported: list[str] = []
        value_group: dict[int, int] = {}
        # A value whose unit waits for its consumer: the latest operator it reads from, so
        # that what reads it is never placed before that (a ResNet's global pool, reading the
        # last block's ReLU, joined the stem's pooling operator).
        after: dict[int, int] = {}
        open_group: dict[str, int] = {}  # module path -> its latest operator
        live = self._live()
        for i, u in enumerate(units):
            if i not in live or i in self.p.slice_units:  # dead code (XLA drops it), or a
                continue  # layer's parameter slice, read as that layer's parameter
            kind, name = self._kind(i), u.eqn.primitive.name
            ins = [value_group[v] if v in value_group else after[v] for v in u.ins
                   if v in value_group or v in after]
            latest = max(ins) if ins else None
            mod = self.module[i]
            # A unit of the module whose operator is open (a layer norm's second reduction,
            # its squares) joins that operator rather than the producer it reads from.
            same = open_group.get(mod)
            if same is not None and (latest is None or same >= latest) and (mod or kind == "soft"):
                latest = same
            g = latest
            if (kind == "cheap" and mod and latest is not None and name not in _NAMES_VALUES
                    and mod != self.group_mod(anchors[latest]) and self._feeds_only(i, mod)):
                g = None  # a module's prologue (a norm's squares): decided by its consumer
            if kind in ("anchor", "unknown") or (
                    kind == "soft" and (latest is None or mod != self.module[anchors[latest]])):
                g = len(groups)
                groups.append([])
                anchors.append(i)
                open_group[mod] = g
                if kind == "unknown":
                    known = _CHEAP | set(_ANCHORS) | set(_SOFT_ANCHORS)
                    for prim in sorted(self.info[i].primitives - known):
                        if prim not in unsupported:
                            unsupported.append(prim)
            if g is not None:
                group_of[i] = g
                groups[g].append(i)
                for v in u.outs:
                    if v is not None:
                        value_group[v] = g
            elif ins:
                after.update({v: max(ins) for v in u.outs if v is not None})
        if not groups:  # a function of nothing but cheap equations: one operator
            groups.append([])
            anchors.append(0)
        for i in reversed(range(len(units))):  # equations that only read inputs: join a consumer
            if group_of[i] is not None or i not in live or i in self.p.slice_units:
                continue
            cons = [group_of[c] for v in units[i].outs if v is not None
                    for c in self.consumers.get(v, ()) if group_of[c] is not None]
            g = min(cons) if cons else len(groups) - 1
            srcs = [group_of[self._producer[v]] for v in units[i].ins if v in self._producer]
            g = max([g] + [s for s in srcs if s is not None])  # never before what it reads
            group_of[i] = g
            groups[g].append(i)
        self._sink_side_branches(groups, group_of, anchors)
        self._sink_detached_parts(groups, group_of, anchors)
        for g in groups:
            g.sort()
        groups, anchors = self._split_off_side_reductions(groups, anchors)
        return groups, anchors, unsupported

    def _split_off_side_reductions(self, groups: list[list[int]], anchors: list[int]
                                   ) -> tuple[list[list[int]], list[int]]:
        """Makes each reduction that shares no value with the rest of its operator an operator
        of its own, placed right after it.

        An MoE layer's load-balancing loss reduces the router's probabilities and choices over
        batch and tokens after the layer's combine einsum: in the combine's operator its batch
        dim would be a dim of its own, one no split of the combine's batch reaches, so every
        data-parallel plan would gather the router's outputs whole. Its own operator has one
        batch dim, split like any other.
        """
        out_groups: list[list[int]] = []
        out_anchors: list[int] = []
        for members, anchor in zip(groups, anchors):
            parts = self._connected(members)
            side = [p for p in parts if anchor not in p
                    and any(self.p.units[i].eqn.primitive.name in _STAYS for i in p)]
            rest = sorted(set(members).difference(*side)) if side else members
            out_groups.append(rest)
            out_anchors.append(anchor)
            for p in sorted(side, key=min):
                for cone, reduction in self._reduction_cones(p):
                    out_groups.append(cone)
                    out_anchors.append(reduction)
        return out_groups, out_anchors

    def _reduction_cones(self, part: set[int]) -> list[tuple[list[int], int]]:
        """`part` cut at its reductions: each with what it reads that no earlier one does, the
        equations after the last joining it; ``(members, reduction)`` in program order.

        A load-balancing loss reduces the router's choices and its probabilities over batch
        and tokens apart, then multiplies the two means: one operator would give each batch
        its own dim, and a plan splitting one would gather the other's tensor whole."""
        units = self.p.units
        reductions = sorted(i for i in part if units[i].eqn.primitive.name in _STAYS)
        cones: list[tuple[list[int], int]] = []
        taken: set[int] = set()
        for r in reductions:
            cone = (self._ancestors_of_unit(r, part) | {r}) - taken
            taken |= cone
            cones.append((sorted(cone), r))
        rest = part - taken
        last, r = cones[-1]
        cones[-1] = (sorted(set(last) | rest), r)
        return cones

    def _ancestors_of_unit(self, i: int, members: set[int]) -> set[int]:
        """Units of `members` that unit `i` depends on."""
        return set().union(*(self._ancestors(v, members) for v in self.p.units[i].ins))

    def _connected(self, members: list[int]) -> list[set[int]]:
        """`members` in the parts that share values (one's output read by another)."""
        parent = {i: i for i in members}

        def root(i: int) -> int:
            while parent[i] != i:
                parent[i] = parent[parent[i]]
                i = parent[i]
            return i

        for i in members:
            for v in self.p.units[i].outs:
                for c in self.consumers.get(v, ()) if v is not None else ():
                    if c in parent:
                        parent[root(c)] = root(i)
        parts: dict[int, set[int]] = {}
        for i in members:
            parts.setdefault(root(i), set()).add(i)
        return list(parts.values())

    def _feeds_only(self, i: int, mod: str) -> bool:
        """Whether unit `i`'s results are used only inside module `mod`."""
        cons = [c for v in self.p.units[i].outs if v is not None for c in self.consumers.get(v, ())]
        return bool(cons) and all(self.module[c] == mod or self.module[c].startswith(mod + "/")
                                  for c in cons)

    def _live(self) -> set[int]:
        """Units the function's result depends on, and those with effects other than a debug
        print's: ``jax.debug.print`` and ``jax.debug.callback`` (`_DEBUG_PRINTS`: they return
        nothing) and what only they read are evaluated where they stand, in no operator (a
        dead equation's place), where they made an operator with no output (a crash)."""
        needed = set(self.p.outputs)
        live = set()
        for i in reversed(range(len(self.p.units))):
            u = self.p.units[i]
            effects = u.eqn.effects and u.eqn.primitive.name not in _DEBUG_PRINTS
            if any(v in needed for v in u.outs if v is not None) or effects:
                live.add(i)
                needed.update(u.ins)
        return live

    def _primary(self, exports: list[int], members: set[int], anchor: int) -> int:
        """The main output among exports: computed from the anchor, the largest, the earliest."""
        def key(v):
            return (anchor in self._ancestors(v, members), math.prod(self.p.shapes[v]), -v)
        return max(exports, key=key)

    def _exports(self, members: set[int]) -> list[int]:
        """The values of `members` read outside them: by the function's result, and by any
        other equation, dead or alive. A dead equation (a cache the loss never reads) is in no
        operator but still evaluated, so what it reads must be written back."""
        units = self.p.units
        return [v for i in sorted(members) for v in units[i].outs if v is not None and (
            v in self.is_output or any(c not in members for c in self.consumers.get(v, ())))]

    def _sink_side_branches(self, groups: list[list[int]], group_of: list[int],
                            anchors: list[int]) -> None:
        """Moves equations off an operator's main line into the one operator they feed.

        Flax's LayerNorm squares its input before its first reduction; that square reads the
        previous operator's output and feeds only the norm, so XLA fuses it into the norm.

        A reduction stays where it is, and so does what it reads: a layer's auxiliary loss
        (an MoE router's load-balancing mean over batch and tokens) feeds only the final loss,
        but moved there, its batch dim would be the loss operator's own, one no split of the
        loss's batch reaches, and every data-parallel plan would gather the logits whole.
        """
        units = self.p.units
        for h, members in enumerate(groups):
            mset = set(members)
            exports = self._exports(mset)
            if not exports:
                continue
            main = self._ancestors(self._primary(exports, mset, anchors[h]), mset)
            for i in sorted(members, reverse=True):
                if i in main or any(v in self.is_output for v in units[i].outs if v is not None):
                    continue
                if self.p.units[i].eqn.primitive.name in _STAYS or i == min(members):
                    continue
                cons = {group_of[c] for v in units[i].outs if v is not None
                        for c in self.consumers.get(v, ()) if group_of[c] is not None}
                if len(cons) == 1 and (g := cons.pop()) > h:
                    mset.discard(i)
                    group_of[i] = g
                    groups[g].append(i)
            members[:] = sorted(mset)

    def _sink_detached_parts(self, groups: list[list[int]], group_of: list[int],
                             anchors: list[int]) -> None:
        """Moves each part of an operator that shares no value with its anchor's and reduces
        nothing into the first operator that reads it.

        Swin's window attention reshapes the qkv projection into ``[windows, tokens, 3,
        heads, head dim]`` in the attention module, where the relative position bias table's
        gather opens an operator; the reshape joined that operator, but nothing in it relates
        the reshape's dims to the gather's, so its output had no iteration dims (read whole):
        every data-parallel plan gathered every block's qkv whole. In the attention's first
        matmul, which reads it, its dims are the matmul's. (`_sink_side_branches` moves a
        unit only into the one operator that reads it: q, k and v are read by two.)
        """
        units = self.p.units
        for h, members in enumerate(groups):
            if len(members) < 2:
                continue
            for part in self._connected(members):
                if anchors[h] in part or any(
                        units[i].eqn.primitive.name in _STAYS
                        or any(v in self.is_output for v in units[i].outs if v is not None)
                        for i in part):
                    continue
                cons = {group_of[c] for i in part for v in units[i].outs if v is not None
                        for c in self.consumers.get(v, ()) if group_of[c] is not None}
                if not cons or min(cons) <= h:
                    continue
                g = min(cons)
                for i in part:
                    group_of[i] = g
                    groups[g].append(i)
                members[:] = [i for i in members if i not in part]

    def _ancestors(self, vid: int, members: set[int]) -> set[int]:
        """Units of `members` that the value `vid` depends on."""
        out: set[int] = set()
        todo = [vid]
        while todo:
            i = self._producer.get(todo.pop())
            if i is not None and i in members and i not in out:
                out.add(i)
                todo.extend(self.p.units[i].ins)
        return out

    def group_mod(self, anchor: int) -> str:
        return self.module[anchor]

    def _names(self, groups, anchors) -> list[str]:
        mods = []
        for g, a in zip(groups, anchors):
            mod = self.module[a] or _common_prefix(
                [module_of_param(leaf.path) for i in g for v in self.p.units[i].ins
                 if (leaf := self._param_leaf(v)) is not None])
            mods.append(mod)
        self.group_module = mods
        count: dict[str, int] = {}
        for m in mods:
            count[m] = count.get(m, 0) + 1
        names, used = [], set()
        out_groups = {gi for gi, g in enumerate(groups) for i in g
                      for v in self.p.units[i].outs if v in self.is_output}
        for gi, (m, a) in enumerate(zip(mods, anchors)):
            if not m and gi in out_groups:  # the loss itself, outside any module
                base = self.fname
            else:
                base = (m if (m and count[m] == 1)
                        else "/".join(x for x in (m, self._anchor_name(a)) if x))
            name, k = base, 1
            while name in used:
                name, k = f"{base}_{k}", k + 1
            used.add(name)
            names.append(name)
        return names

    def _anchor_name(self, i: int) -> str:
        if attention_call(self.p.units[i].eqn) is not None:
            return "attention"
        prims = self.info[i].primitives
        for a in _ANCHORS:
            if a in prims:
                return a
        return self.p.units[i].eqn.primitive.name

    def _operator(self, name: str, group: list[int], anchor: int, g: int) -> Operator:
        inputs, exports = self._boundary(group, anchor)
        ls, lab, env, reduced, summed = self._local_labels(group, inputs)
        out_vid = exports[0]
        out_shape = self.p.shapes[out_vid]
        iter_of: dict[int, int | None] = {}  # label class -> iteration dim (None: never split)
        roles = self._output_roles(out_vid, ls, lab, iter_of)
        red_dims = self._reduction_dims(reduced, len(out_shape), ls, lab, iter_of, inputs)

        merge_grain: dict[int, int] = {}  # iteration dim -> what its splits must divide

        def dims_of(v):  # a dim split twice in one tensor (an LSTM's H x 4H kernel): once
            out: list[int | None] = []
            for k, x in enumerate(lab[v]):
                d = ls.lookup(x, iter_of)
                if d is None and (parts := ls.parts_of(x)):
                    # a fused projection's output dim that a reshape splits into heads and head
                    # dims: it follows its major part (a head's block of it is contiguous)
                    d = ls.lookup(parts[0], iter_of)
                if (d is None and self.role(v, k) == "S"
                        and (d := _merged_major(ls, x, iter_of)) is not None):
                    merge_grain[d] = math.gcd(merge_grain.get(d, 0), ls.size[x])
                out.append(None if d in out else d)
            return tuple(out)

        red_iter = range(len(out_shape), len(out_shape) + len(red_dims))

        def outside(v):  # the reduction dims input `v` does not flow into
            into = {ls.lookup(x, iter_of) for x in summed[v]}
            return tuple(k for k in red_iter if k not in into)

        operands = [self._operand(v, g, dims_of(v), outside(v)) for v in inputs]
        # P is per operator (the paper's definition): splitting the dim splits a parameter
        # *this* operator reads. A pooling layer's channels are A, though a conv's are P.
        param_dims = {d for o in operands if o.kind == "param" for d in o.dims if d is not None}
        roles = [_per_operator_role(r, d in param_dims) for d, r in enumerate(roles)]
        for d in self._transformed_dims(group, ls, lab, iter_of):
            if d < len(roles):
                roles[d] = "-"
            else:  # a transform dim the operator then reduces
                red_dims[d - len(roles)] = dataclasses.replace(red_dims[d - len(roles)], role="-")
        red_dims = [dataclasses.replace(r, role=_per_operator_role(r.role,
                                                                   len(roles) + k in param_dims))
                    for k, r in enumerate(red_dims)]
        outputs = tuple(OutputTensor(self.p.shapes[v], self.p.dtypes[v], dims_of(v), v)
                        for v in exports)
        self.p.local[name] = OperatorLabels(tuple(group), tuple(inputs), tuple(exports), ls, lab,
                                            env, iter_of)
        position = self.position[anchor]
        if position:  # the same position in every layer: the operator's name, layer-free
            position += name[len(self.group_module[g]):]
        anchor_name = self._anchor_name(anchor)
        sizes = out_shape + tuple(r.size for r in red_dims)
        granularity = self._granularity(out_shape, red_dims, lab, ls, iter_of)
        if merge_grain:  # a split of a merged dim is its major part's while it divides it
            grain = list(granularity or sizes)
            for d, size in merge_grain.items():
                grain[d] = math.gcd(grain[d], size)
            granularity = tuple(grain)
        if anchor_name == "attention":
            granularity = _attention_granularity(out_shape, red_dims, granularity)
            operands, granularity = _attention_heads(operands, out_shape, granularity)
        granularity = _through_reshapes(self.p.local[name], self.p.shapes, granularity or sizes)
        if granularity == sizes:
            granularity = ()
        halo = self._halo_dims(group, ls, lab, iter_of, sizes)
        return Operator(
            name=name, module=self.group_module[g], anchor=anchor_name,
            shape=out_shape, dtype=self.p.dtypes[out_vid], roles=tuple(roles),
            reduction_dims=tuple(red_dims), flops=float(sum(self.info[i].flops for i in group)),
            bytes_accessed=float(sum(o.nbytes for o in operands) + sum(t.nbytes for t in outputs)),
            inputs=tuple(operands), outputs=outputs, num_equations=len(group),
            replicate_only=self._kind(anchor) == "unknown", block_position=position,
            granularity=granularity, halo_dims=halo)

    def _halo_dims(self, group, ls, lab, iter_of, sizes) -> tuple[int, ...]:
        """`Operator.halo_dims`: the iteration dims its convolutions' spatial dims and its
        poolings' windowed dims follow where a split needs a halo
        (`soapjax.graph._ir.Convolution.needs_halo`, `soapjax.graph._ir.Pooling.halo_dims`)."""
        def lookup(x):
            return ls.lookup(x, iter_of)
        windows = (*read_convolutions(group, self.p.units, lab, lookup),
                   *read_poolings(group, self.p.units, lab, lookup))
        return tuple(sorted(set().union(*(w.halo_dims(sizes) for w in windows))))

    def _boundary(self, group: list[int], anchor: int) -> tuple[list[int], list[int]]:
        """The values a group reads from outside, and those it exports (primary first)."""
        units = self.p.units
        produced = {v for i in group for v in units[i].outs if v is not None}
        inputs: list[int] = []
        for i in group:
            for v in units[i].ins:
                if v not in produced and v not in inputs and v not in self.p.literals:
                    inputs.append(v)
        inside = set(group)
        exports = self._exports(inside)
        if not exports:
            exports = [v for v in units[anchor].outs if v is not None][:1]
        primary = self._primary(exports, inside, anchor)
        exports.remove(primary)
        exports.insert(0, primary)
        return inputs, exports

    def _local_labels(self, group: list[int], inputs: list[int]):
        """The group's own label analysis, fresh at its inputs, so two operands that the whole
        program would call alike (a query's and a key's sequence dim) stay apart."""
        units = self.p.units
        ls = _dims.LabelSet()
        lab = {v: ls.fresh_many(self.p.shapes[v]) for v in inputs}
        lab.update({v: ls.fresh_many(self.p.shapes[v]) for i in group for v in units[i].ins
                    if v in self.p.literals})
        reduced: list[int] = []
        env: dict = {}
        # Which of the group's inputs each value is computed from, and which reduced labels
        # each input flows into (a bias added after the matmul flows into none).
        source: dict[int, frozenset[int]] = {v: frozenset((v,)) for v in inputs}
        summed: dict[int, set[int]] = {v: set() for v in inputs}
        for i in group:
            info = _dims.eqn_labels(ls, units[i].eqn, [lab.get(v) for v in units[i].ins], env)
            reduced += info.reduced
            src = frozenset().union(*(source.get(v, ()) for v in units[i].ins))
            for x in src:
                summed[x].update(info.reduced)
            for v, lb in zip(units[i].outs, info.outs):
                if v is not None:
                    lab[v] = lb
                    source[v] = src
        return ls, lab, env, reduced, summed

    def _transformed_dims(self, group: list[int], ls, lab,
                          iter_of: dict[int, int | None]) -> set[int]:
        """The iteration dims an FFT of `group` keeps whole: those it transforms along (its
        operand's and result's last ``len(fft_lengths)`` dims), and where its operand is a
        transpose (jax moves the axis of `jnp.fft.rfft(x, axis=1)` last), every dim of the
        operand but the first. XLA:CPU's FFT cannot run on the layout the partitioner gives a
        transform dim it splits (a runtime RET_CHECK; a plain-JAX canary in
        tests/test_exactness.py), nor on a transposed operand split along a dim in between
        (the channels of the corpus Hyena's `jnp.fft.irfft` along the time of ``[B, T, C]``);
        a split transform needs all-to-alls anyway. The operators around it may still split
        those dims, resharded at its boundary."""
        dims: set[int] = set()
        producer = self._producer  # value -> the unit making it (`_group`)
        for i in group:
            u = self.p.units[i]
            if u.eqn.primitive.name != "fft":
                continue
            moved, v = False, u.ins[0]
            while v in producer and not moved:  # through the pads and slices of a length
                prim = self.p.units[producer[v]].eqn.primitive.name
                moved = prim == "transpose"
                v = self.p.units[producer[v]].ins[0] if prim in _LENGTHS else None
            for v in (*u.ins[:1], *u.outs[:1]):
                if v is not None and v in lab:
                    axes = range(1, len(lab[v])) if moved else _fft_axes(u.eqn.params,
                                                                         len(lab[v]))
                    dims.update(d for a in axes
                                if (d := ls.lookup(lab[v][a], iter_of)) is not None)
        return dims

    def _output_roles(self, out_vid: int, ls, lab, iter_of: dict[int, int | None]) -> list[Role]:
        """The primary output's dims become iteration dims 0..n-1. A label the output holds
        twice (attention scores whose queries and keys are one operand's sequence, sliced
        from a fused QKV projection; a Gram matrix ``x @ x.T``) is never split: its dims are
        '-' and it maps to no iteration dim (None), so every operand dim it labels is read
        whole. Splitting one of its dims would split the operand, and so both dims, where
        the config says one: the cost stage's shard program would compute another shape,
        and the simulator would miss the gather XLA makes for the other."""
        classes = [ls.find(lbl) for lbl in lab[out_vid]]
        roles: list[Role] = []
        for d, c in enumerate(classes):
            tied = classes.count(c) > 1 and ls.size[c] > 1
            roles.append("-" if tied or c in iter_of else self.role(out_vid, d))
            if c not in iter_of:
                iter_of[c] = None if tied else d
        return roles

    def _reduction_dims(self, reduced, first: int, ls, lab, iter_of: dict[int, int | None],
                        inputs: list[int]) -> list[ReductionDim]:
        """The splittable reduced labels become iteration dims after the output's."""
        red_dims: list[ReductionDim] = []
        for lbl in reduced:
            if (ls.lookup(lbl, iter_of) is not None or ls.find(lbl) in iter_of
                    or ls.size[lbl] <= 1 or "seq" in ls.marks(lbl)):
                continue
            k = first + len(red_dims)
            iter_of[ls.find(lbl)] = k
            red_dims.append(ReductionDim(ls.size[lbl],
                                         self._reduction_role(ls, k, iter_of, inputs, lab)))
        return red_dims

    def _operand(self, v: int, g: int, dims: tuple[int | None, ...],
                 outside: tuple[int, ...] = ()) -> Operand:
        kind, source, index = self._source(v, g)
        layer = self.p.slice_of[v][1] if kind != "batch" and v in self.p.slice_of else ()
        return Operand(kind, source, index, self.p.shapes[v], self.p.dtypes[v], dims, v, layer,
                       outside)

    def _granularity(self, out_shape, red_dims, lab, ls, iter_of) -> tuple[int, ...]:
        sizes = list(out_shape) + [r.size for r in red_dims]
        grain = list(sizes)
        for v, labels in lab.items():
            for lbl, size in zip(labels, self.p.shapes[v]):
                d = ls.lookup(lbl, iter_of)
                if d is not None and size > 1:
                    grain[d] = math.gcd(grain[d], size)
        for lbl, size in ls.grains.items():  # a grouped convolution's whole groups
            d = ls.lookup(lbl, iter_of)
            if d is not None:
                grain[d] = math.gcd(grain[d], size)
            # its channels reshaped into (groups, channels per group), as vmap's grouped
            # convolution of an ensemble's members is: the minor part would split every group
            for part in ls.parts_of(lbl)[1:] if size > 1 else ():
                dp = ls.lookup(part, iter_of)
                if dp is not None and dp != d:
                    grain[dp] = 1
        return () if grain == sizes else tuple(grain)

    def _reduction_role(self, ls, k, iter_of, inputs, lab) -> Role:
        for v in inputs:
            for d, x in enumerate(lab[v]):
                if ls.lookup(x, iter_of) == k and v in self.gl:
                    r = self.role(v, d)
                    return r if r != "-" else "A"
        return "A"

    def _source(self, v: int, g: int) -> tuple[OperandKind, str, int]:
        if v in self.param_of:
            return "param", self.param_of[v].path, 0
        if (leaf := self._param_leaf(v)) is not None:  # a layer's slice of a stacked parameter
            return "param", leaf.path + "".join(f"[{i}]" for i in self.p.slice_of[v][1]), 0
        if v in self.batch_of:
            return "batch", self.batch_of[v].path, 0
        if v in self.exported:
            return "activation", *self.exported[v]
        root = self.p.slice_of.get(v, (v,))[0]
        if root in self.exported:  # a layer's slice of a value stacked before the layer scan
            return "activation", *self.exported[root]
        return "const", f"const_{v}", 0


_INDEXED = re.compile(r"^(.*?)(\d+)$")


def mark_unrolled_layers(ops: list[Operator]) -> list[Operator]:
    """Gives the operators of identical unrolled layers a `block_position`, as a scan over
    layers gets one: a Python loop ``for i in range(n): x = Block(name=f"layers_{i}")(x)``
    (linen's auto names ``Block_0, Block_1``, nnx's ``layers/0, layers/1``) makes operators
    ``layers_3/mlp/fc1`` whose position is ``layers_*/mlp/fc1``.

    A family of layers is a name segment ``<stem><index>`` at one depth under one prefix; it
    counts as repeated when it has two or more indices and every operator name under it occurs
    at every index with the same anchor, iteration sizes and roles, and parameter and batch
    operands (the layers are the same computation). Activation operands may differ: a value
    built from iotas where the first layer reads it is computed inside that layer's operator
    and read by the later layers' (GPT-2's causal mask: layer 0's attention scores have two
    activation operands, the others three). The outermost such segment wins
    (``layers_2/Dense_0`` is a layer of ``layers_*``, not a family of its own). Operators that
    already have a position (a scan) keep it.
    """
    def signature(op: Operator) -> tuple:
        return (op.anchor, op.iteration_sizes, op.iteration_roles,
                tuple((x.kind, x.shape, x.dtype) for x in op.inputs if x.kind != "activation"))

    position = [op.block_position for op in ops]
    depth = 0
    while True:
        families: dict[tuple, dict[tuple, dict[int, int]]] = {}
        deeper = False
        for i, op in enumerate(ops):
            parts = op.name.split("/")
            if position[i] or len(parts) <= depth:
                continue
            deeper = True
            m = _INDEXED.match(parts[depth])
            if m is None:
                continue
            family = (tuple(parts[:depth]), m.group(1))
            rest = tuple(parts[depth + 1:])
            families.setdefault(family, {}).setdefault(rest, {})[int(m.group(2))] = i
        if not deeper:
            break
        for (prefix, stem), members in families.items():
            indices = {k for by_index in members.values() for k in by_index}
            if len(indices) < 2 or any(set(by_index) != indices for by_index in members.values()):
                continue
            if any(len({signature(ops[i]) for i in by_index.values()}) != 1
                   for by_index in members.values()):
                continue
            for rest, by_index in members.items():
                name = "/".join((*prefix, stem + "*", *rest))
                for i in by_index.values():
                    position[i] = name
        depth += 1
    return [op if op.block_position == p else dataclasses.replace(op, block_position=p)
            for op, p in zip(ops, position)]


# How a value depends on the batch, for `_Coupling`.
_CONST, _SAMPLE, _LINEAR = 0, 1, 2
# Reductions linear in what they reduce: a sum over samples is the sum of the microbatches'.
_LINEAR_REDUCTIONS = frozenset({"reduce_sum", "psum", "dot_general"})
# Equations that run along one axis of their operand (the parameter naming it): along the
# sample dim, a sample's result reads the samples before it (a cumulative sum) or all (a sort).
_ALONG_AXIS = {"cumsum": "axis", "cumprod": "axis", "cummax": "axis", "cummin": "axis",
               "cumlogsumexp": "axis", "sort": "dimension"}
# What keeps a value that is linear in the batch linear (with constants, or another such).
_LINEAR_OPS = frozenset({"add", "add_any", "sub", "neg", "convert_element_type", "reshape",
                         "broadcast_in_dim", "squeeze", "expand_dims", "copy", "copy_p",
                         "stop_gradient", "transpose", "mul", "div", "pjit", "jit"})


class _Coupling:
    """Whether the samples of a batch interact in the traced step: what microbatches need.

    Gradient accumulation over M microbatches computes the step's loss as the mean of the
    microbatches' losses, which is the whole batch's loss exactly when that loss is a sum over
    the samples, times a constant, of what each sample computes on its own. Every value is
    classed, in program order: *constant* (no batch in it), *per sample* (has the sample dim,
    or is computed from per-sample values and constants), *linear in the batch* (a sum over the
    sample dim, and sums, differences and constant multiples of such). The samples *interact*
    where a value linear in the batch meets a per-sample one (a batch norm's mean subtracted
    from each sample, a mixture of experts' capacity from a count of the batch's tokens), where
    two such values multiply or divide (a mean over the batch's unmasked tokens: a sum over a
    sum; a load-balancing loss: a mean times a mean), where a nonlinear function takes one (a
    square), where the sample dim is reduced other than by a sum (a max over the batch, a
    cumulative sum over its tokens), where a loop takes the batch in and gives no sample dim
    out, where a value holds two sample dims (pairs of samples: a contrastive loss's logits
    ``img @ txt.T``, distances between samples), where values move along the sample dim
    (`_moves_samples`: the batch reversed, shifted, permuted, sliced or padded, as mixup with
    a flipped batch does), so that a sample reads another's, or where a reshape groups the
    samples (`_groups_samples`: pairs of views side by side). `find` names the first such
    equation and its operator.
    """

    def __init__(self, builder: _Builder):
        self.b = builder

    def _per_sample(self, vid: int) -> bool:
        return any(self.b.role(vid, d) == "S" for d in range(len(self.b.p.shapes[vid])))

    def _pairs(self, vid: int) -> bool:
        """Whether value `vid` holds two sample dims (pairs of samples): of different labels
        (``img @ txt.T``) or of one (``a @ b.T`` with both towers fed the same images, whose
        sample dims the grouping joins)."""
        b = self.b
        return sum(b.role(vid, d) == "S" for d in range(len(b.p.shapes[vid]))) > 1

    def find(self) -> str:
        b, p = self.b, self.b.p
        state = {v: _SAMPLE for v in b.batch_of}
        for i, u in enumerate(p.units):
            ins = [state.get(v, _CONST) for v in u.ins]
            name = u.eqn.primitive.name
            outs = [v for v in u.outs if v is not None]
            if not any(ins):
                continue  # constants only
            why = ""
            if _LINEAR in ins:
                if _SAMPLE in ins:
                    why = "a statistic of the whole batch meets each sample"
                elif name not in _LINEAR_OPS:
                    why = f"{name} of a statistic of the whole batch"
                elif name in ("mul", "dot_general") and ins.count(_LINEAR) > 1:
                    why = "a product of two statistics of the whole batch"
                elif name == "div" and ins[1:] and ins[1] == _LINEAR:
                    why = "a division by a statistic of the whole batch"
                new = _LINEAR
            elif reads := self._reads_others(u, outs):
                why = f"{name} {reads}"
            elif all(self._per_sample(v) for v in outs):
                new = _SAMPLE
            elif name in _LINEAR_REDUCTIONS and self._sums_samples(u):
                new = _LINEAR
            else:
                why = (f"{name} over the sample dim" if name.startswith(("reduce_", "cum",
                                                                        "arg", "sort", "top_k"))
                       else f"{name} takes the batch in and gives no sample dim out")
            if why:
                return f"{why} ({name} in operator {self._operator_of(i)!r})"
            state.update((v, new) for v in outs)
        return ""

    def sums(self) -> tuple[int, ...] | None:
        """The sums over the sample dim that every statistic of the batch starts from (value
        ids of the reductions' results), where the samples interact through such sums only: a
        sum over a batch is the sum of its parts' sums, so a program run on a part of the
        batch computes the whole batch's statistics once these are summed across the parts
        (`soapjax.apply._pipelined`'s data groups). Every value without a sample dim that the
        batch reaches is a statistic, made from these sums, statistics and constants; a
        statistic may meet each sample. None where the batch is reduced some other way: a
        max, a sort or a cumulative sum over the samples, a loop that takes the batch in and
        gives no sample dim out."""
        p = self.b.p
        state = {v: _SAMPLE for v in self.b.batch_of}
        births: list[int] = []
        for u in p.units:
            ins = [state.get(v, _CONST) for v in u.ins]
            outs = [v for v in u.outs if v is not None]
            if not any(ins):
                continue  # constants only
            if self._reads_others(u, outs):
                return None  # a sample reads another's: no sum over the parts makes that
            if all(self._per_sample(v) for v in outs):
                new = _SAMPLE
            elif _SAMPLE not in ins:
                new = _LINEAR  # a statistic of statistics (and constants)
            elif (u.eqn.primitive.name in _LINEAR_REDUCTIONS and self._sums_samples(u)
                  and not any(self._per_sample(v) for v in outs)):
                births.extend(outs)
                new = _LINEAR
            else:
                return None
            state.update((v, new) for v in outs)
        return tuple(births)

    def _reads_others(self, u, outs: list[int]) -> str:
        """How equation `u` makes a sample read other samples' values (`find` and `sums` both
        ask), or '': a value over pairs of samples, values moved along the sample dim, the
        samples grouped by a reshape."""
        if any(self._pairs(v) for v in outs):
            return "gives a value over pairs of samples"
        if self._moves_samples(u):
            return "moves values along the sample dim or runs along it"
        if self._groups_samples(u):
            return "splits the sample dim into groups of samples"
        return ""

    def _moves_samples(self, u) -> bool:
        """Whether `u` moves values along a sample dim of its operand: reverses, slices, pads,
        concatenates along it, gathers or scatters by index along it (a sample then reads
        another sample's values: a batch flipped for mixup, shifted, permuted), or runs along
        it (a cumulative sum, a sort, a top-k, a window, an FFT over the samples)."""
        b, name, params = self.b, u.eqn.primitive.name, u.eqn.params
        if not u.ins or u.ins[0] not in b.gl:
            return False
        shape = b.p.shapes[u.ins[0]]
        if name == "rev":
            dims = tuple(params["dimensions"])
        elif name == "slice":
            strides = params["strides"] or (1,) * len(shape)
            dims = tuple(d for d, (lo, hi, st) in enumerate(zip(
                params["start_indices"], params["limit_indices"], strides))
                if lo != 0 or hi != shape[d] or st != 1)
        elif name == "dynamic_slice":
            dims = tuple(d for d, n in enumerate(params["slice_sizes"]) if n != shape[d])
        elif name == "pad":
            dims = tuple(d for d, (lo, hi, inner) in enumerate(params["padding_config"])
                         if lo or hi or inner)
        elif name == "concatenate":
            d = params["dimension"]
            return any(v in b.gl and b.role(v, d) == "S" for v in u.ins)
        elif name == "gather":
            dims = tuple(params["dimension_numbers"].start_index_map)
        elif name.startswith("scatter"):
            dims = tuple(params["dimension_numbers"].scatter_dims_to_operand_dims)
        elif name == "dynamic_update_slice":
            update = b.p.shapes[u.ins[1]] if len(u.ins) > 1 else shape
            dims = tuple(d for d, (n, m) in enumerate(zip(update, shape)) if n != m)
        elif name in _ALONG_AXIS:
            dims = (params[_ALONG_AXIS[name]],)
        elif name == "top_k":
            dims = (len(shape) - 1,)
        elif name.startswith("reduce_window"):
            dims = tuple(d for d, n in enumerate(params["window_dimensions"]) if n != 1)
        elif name == "fft":
            dims = tuple(_fft_axes(params, len(shape)))
        else:
            return False
        return any(b.role(u.ins[0], d) == "S" for d in dims)

    def _groups_samples(self, u) -> bool:
        """Whether `u` is a reshape that splits the sample dim into groups of samples
        (``[B, F] -> [B / 2, 2, F]``: two views of an image side by side, a batch of pairs):
        a sample dim of its result that is not a whole number of batches. Merging the samples
        with their tokens (``[B, T] -> [B * T]``) and splitting them out again keep whole
        samples. Apply's microbatches take every M-th sample, so a group would be split."""
        b = self.b
        if u.eqn.primitive.name != "reshape" or not u.outs or u.outs[0] is None:
            return False
        x, out = u.ins[0], u.outs[0]
        if x not in b.gl or not self._per_sample(x):
            return False
        size = self._batch_size()
        return any(n % size for d, n in enumerate(b.p.shapes[out]) if b.role(out, d) == "S")

    def _batch_size(self) -> int:
        """The batch's size (dim 0 of its leaves)."""
        return next((self.b.p.shapes[v][0] for v in self.b.batch_of), 1)

    def _sums_samples(self, u) -> bool:
        """Whether `u` (a linear reduction) sums over a sample dim of a per-sample operand."""
        name, params = u.eqn.primitive.name, u.eqn.params
        if name == "dot_general":
            (lc, rc), _ = params["dimension_numbers"]
            return any(self.b.role(u.ins[0], d) == "S" for d in lc) or \
                any(self.b.role(u.ins[1], d) == "S" for d in rc)
        axes = params.get("axes", ())
        return any(isinstance(d, int) and self.b.role(v, d) == "S"
                   for v in u.ins[:1] for d in axes) or name == "psum"

    def _operator_of(self, i: int) -> str:
        local = self.b.p.local
        return next((name for name, loc in local.items() if i in loc.units), "")
