"""Recurrent workloads: RNNTC, RNNLM and NMT, stacks of LSTMs unrolled 40 steps (linen).

Every LSTM layer is ``nn.RNN(nn.OptimizedLSTMCell(hidden))``, which traces to one `lax.scan`
per layer and direction of the pass, named by the layer (``lstm_0``, ``encoder/lstm_1``, ...).
The cell is built with ``parent=None`` so that `nn.RNN` adopts it: its parameters then sit
under the layer's name (``lstm_0/cell/ii/kernel``) rather than under the enclosing module.

There is no dropout: the loss is a pure function of ``(params, batch)``. The optimizer is Adam
after clipping the global gradient norm, the usual recipe for LSTMs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from soapjax_zoo.workload import Batch, Workload, adam_clipped, linen_workload

Carry = tuple[jax.Array, jax.Array]


def lstm(hidden: int, name: str, **kwargs: object) -> nn.RNN:
    """One LSTM layer over ``[batch, time, features]`` (one scan), its cell named ``cell``."""
    return nn.RNN(nn.OptimizedLSTMCell(hidden, parent=None), name=name, **kwargs)


def _tokens(rng: jax.Array, shape: tuple[int, ...], vocab: int) -> jax.Array:
    return jax.random.randint(rng, shape, 0, vocab, jnp.int32)


# RNNTC -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RNNTCConfig:
    """Text classification: embedding, 4 LSTM layers of 1024, softmax over the last state.

    The paper trained it on Movie Reviews (Pang and Lee sentence polarity), hence 2 classes.
    """

    batch_size: int = 64
    seq_len: int = 40
    vocab_size: int = 32000
    embed_dim: int = 1024
    hidden: int = 1024
    num_layers: int = 4
    num_classes: int = 2
    learning_rate: float = 1e-3
    max_grad_norm: float = 5.0


class RNNTC(nn.Module):
    """Embedding, stacked LSTMs, a classifier on the hidden state after the last token."""

    config: RNNTCConfig

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        cfg = self.config
        x = nn.Embed(cfg.vocab_size, cfg.embed_dim, name="embed")(tokens)
        for i in range(cfg.num_layers):
            x = lstm(cfg.hidden, f"lstm_{i}")(x)
        return nn.Dense(cfg.num_classes, name="classifier")(x[:, -1])


RNNTC_CONFIGS = {
    "default": RNNTCConfig(),
    "tiny": RNNTCConfig(batch_size=8, seq_len=8, vocab_size=64, embed_dim=32, hidden=32),
}


def build_rnntc(name: str, config: str, cfg: RNNTCConfig, api: str) -> Workload:
    """The RNNTC workload: token ids in, one class label per sequence."""

    def make_batch(rng: jax.Array) -> Batch:
        k_tokens, k_label = jax.random.split(rng)
        return {
            "tokens": _tokens(k_tokens, (cfg.batch_size, cfg.seq_len), cfg.vocab_size),
            "label": _tokens(k_label, (cfg.batch_size,), cfg.num_classes),
        }

    return linen_workload(
        name=name,
        config=config,
        family="rnn",
        description=(
            f"RNNTC: {cfg.num_layers} LSTM layers of {cfg.hidden}, {cfg.seq_len} steps, "
            f"{cfg.num_classes}-way classifier on the last state"
        ),
        module=RNNTC(cfg),
        make_batch=make_batch,
        inputs=("tokens",),
        label="label",
        optimizer=adam_clipped(cfg.learning_rate, cfg.max_grad_norm),
    )


# RNNLM -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RNNLMConfig:
    """Word language model (Zaremba et al. 2014, PTB): 2 LSTM layers of 2048, 10k vocabulary."""

    batch_size: int = 64
    seq_len: int = 40
    vocab_size: int = 10000
    embed_dim: int = 2048
    hidden: int = 2048
    num_layers: int = 2
    learning_rate: float = 1e-3
    max_grad_norm: float = 5.0


class RNNLM(nn.Module):
    """Embedding, stacked LSTMs, a softmax layer over the vocabulary at every step."""

    config: RNNLMConfig

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        cfg = self.config
        x = nn.Embed(cfg.vocab_size, cfg.embed_dim, name="embed")(tokens)
        for i in range(cfg.num_layers):
            x = lstm(cfg.hidden, f"lstm_{i}")(x)
        return nn.Dense(cfg.vocab_size, name="softmax")(x)


RNNLM_CONFIGS = {
    "default": RNNLMConfig(),
    "tiny": RNNLMConfig(batch_size=8, seq_len=8, vocab_size=64, embed_dim=32, hidden=32),
}


def _next_token_batch(batch_size: int, seq_len: int, vocab: int) -> Callable[[jax.Array], Batch]:
    """``inputs`` and ``targets`` cut from one token stream, the targets one step ahead."""

    def make_batch(rng: jax.Array) -> Batch:
        stream = _tokens(rng, (batch_size, seq_len + 1), vocab)
        return {"inputs": stream[:, :-1], "targets": stream[:, 1:]}

    return make_batch


def build_rnnlm(name: str, config: str, cfg: RNNLMConfig, api: str) -> Workload:
    """The RNNLM workload: next-token prediction on synthetic token streams."""
    return linen_workload(
        name=name,
        config=config,
        family="rnn",
        description=(
            f"RNNLM: {cfg.num_layers} LSTM layers of {cfg.hidden}, {cfg.seq_len} steps, "
            f"softmax over {cfg.vocab_size} words"
        ),
        module=RNNLM(cfg),
        make_batch=_next_token_batch(cfg.batch_size, cfg.seq_len, cfg.vocab_size),
        inputs=("inputs",),
        label="targets",
        optimizer=adam_clipped(cfg.learning_rate, cfg.max_grad_norm),
    )


# NMT -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class NMTConfig:
    """Sequence to sequence with attention (Wu et al. 2016; Luong et al. 2015).

    Encoder and decoder of 2 LSTM layers of 1024 each, 40 steps each; Luong "general" global
    attention on top of the last decoder layer; softmax over the target vocabulary.
    """

    batch_size: int = 64
    source_len: int = 40
    target_len: int = 40
    source_vocab: int = 32000
    target_vocab: int = 32000
    embed_dim: int = 1024
    hidden: int = 1024
    num_layers: int = 2
    learning_rate: float = 1e-3
    max_grad_norm: float = 5.0


class Encoder(nn.Module):
    """Embedding and stacked LSTMs; returns every layer's final carry and the last outputs."""

    config: NMTConfig

    @nn.compact
    def __call__(self, source: jax.Array) -> tuple[list[Carry], jax.Array]:
        cfg = self.config
        x = nn.Embed(cfg.source_vocab, cfg.embed_dim, name="embed")(source)
        carries = []
        for i in range(cfg.num_layers):
            carry, x = lstm(cfg.hidden, f"lstm_{i}", return_carry=True)(x)
            carries.append(carry)
        return carries, x


class LuongAttention(nn.Module):
    """Global attention, "general" score: ``h_t^T W_a h_s``, then ``tanh(W_c [c_t; h_t])``."""

    hidden: int

    @nn.compact
    def __call__(self, query: jax.Array, memory: jax.Array) -> jax.Array:
        keys = nn.Dense(self.hidden, use_bias=False, name="score")(memory)
        weights = jax.nn.softmax(jnp.einsum("btd,bsd->bts", query, keys), axis=-1)
        context = jnp.einsum("bts,bsd->btd", weights, memory)
        combined = jnp.concatenate([context, query], axis=-1)
        return jnp.tanh(nn.Dense(self.hidden, use_bias=False, name="combine")(combined))


class Decoder(nn.Module):
    """Stacked LSTMs started from the encoder's final states, attention, softmax layer."""

    config: NMTConfig

    @nn.compact
    def __call__(
        self, target_inputs: jax.Array, carries: list[Carry], memory: jax.Array
    ) -> jax.Array:
        cfg = self.config
        x = nn.Embed(cfg.target_vocab, cfg.embed_dim, name="embed")(target_inputs)
        for i, carry in enumerate(carries):
            x = lstm(cfg.hidden, f"lstm_{i}")(x, initial_carry=carry)
        x = LuongAttention(cfg.hidden, name="attention")(x, memory)
        return nn.Dense(cfg.target_vocab, name="softmax")(x)


class NMT(nn.Module):
    """Encoder-decoder with attention, trained with teacher forcing."""

    config: NMTConfig

    @nn.compact
    def __call__(self, source: jax.Array, target_inputs: jax.Array) -> jax.Array:
        carries, memory = Encoder(self.config, name="encoder")(source)
        return Decoder(self.config, name="decoder")(target_inputs, carries, memory)


NMT_CONFIGS = {
    "default": NMTConfig(),
    "tiny": NMTConfig(
        batch_size=8,
        source_len=8,
        target_len=8,
        source_vocab=64,
        target_vocab=64,
        embed_dim=32,
        hidden=32,
    ),
}


def build_nmt(name: str, config: str, cfg: NMTConfig, api: str) -> Workload:
    """The NMT workload: source tokens and shifted target tokens in, target tokens out."""

    def make_batch(rng: jax.Array) -> Batch:
        k_source, k_target = jax.random.split(rng)
        target = _tokens(k_target, (cfg.batch_size, cfg.target_len + 1), cfg.target_vocab)
        return {
            "source": _tokens(k_source, (cfg.batch_size, cfg.source_len), cfg.source_vocab),
            "target_inputs": target[:, :-1],
            "targets": target[:, 1:],
        }

    return linen_workload(
        name=name,
        config=config,
        family="rnn",
        description=(
            f"NMT: {cfg.num_layers}+{cfg.num_layers} LSTM layers of {cfg.hidden}, "
            f"{cfg.source_len}/{cfg.target_len} steps, Luong attention, "
            f"softmax over {cfg.target_vocab} words"
        ),
        module=NMT(cfg),
        make_batch=make_batch,
        inputs=("source", "target_inputs"),
        label="targets",
        optimizer=adam_clipped(cfg.learning_rate, cfg.max_grad_norm),
    )
