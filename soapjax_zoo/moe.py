"""MoE: a decoder-only mixture-of-experts language model, GShard/Switch style, in linen.

Each layer: RMSNorm, LLaMA's grouped-query attention with rotary embeddings
(`soapjax_zoo.llama.Attention`), RMSNorm, and a mixture-of-experts SwiGLU FFN written the way
GShard (Lepikhin et al. 2020) and Switch Transformer (Fedus et al. 2021) write it, with einsums
over an expert dim ``E``:

* the router (``moe/router``, float32 or wider) gives each token a softmax over the experts;
  ``jax.lax.top_k`` picks its ``k`` experts and their gates (renormalised over the ``k`` when
  ``k > 1``, as Mixtral does);
* each sequence is a group (GShard's ``G``) whose experts take at most ``C = ceil(capacity_factor
  * tokens * k / experts)`` tokens each: a token's place in an expert's buffer is a cumsum over
  the one-hot assignments (every token's first choice before any token's second), and choices
  past ``C`` are dropped (the token passes by the residual alone);
* the dispatch tensor ``[B, T, E, C]`` (one-hot) moves tokens into the experts' buffers
  ``[E, B, C, d]`` (``einsum("BTEC,BTd->EBCd")``); the experts' stacked SwiGLU weights
  ``[E, d, ffn]`` and ``[E, ffn, d]`` (``moe/experts/gate``, ``up``, ``down``) apply each
  expert to its own buffer; the combine tensor (dispatch times gates) brings the results back;
* optionally, a shared expert (a dense SwiGLU every token passes through, ``moe/shared``).

With ``routing="dropless"`` the same layer is written the way MaxText's "megablox" path and
MegaBlocks (Gale et al. 2023) write it, with no capacity and no dropped token: the ``B * T * k``
choices are sorted by expert (``jnp.argsort``, stable), the tokens gathered into that order
(``[B*T*k, d]``), each expert's share counted (``jnp.bincount``: the group sizes), and the
stacked SwiGLU weights ``[E, d, ffn]`` applied group by group by a grouped matmul
(``jax.lax.ragged_dot``); the results are gathered back into token order (the inverse
permutation, ``argsort`` of the sort order), weighted by the gates and summed over the ``k``.
The sort is over the whole batch, as the code says: under GSPMD each device sees the global
order, so what soapjax plans for this form is the expert FFN's ffn dim (Megatron) and ZeRO
sharding of the weights, never the ragged rows or the expert dim (soapjax.graph._dims says why).

Switch's load-balancing loss ``experts * sum_e(fraction of choices routed to e * mean router
probability of e)`` (1 when the load is uniform), summed over layers and weighted by
``aux_loss_coef``, is added to the next-token cross entropy.

The expert dim of the stacked weights and of the dispatched tokens is what expert parallelism
splits (docs/design.md: an expert dim split over a mesh axis, the tokens moved by all-to-all).

Sizes: ``mixtral-8x7b`` and ``mixtral-8x22b`` have Mixtral's released shapes (Jiang et al.
2024; the configs of mistralai/Mixtral-8x7B-v0.1 and Mixtral-8x22B-v0.1) at 4096 tokens:
46,702,792,704 and 140,630,071,296 parameters. ``fine-grained`` is a fine-grained MoE with the
shape of Qwen3-30B-A3B (hidden 2048, 48 layers, 128 experts, top-8, expert FFN 768, vocabulary
151936; 16 heads of 128 here, where Qwen3 has 32 query heads of 128 over hidden 2048) plus
one shared expert of the routed experts' width, as DeepSeekMoE (Dai et al. 2024) adds.
Capacity factor 1.25 at every real size (Switch's training default). bfloat16 arithmetic over
float32 parameters; the router and the logits in float32.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Literal, get_args

import flax.linen as nn
import jax
import jax.numpy as jnp

from soapjax_zoo.llama import MLP, Attention, check_heads
from soapjax_zoo.workload import (
    Batch,
    ModelConfigError,
    Workload,
    adamw_clipped,
    cross_entropy,
    next_token_batch,
)

Routing = Literal["capacity", "dropless"]
ROUTINGS: tuple[Routing, ...] = get_args(Routing)


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """MoE hyper-parameters; the default is Mixtral 8x7B.

    Attributes:
      num_experts: routed experts per layer; top_k: experts per token.
      expert_hidden: each expert's SwiGLU width.
      capacity_factor: an expert's buffer holds ``capacity_factor * tokens * top_k /
        num_experts`` tokens of a sequence (rounded up); below 1, tokens are always dropped.
        Unused by dropless routing.
      routing: ``"capacity"`` (GShard's dispatch and combine einsums over ``[E, B, C, d]``
        buffers) or ``"dropless"`` (tokens sorted by expert, a grouped matmul,
        ``jax.lax.ragged_dot``; no token dropped).
      shared_hidden: the shared expert's SwiGLU width (0: none).
      aux_loss_coef: the load-balancing loss's weight in the training loss.
      dtype: what the layers compute in (None: the parameters' dtype, as the tiny config, so
        that float64 tests compute in float64); param_dtype: what parameters are stored in.
    """

    batch_size: int = 8
    seq_len: int = 4096
    vocab_size: int = 32000
    num_layers: int = 32
    num_heads: int = 32
    num_kv_heads: int = 8
    d_model: int = 4096
    num_experts: int = 8
    top_k: int = 2
    expert_hidden: int = 14336
    capacity_factor: float = 1.25
    shared_hidden: int = 0
    aux_loss_coef: float = 0.01
    rope_base: float = 1e6
    dtype: str | None = "bfloat16"
    param_dtype: str = "float32"
    learning_rate: float = 3e-4
    weight_decay: float = 0.1
    max_grad_norm: float = 1.0
    routing: Routing = "capacity"

    def __post_init__(self) -> None:
        check_heads(self.d_model, self.num_heads, self.num_kv_heads)
        if self.routing not in ROUTINGS:
            raise ModelConfigError(f"routing {self.routing!r}: expected one of {ROUTINGS}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ModelConfigError(f"top_k {self.top_k} must be between 1 and num_experts "
                                   f"{self.num_experts}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    @property
    def capacity(self) -> int:
        """Tokens an expert takes from one sequence: ``ceil(factor * T * k / E)``."""
        return math.ceil(self.capacity_factor * self.seq_len * self.top_k / self.num_experts)


_init = nn.initializers.normal(stddev=0.02)


def route(gates: jax.Array, chosen: jax.Array, experts: int,
          capacity: int) -> tuple[jax.Array, jax.Array]:
    """GShard's dispatch and combine tensors from the router's top-k choices.

    Args:
      gates: ``[B, T, k]``, each token's weights for its k experts.
      chosen: ``[B, T, k]`` int, the experts, best first (``jax.lax.top_k`` of the router's
        probabilities).
      experts: how many there are (``E``).
      capacity: buffer slots per expert and sequence (``C``).

    Returns:
      ``(dispatch, combine)``, both ``[B, T, E, C]`` in `gates`' dtype: ``dispatch[b, t, e, c]``
      is 1 where token t of sequence b takes slot c of expert e; ``combine`` is it times the
      token's gate for e. A choice that finds its expert's ``C`` slots taken by tokens before
      it (every first choice comes before any second) is dropped: zero in both.

    Example: one sequence of 3 tokens, 2 experts, top-1, capacity 1; tokens 0 and 1 both pick
    expert 0, so token 1 is dropped::

      chosen = [[[0], [0], [1]]]
      dispatch[0, :, :, 0] == [[1, 0], [0, 0], [0, 1]]
    """
    batch, length, top_k = chosen.shape
    choice = jax.nn.one_hot(chosen, experts, dtype=jnp.int32)  # [B, T, k, E]
    # every token's first choice before any token's second: cumsum over (k, T), k major
    order = choice.transpose(0, 2, 1, 3).reshape(batch, top_k * length, experts)
    before = jnp.cumsum(order, axis=1) - order  # choices of e ahead of this one
    before = before.reshape(batch, top_k, length, experts).transpose(0, 2, 1, 3)
    position = jnp.sum(before * choice, axis=-1)  # [B, T, k]: its slot in its expert's buffer
    kept = (choice * (position < capacity)[..., None]).astype(gates.dtype)  # [B, T, k, E]
    slot = jax.nn.one_hot(position, capacity, dtype=gates.dtype)  # [B, T, k, C]
    dispatch = jnp.einsum("BTKE,BTKC->BTEC", kept, slot)
    combine = jnp.einsum("BTKE,BTKC,BTK->BTEC", kept, slot, gates)
    return dispatch, combine


def sort_by_expert(chosen: jax.Array, experts: int) -> tuple[jax.Array, jax.Array]:
    """The choices ``chosen [B, T, k]`` in expert order, for a grouped matmul.

    Returns:
      ``(order, group_sizes)``: ``order [B*T*k]`` the flat choices' indices sorted by expert
      (stable: within an expert, in token order), so that ``order // k`` are the tokens the
      sorted rows read; ``group_sizes [E]`` how many rows each expert takes (they sum to
      ``B*T*k``: no choice is dropped).

    Example: 3 tokens, top-1, 2 experts; tokens 0 and 2 pick expert 1::

      chosen = [[[1], [0], [1]]]
      order == [1, 0, 2], group_sizes == [1, 2]
    """
    flat = chosen.reshape(-1)
    return jnp.argsort(flat, stable=True), jnp.bincount(flat, length=experts)


def unsort(rows: jax.Array, order: jax.Array, gates: jax.Array) -> jax.Array:
    """The experts' results ``rows [B*T*k, d]``, in the order `sort_by_expert` gave, back in
    token order, weighted by ``gates [B, T, k]`` and summed over the k: ``[B, T, d]``."""
    batch, length, top_k = gates.shape
    rows = jnp.take(rows, jnp.argsort(order), axis=0)  # the inverse permutation
    rows = rows.reshape(batch, length, top_k, rows.shape[-1])
    return jnp.einsum("BTKD,BTK->BTD", rows, gates.astype(rows.dtype))


def load_balancing_loss(probs: jax.Array, chosen: jax.Array) -> jax.Array:
    """Switch's auxiliary loss over ``probs [B, T, E]`` and the top-k ``chosen [B, T, k]``:
    ``E * sum_e f_e * P_e``, with ``f_e`` the fraction of the tokens' choices that pick e
    (before capacity drops) and ``P_e`` the mean probability the router gives e; 1 when both
    are uniform."""
    experts = probs.shape[-1]
    fraction = jax.nn.one_hot(chosen, experts, dtype=probs.dtype).mean(axis=(0, 1, 2))
    return experts * jnp.sum(fraction * probs.mean(axis=(0, 1)))


class ExpertDense(nn.Module):
    """``E`` stacked kernels ``[E, in, out]``, each applied to its own expert's buffer
    ``[E, B, C, in]``."""

    features: int
    dtype: str | None
    param_dtype: str

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = self.param("kernel", _init, (x.shape[0], x.shape[-1], self.features),
                            self.param_dtype)
        x, kernel = nn.dtypes.promote_dtype(x, kernel, dtype=self.dtype)
        return jnp.einsum("EBCD,EDF->EBCF", x, kernel)


class RaggedDense(nn.Module):
    """``E`` stacked kernels ``[E, in, out]`` over rows sorted by expert ``[rows, in]``: the
    first ``group_sizes[0]`` rows through kernel 0, the next ``group_sizes[1]`` through kernel
    1, ... (``jax.lax.ragged_dot``)."""

    experts: int
    features: int
    dtype: str | None
    param_dtype: str

    @nn.compact
    def __call__(self, x: jax.Array, group_sizes: jax.Array) -> jax.Array:
        kernel = self.param("kernel", _init, (self.experts, x.shape[-1], self.features),
                            self.param_dtype)
        x, kernel = nn.dtypes.promote_dtype(x, kernel, dtype=self.dtype)
        return jax.lax.ragged_dot(x, kernel, group_sizes)


class RaggedExperts(nn.Module):
    """The experts' SwiGLU over rows sorted by expert ``[rows, d]``: the same parameters as
    `Experts` (``gate``, ``up``, ``down``), applied by grouped matmuls."""

    config: MoEConfig

    @nn.compact
    def __call__(self, x: jax.Array, group_sizes: jax.Array) -> jax.Array:
        cfg = self.config
        dense = functools.partial(RaggedDense, cfg.num_experts, dtype=cfg.dtype,
                                  param_dtype=cfg.param_dtype)
        h = (nn.silu(dense(cfg.expert_hidden, name="gate")(x, group_sizes))
             * dense(cfg.expert_hidden, name="up")(x, group_sizes))
        return dense(cfg.d_model, name="down")(h, group_sizes)


class Experts(nn.Module):
    """The experts' SwiGLU, ``down(silu(gate(x)) * up(x))`` per expert, over ``[E, B, C, d]``."""

    config: MoEConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        dense = functools.partial(ExpertDense, dtype=cfg.dtype, param_dtype=cfg.param_dtype)
        h = (nn.silu(dense(cfg.expert_hidden, name="gate")(x))
             * dense(cfg.expert_hidden, name="up")(x))
        return dense(cfg.d_model, name="down")(h)


class MoE(nn.Module):
    """Router, dispatch, experts, combine (and the shared expert): ``x [B, T, d] -> (y, aux)``,
    aux the layer's load-balancing loss."""

    config: MoEConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        cfg = self.config
        wide = jnp.promote_types(x.dtype, jnp.float32)  # the router: float32, or float64
        logits = nn.Dense(cfg.num_experts, use_bias=False, kernel_init=_init, dtype=wide,
                          param_dtype=cfg.param_dtype, name="router")(x)
        probs = jax.nn.softmax(logits, axis=-1)
        gates, chosen = jax.lax.top_k(probs, cfg.top_k)  # [B, T, k]
        if cfg.top_k > 1:  # Mixtral's gates: the softmax over the chosen k
            gates = gates / gates.sum(axis=-1, keepdims=True)
        if cfg.routing == "dropless":  # every choice computed, in expert order
            order, group_sizes = sort_by_expert(chosen, cfg.num_experts)
            rows = jnp.take(x.reshape(-1, x.shape[-1]), order // cfg.top_k, axis=0)
            out = RaggedExperts(cfg, name="experts")(rows, group_sizes)  # [B*T*k, d]
            y = unsort(out, order, gates)
        else:
            dispatch, combine = route(gates, chosen, cfg.num_experts, cfg.capacity)
            buffers = jnp.einsum("BTEC,BTD->EBCD", dispatch.astype(x.dtype), x)
            out = Experts(cfg, name="experts")(buffers)
            y = jnp.einsum("BTEC,EBCD->BTD", combine.astype(out.dtype), out)
        if cfg.shared_hidden:
            y = y + MLP(cfg, hidden=cfg.shared_hidden, name="shared")(x)
        return y, load_balancing_loss(probs, chosen)


class Block(nn.Module):
    """One pre-RMSNorm MoE decoder layer; ``(x, None) -> (x, aux)`` as `nn.scan` wants."""

    config: MoEConfig

    @nn.compact
    def __call__(self, x: jax.Array, _: None) -> tuple[jax.Array, jax.Array]:
        cfg = self.config
        norm = functools.partial(nn.RMSNorm, epsilon=1e-5, dtype=cfg.dtype,
                                 param_dtype=cfg.param_dtype)
        x = x + Attention(cfg, name="attn")(norm(name="attn_norm")(x))
        y, aux = MoE(cfg, name="moe")(norm(name="moe_norm")(x))
        return x + y, aux


class MoEDecoder(nn.Module):
    """Token embedding, scanned ``layers``, final RMSNorm, untied ``lm_head``:
    ``tokens -> (logits, aux)``, aux the load-balancing loss summed over layers."""

    config: MoEConfig

    @nn.compact
    def __call__(self, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
        cfg = self.config
        kw = {"dtype": cfg.dtype, "param_dtype": cfg.param_dtype}
        x = nn.Embed(cfg.vocab_size, cfg.d_model, embedding_init=_init, name="embed",
                     **kw)(tokens)
        layers = nn.scan(
            Block, variable_axes={"params": 0}, split_rngs={"params": True},
            length=cfg.num_layers,
        )
        x, aux = layers(cfg, name="layers")(x, None)
        x = nn.RMSNorm(epsilon=1e-5, name="final_norm", **kw)(x)
        logits = nn.Dense(cfg.vocab_size, use_bias=False, kernel_init=_init, name="lm_head",
                          **kw)(x)
        return logits.astype(jnp.promote_types(logits.dtype, jnp.float32)), aux.sum()


# name -> config; "default" is Mixtral 8x7B, "tiny" is for tests (float64 gradients in seconds
# on CPU: it computes in its parameters' dtype; every dim a multiple of 4, the model axis of the
# cpu8 mesh; capacity factor 0.5, so that half the choices are dropped: C = 4 slots per expert
# for 16 tokens x 2 choices over 4 experts). The "-dropless" configs are the same models with
# form (b)'s routing: sorted tokens and grouped matmuls, no token dropped.
MOE_SIZES = {
    "mixtral-8x7b": MoEConfig(),
    "mixtral-8x22b": MoEConfig(vocab_size=32768, num_layers=56, num_heads=48, d_model=6144,
                               expert_hidden=16384),
    "fine-grained": MoEConfig(vocab_size=151936, num_layers=48, num_heads=16, num_kv_heads=4,
                              d_model=2048, num_experts=128, top_k=8, expert_hidden=768,
                              shared_hidden=768, rope_base=1e6),
}
_TINY = MoEConfig(batch_size=8, seq_len=16, vocab_size=64, num_layers=2, num_heads=8,
                  num_kv_heads=4, d_model=32, num_experts=4, top_k=2, expert_hidden=32,
                  capacity_factor=0.5, shared_hidden=16, rope_base=10000.0, dtype=None)
MOE_CONFIGS = {
    "default": MOE_SIZES["mixtral-8x7b"],
    "tiny": _TINY,
    **MOE_SIZES,
    "tiny-dropless": dataclasses.replace(_TINY, routing="dropless"),
    **{f"{name}-dropless": dataclasses.replace(cfg, routing="dropless")
       for name, cfg in MOE_SIZES.items()},
}


def build_moe(name: str, config: str, cfg: MoEConfig, api: str) -> Workload:
    """The MoE workload: next-token cross entropy plus ``aux_loss_coef`` times the
    load-balancing loss, AdamW (beta2 0.95) after clipping (decay on the expert kernels too)."""
    module = MoEDecoder(cfg)

    def init_params(rng: jax.Array) -> dict:
        return {"params": module.init(rng, jnp.zeros((1, cfg.seq_len), jnp.int32))["params"]}

    def loss_fn(params: dict, batch: Batch) -> jax.Array:
        logits, aux = module.apply(params, batch["inputs"])
        return cross_entropy(logits, batch["targets"]) + cfg.aux_loss_coef * aux

    def make_batch(rng: jax.Array) -> Batch:
        return next_token_batch(rng, cfg.batch_size, cfg.seq_len, cfg.vocab_size)

    shared = f", shared expert {cfg.shared_hidden}" if cfg.shared_hidden else ""
    routing = (f"capacity factor {cfg.capacity_factor}" if cfg.routing == "capacity"
               else "dropless: sorted tokens, ragged_dot")
    # Megatron-LM's semantics: under gradient accumulation each microbatch routes its own
    # tokens (its capacity) and averages its own load-balancing loss (`soapjax.trace`)
    loss_fn.soapjax_microbatch_statistics = True
    return Workload(
        name=name, config=config, api="linen", family="transformer",
        description=(
            f"MoE decoder ({cfg.num_layers} layers, {cfg.num_heads} heads / {cfg.num_kv_heads} "
            f"kv, d_model {cfg.d_model}, {cfg.num_experts} experts top-{cfg.top_k} of FFN "
            f"{cfg.expert_hidden}{shared}, {routing}), "
            f"{cfg.seq_len} tokens, vocab {cfg.vocab_size}, "
            f"{cfg.dtype or cfg.param_dtype} over {cfg.param_dtype}"),
        batch_size=cfg.batch_size, loss_fn=loss_fn, init_params=jax.jit(init_params),
        make_batch=jax.jit(make_batch),
        optimizer=adamw_clipped(cfg.learning_rate, cfg.weight_decay, cfg.max_grad_norm),
    )
