"""Workload: a model, its loss, its optimizer and its synthetic batches, as one frozen record.

A `Workload` is what the rest of soapjax plans for: a pure `loss_fn(params, batch)`, the
`init_params` and `make_batch` that produce its arguments, and the optax optimizer of the
training step. `summarize` reads its size and cost without allocating a single parameter, so it
is safe on the full-size configs (GPT-2 small, ResNet-101, ...).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import flax.linen as nn
import jax
import jax.extend
import jax.numpy as jnp
import optax
from flax import nnx
from jax.extend import core as jcore

from soapjax.base.errors import SoapjaxError

Family = Literal["cnn", "rnn", "transformer", "mlp"]
Api = Literal["linen", "nnx"]
Batch = dict[str, jax.Array]
TrainStep = Callable[[Any, Any, Batch], tuple[Any, Any, jax.Array]]


class ModelConfigError(SoapjaxError, ValueError):
    """A model config whose values do not fit together (e.g. heads that do not divide d_model)."""


@dataclasses.dataclass(frozen=True)
class Workload:
    """One training workload: model, loss, optimizer and synthetic data, all pure functions.

    Attributes:
      name: registry name, e.g. ``"gpt2"``.
      config: config name, e.g. ``"default"`` or ``"tiny"``.
      api: ``"linen"`` or ``"nnx"``.
      family: ``"cnn"``, ``"rnn"``, ``"transformer"`` or ``"mlp"``; the expert strategies use it.
        None for user code (`soapjax_zoo.load`): both experts are tried.
      description: one line.
      batch_size: samples per step; dim 0 of every leaf of a batch.
      loss_fn: ``loss_fn(params, batch) -> scalar``; pure, differentiable in ``params``.
      init_params: ``init_params(rng) -> params``; only the trained parameters.
      make_batch: ``make_batch(rng) -> dict[str, jax.Array]``; synthetic, right shapes and dtypes.
      optimizer: the optax transformation of the training step.
      has_aux: ``loss_fn`` returns ``(loss, aux)`` (user code whose loss returns metrics or
        batch statistics beside it, `soapjax_zoo.user`); traced with ``has_aux=True``.

    Example::

      w = zoo.get("mlp", "tiny")
      params = w.init_params(jax.random.key(0))
      opt_state = w.optimizer.init(params)
      params, opt_state, loss = jax.jit(w.train_step())(
          params, opt_state, w.make_batch(jax.random.key(1)))
    """

    name: str
    config: str
    api: Api
    family: Family | None
    description: str
    batch_size: int
    loss_fn: Callable[[Any, Batch], jax.Array]
    init_params: Callable[[jax.Array], Any]
    make_batch: Callable[[jax.Array], Batch]
    optimizer: optax.GradientTransformation
    has_aux: bool = False

    def abstract_params(self) -> Any:
        """The parameters as `jax.ShapeDtypeStruct`s, traced with `jax.eval_shape` (no memory)."""
        return jax.eval_shape(self.init_params, jax.random.key(0))

    def abstract_batch(self) -> dict[str, jax.ShapeDtypeStruct]:
        """One batch as `jax.ShapeDtypeStruct`s (no memory)."""
        return jax.eval_shape(self.make_batch, jax.random.key(0))

    def abstract_opt_state(self) -> Any:
        """The optimizer state of `abstract_params` as `jax.ShapeDtypeStruct`s (no memory)."""
        return jax.eval_shape(self.optimizer.init, self.abstract_params())

    def train_step(self) -> TrainStep:
        """Returns the pure step ``step(params, opt_state, batch) -> (params, opt_state, loss)``
        (``loss`` is ``(loss, aux)`` with `has_aux`).

        It is `jax.value_and_grad` of `loss_fn`, then `optimizer.update` and
        `optax.apply_updates`; not jitted, so callers can trace or shard it as they like.
        """
        loss_fn, optimizer = self.loss_fn, self.optimizer

        def step(params: Any, opt_state: Any, batch: Batch) -> tuple[Any, Any, jax.Array]:
            loss, grads = jax.value_and_grad(loss_fn, has_aux=self.has_aux)(params, batch)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        return step


@dataclasses.dataclass(frozen=True)
class ModelSummary:
    """Size and cost of one workload, read from abstract values.

    Attributes:
      name: registry name.
      config: config name.
      api: ``"linen"`` or ``"nnx"``.
      family: model family.
      param_count: number of trained parameters (scalars).
      param_bytes: their size in bytes.
      flops_per_step: XLA's count for one whole training step (forward, backward and optimizer
        update), from ``jax.jit(step).lower(...).cost_analysis()["flops"]``. XLA counts the body
        of a loop once, whatever its trip count, so steps containing `lax.scan` (the LSTMs) are
        lowered with every scan fully unrolled first; the count then covers every time step.
      batch_size: samples per step.
      description: one line.
    """

    name: str
    config: str
    api: str
    family: str
    param_count: int
    param_bytes: int
    flops_per_step: float
    batch_size: int
    description: str


def summarize(w: Workload) -> ModelSummary:
    """Counts the parameters and the FLOPs of one training step of `w`, allocating nothing.

    Args:
      w: the workload.

    Returns:
      Its `ModelSummary`. Everything is traced from `jax.ShapeDtypeStruct`s, so this is cheap
      even for the full-size configs.
    """
    params = w.abstract_params()
    leaves = jax.tree.leaves(params)
    return ModelSummary(
        name=w.name,
        config=w.config,
        api=w.api,
        family=w.family,
        param_count=sum(math.prod(x.shape) for x in leaves),
        param_bytes=sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in leaves),
        flops_per_step=step_flops(
            w.train_step(), params, jax.eval_shape(w.optimizer.init, params), w.abstract_batch()
        ),
        batch_size=w.batch_size,
        description=w.description,
    )


def step_flops(step: Callable[..., Any], *args: Any) -> float:
    """XLA's FLOP count of ``step(*args)``, with every `lax.scan` counted at its full length.

    Args:
      step: the function to cost.
      *args: its arguments; `jax.ShapeDtypeStruct`s are enough.

    Returns:
      ``cost_analysis()["flops"]`` of the lowered computation. When the traced step contains
      scans, it is re-evaluated from its jaxpr with ``unroll=length`` on every scan, because
      XLA's cost analysis counts a while loop's body once. Scans nested inside a scan body stay
      loops (no model here has them).
    """
    closed = jax.make_jaxpr(step)(*args)
    if not _has_scan(closed.jaxpr):
        return _lowered_flops(jax.jit(step).lower(*args))
    flat_args = jax.tree.leaves(args)

    def unrolled(*flat: Any) -> list[Any]:
        return _eval_unrolled(closed.jaxpr, closed.consts, flat)

    return _lowered_flops(jax.jit(unrolled).lower(*flat_args))


def _lowered_flops(lowered: Any) -> float:
    analysis = lowered.cost_analysis()
    if isinstance(analysis, Sequence):  # older jax returned one dict per device
        analysis = analysis[0]
    return float(analysis["flops"])


def _sub_jaxprs(eqn: jcore.JaxprEqn) -> list[jcore.Jaxpr]:
    found = []
    for value in eqn.params.values():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(v, jcore.ClosedJaxpr):
                found.append(v.jaxpr)
            elif isinstance(v, jcore.Jaxpr):
                found.append(v)
    return found


def _has_scan(jaxpr: jcore.Jaxpr) -> bool:
    return any(
        eqn.primitive.name == "scan" or any(_has_scan(j) for j in _sub_jaxprs(eqn))
        for eqn in jaxpr.eqns
    )


def _eval_unrolled(jaxpr: jcore.Jaxpr, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
    """`jax.core.eval_jaxpr`, inlining `jit` equations and binding each scan fully unrolled."""
    env: dict[jcore.Var, Any] = {}

    def read(v: Any) -> Any:
        return v.val if isinstance(v, jcore.Literal) else env[v]

    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        if eqn.primitive.name == "jit":
            inner = eqn.params["jaxpr"]
            outs = _eval_unrolled(inner.jaxpr, inner.consts, invals)
        else:
            params = dict(eqn.params)
            if eqn.primitive.name == "scan":
                params["unroll"] = max(1, params["length"])
            bind_params = eqn.primitive.get_bind_params(params)
            if isinstance(bind_params, tuple):  # jax < 0.10 returned (subfuns, params)
                subfuns, bind_params = bind_params
                invals = [*subfuns, *invals]
            with eqn.ctx.manager:
                ans = eqn.primitive.bind(*invals, **bind_params)
            outs = ans if eqn.primitive.multiple_results else [ans]
        for v, out in zip(eqn.outvars, outs):
            if not isinstance(v, jcore.DropVar):
                env[v] = out
    return [read(v) for v in jaxpr.outvars]


# Shared pieces of the model modules.


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean softmax cross entropy over every position, with integer labels."""
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def sgd_momentum(
    learning_rate: float, momentum: float = 0.9, weight_decay: float = 0.0
) -> optax.GradientTransformation:
    """SGD with momentum and L2 weight decay, as the CNN papers trained."""
    return optax.chain(
        optax.add_decayed_weights(weight_decay), optax.sgd(learning_rate, momentum=momentum)
    )


def adam_clipped(learning_rate: float, max_norm: float) -> optax.GradientTransformation:
    """Adam after clipping the global gradient norm, the usual recipe for LSTMs."""
    return optax.chain(optax.clip_by_global_norm(max_norm), optax.adam(learning_rate))


def adamw_clipped(
    learning_rate: float, weight_decay: float, max_norm: float
) -> optax.GradientTransformation:
    """AdamW (beta2 0.95) after clipping the global gradient norm, as Megatron-LM and LLaMA
    train; weight decay on kernels and embeddings only (`decay_mask`)."""
    return optax.chain(
        optax.clip_by_global_norm(max_norm),
        optax.adamw(learning_rate, b1=0.9, b2=0.95, weight_decay=weight_decay, mask=decay_mask),
    )


def decay_mask(params: Any) -> Any:
    """True on leaves named ``kernel`` or ``embedding``: by name, not rank, since a scan over
    layers stacks biases and norm scales into matrices."""

    def decays(path: tuple, _: Any) -> bool:
        last = path[-1] if path else None
        return getattr(last, "key", getattr(last, "name", None)) in ("kernel", "embedding")

    return jax.tree_util.tree_map_with_path(decays, params)


# How a decoder's attention runs (GPTConfig.attention, LlamaConfig.attention): XLA's (scores in
# memory), `soapjax.base.attention.flash_attention` blockwise, or cuDNN's fused kernel on a GPU.
ATTENTION_KINDS = ("xla", "flash", "cudnn")


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                     dropout: Callable[[jax.Array], jax.Array] | None = None) -> jax.Array:
    """``softmax(q k^T / sqrt(H), causal) v`` over ``[B, T, N, H]`` (k and v with as many heads
    as q): both products in q's dtype, the softmax in float32 (or wider), as Megatron-LM's
    kernels compute it; `dropout`, where given, applied to the ``[B, N, T, S]`` probabilities
    (in v's dtype) before they weigh the values, as Megatron-LM's attention dropout."""
    scores = jnp.einsum("BTNH,BSNH->BNTS", q, k) / jnp.sqrt(q.shape[-1]).astype(q.dtype)
    scores = scores.astype(jnp.promote_types(scores.dtype, jnp.float32))
    length = q.shape[1]
    causal = jnp.arange(length)[:, None] >= jnp.arange(length)[None, :]  # [T, S]
    scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    if dropout is not None:
        probs = dropout(probs)
    return jnp.einsum("BNTS,BSNH->BTNH", probs, v)


def mix32(x: jax.Array, salt: int = 0) -> jax.Array:
    """A bijective avalanche hash of uint32 words (``x ^ salt``, then Wellons' "lowbias32":
    xorshift-multiply rounds in which every input bit flips each output bit with probability
    about 1/2): stream and counter mixing for `dropout`, in elementwise integer ops only."""
    x = x ^ jnp.uint32(salt)
    x = x ^ (x >> jnp.uint32(16))
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> jnp.uint32(15))
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> jnp.uint32(16))


def dropout(x: jax.Array, seeds: jax.Array, rate: float) -> jax.Array:
    """Inverted dropout of ``x`` (``[B, ...]``), with one uint32 stream per sample.

    Element ``i`` (its flat index within its sample) of sample ``b`` is zeroed where
    ``mix32(mix32(i) ^ seeds[b]) < rate * 2**32``, the others scaled by ``1 / (1 - rate)``, as
    Megatron-LM's (and PyTorch's) dropout. The mask is a pure elementwise function of the
    sample's seed and the element's position: no `jax.random` primitive is drawn, so it is
    the same mask whatever the sharding (every dim, batch included), however the batch is cut
    into microbatches or pipeline stages, and whichever device computes it; soapjax sees
    elementwise operators it can split freely.

    Args:
      x: the activations, samples on dim 0.
      seeds: ``[B]`` uint32, one per sample (a stream already salted for this site: `mix32`).
      rate: the probability of dropping an element, in [0, 1).

    Returns:
      ``x`` with dropped elements zeroed and the kept ones scaled, in x's dtype.
    """
    if rate == 0.0:
        return x
    index = jnp.zeros(x.shape, jnp.uint32)
    stride = 1
    for d in reversed(range(1, x.ndim)):  # the flat index within a sample (wraps past 2**32)
        index = index + jax.lax.broadcasted_iota(jnp.uint32, x.shape, d) * jnp.uint32(stride)
        stride = stride * x.shape[d] % 2**32
    words = mix32(mix32(index) ^ seeds.reshape((-1,) + (1,) * (x.ndim - 1)))
    keep = words >= jnp.uint32(min(round(rate * 2**32), 2**32 - 1))
    return jnp.where(keep, x * jnp.asarray(1 / (1 - rate), x.dtype), jnp.zeros((), x.dtype))


def next_token_batch(rng: jax.Array, batch_size: int, seq_len: int, vocab_size: int) -> Batch:
    """Random token streams: ``inputs`` and the ``targets`` one position ahead, int32."""
    stream = jax.random.randint(rng, (batch_size, seq_len + 1), 0, vocab_size, dtype=jnp.int32)
    return {"inputs": stream[:, :-1], "targets": stream[:, 1:]}


def decoder_workload(name: str, config: str, cfg: Any, module: Any,
                     description: str) -> Workload:
    """A decoder language model's workload (GPT, LLaMA): next-token prediction on random
    streams, AdamW (beta2 0.95) after clipping; `cfg` holds batch_size, seq_len, vocab_size,
    learning_rate, weight_decay and max_grad_norm. Where it also holds a nonzero ``dropout``
    (GPT), each batch carries ``dropout_seed`` (`dropout_seeds`: one uint32 per sequence), the
    module's second input: a new batch draws new masks, and the loss stays a pure function of
    (params, batch)."""

    rate = getattr(cfg, "dropout", 0.0)

    def make_batch(rng: jax.Array) -> Batch:
        batch = next_token_batch(rng, cfg.batch_size, cfg.seq_len, cfg.vocab_size)
        if rate:
            batch["dropout_seed"] = dropout_seeds(rng, cfg.batch_size)
        return batch

    return linen_workload(
        name=name, config=config, family="transformer", description=description,
        module=module, make_batch=make_batch,
        inputs=("inputs", "dropout_seed") if rate else ("inputs",), label="targets",
        optimizer=adamw_clipped(cfg.learning_rate, cfg.weight_decay, cfg.max_grad_norm))


def dropout_seeds(rng: jax.Array, batch_size: int) -> jax.Array:
    """``[batch_size]`` uint32 dropout seeds, one per sample, drawn with a key folded from
    `rng` (the token streams' draws from `rng` itself are unchanged)."""
    return jax.random.bits(jax.random.fold_in(rng, 1), (batch_size,), jnp.uint32)


def linen_workload(
    *,
    name: str,
    config: str,
    family: Family,
    description: str,
    module: nn.Module,
    make_batch: Callable[[jax.Array], Batch],
    inputs: Sequence[str],
    label: str,
    optimizer: optax.GradientTransformation,
    batch_stats: bool = False,
) -> Workload:
    """A `Workload` for a linen module trained with softmax cross entropy.

    Args:
      name: registry name.
      config: config name.
      family: model family.
      description: one line.
      module: the linen module; ``module.apply(params, *[batch[k] for k in inputs])`` gives logits.
      make_batch: ``make_batch(rng) -> batch``.
      inputs: the batch keys passed to the module, in order.
      label: the batch key of the integer labels.
      optimizer: the optax optimizer.
      batch_stats: the module has BatchNorm layers in training mode. They normalise with the
        statistics of the current batch; the running averages they also write (the
        ``batch_stats`` collection) are created inside the loss and dropped, so they are not
        part of ``params``, which stays the trained parameters only (``{"params": ...}``).

    Returns:
      The workload. Its params are ``{"params": {...}}``, linen's own variable layout.
    """
    mutable = ["batch_stats"] if batch_stats else False
    example = _example_inputs(make_batch, inputs)

    def init_params(rng: jax.Array) -> dict[str, Any]:
        variables = module.init(rng, *example())
        return {"params": variables["params"]}

    def loss_fn(params: Mapping[str, Any], batch: Batch) -> jax.Array:
        out = module.apply(params, *(batch[k] for k in inputs), mutable=mutable)
        logits = out[0] if batch_stats else out
        return cross_entropy(logits, batch[label])

    return Workload(
        name=name,
        config=config,
        api="linen",
        family=family,
        description=description,
        batch_size=_batch_size(make_batch),
        loss_fn=loss_fn,
        init_params=jax.jit(init_params),
        make_batch=jax.jit(make_batch),
        optimizer=optimizer,
    )


def nnx_workload(
    *,
    name: str,
    config: str,
    family: Family,
    description: str,
    make_model: Callable[[nnx.Rngs], nnx.Module],
    make_batch: Callable[[jax.Array], Batch],
    inputs: Sequence[str],
    label: str,
    optimizer: optax.GradientTransformation,
) -> Workload:
    """A `Workload` for an nnx module trained with softmax cross entropy.

    Its params are the `nnx.State` of the module's `nnx.Param`s, as
    ``graphdef, params = nnx.split(model, nnx.Param)`` gives them; their paths are the
    attribute paths (``params["fc1"]["kernel"]``). The loss is pure:
    ``nnx.merge(graphdef, params)`` rebuilds the module inside it, with the graphdef taken once
    from an abstract model (`nnx.eval_shape`), so nothing is allocated here.

    Args:
      name: registry name.
      config: config name.
      family: model family.
      description: one line.
      make_model: builds the module from its `nnx.Rngs`; it must hold no state but `nnx.Param`s.
      make_batch: ``make_batch(rng) -> batch``.
      inputs: the batch keys passed to the module, in order.
      label: the batch key of the integer labels.
      optimizer: the optax optimizer.

    Returns:
      The workload.
    """
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: make_model(nnx.Rngs(0))), nnx.Param)

    def init_params(rng: jax.Array) -> nnx.State:
        return nnx.split(make_model(nnx.Rngs(params=rng)), nnx.Param)[1]

    def loss_fn(params: nnx.State, batch: Batch) -> jax.Array:
        model = nnx.merge(graphdef, params)
        return cross_entropy(model(*(batch[k] for k in inputs)), batch[label])

    return Workload(
        name=name,
        config=config,
        api="nnx",
        family=family,
        description=description,
        batch_size=_batch_size(make_batch),
        loss_fn=loss_fn,
        init_params=jax.jit(init_params),
        make_batch=jax.jit(make_batch),
        optimizer=optimizer,
    )


def _batch_size(make_batch: Callable[[jax.Array], Batch]) -> int:
    sizes = {x.shape[0] for x in jax.tree.leaves(jax.eval_shape(make_batch, jax.random.key(0)))}
    assert len(sizes) == 1, f"batch leaves disagree on dim 0: {sizes}"
    return sizes.pop()


def _example_inputs(
    make_batch: Callable[[jax.Array], Batch], inputs: Sequence[str]
) -> Callable[[], list[jax.Array]]:
    """Zeros shaped like one sample of each input, for `init` (parameter shapes ignore batch)."""
    shapes = jax.eval_shape(make_batch, jax.random.key(0))
    return lambda: [jnp.zeros((1, *shapes[k].shape[1:]), shapes[k].dtype) for k in inputs]
