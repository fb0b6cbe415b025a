"""A corpus of Flax models written the way users write them, to test soapjax on.

The zoo (``soapjax_zoo``) is written for soapjax; these are not. Each is a small, realistic
model with the idioms users reach for and soapjax must get exactly right: batch statistics,
custom derivatives (``jax.custom_vjp``, ``jax.custom_jvp``), scan over layers in linen and nnx
with rematerialisation, grouped-query attention with RoPE and a sliding window, dropout driven
by rng state (in nnx modules, and inside a recurrent cell scanned over time), bfloat16 compute
over float32 parameters, and a named batch axis bound by ``jax.vmap``; and, written the way
HuggingFace's Flax models are, a BERT encoder, a T5 encoder-decoder, a Llama decoder and a ViT
(padding masks as additive biases, relative position buckets, cross-attention, heads by
``reshape`` after a Dense, a patch convolution, layers named by number). Every one is tiny (a
few thousand parameters, batch 8), so a test traces, compiles and differentiates it in about a
second on a CPU.

Each entry's ``make(dtype=..., compiler_options=None, **options)`` returns
``(loss_fn, params_or_module, batch)`` (``compiler_options``: XLA options for the jitted init):

* linen: ``loss_fn(params, batch) -> scalar`` and the ``params`` pytree;
* nnx: ``loss_fn(model, batch) -> scalar`` and the `nnx.Module`.

The loss is a pure function of its arguments: mutable collections (batch statistics) are
computed and discarded inside it, and dropout keys come from fixed rng state (a constant key
in linen, the model's `nnx.Rngs` state in nnx), so calling it twice gives the same number.
Dim 0 of every batch leaf is the batch (8); model dims divide by 4 (the ``model`` axis of
``cpu8``). ``dtype`` is the parameters' and inputs' float type (float64 needs
``jax.enable_x64``); mixed_precision computes in bfloat16 whatever it is.

Usage::

    import corpus
    loss_fn, params, batch = corpus.get("resnet18", dtype=jnp.float32)
    grads = jax.grad(loss_fn)(params, batch)
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp

from corpus import (
    bert_encoder,
    bigru_tagger,
    byol,
    capsnet,
    clip,
    conformer,
    convnext,
    deep_kernel_gp,
    dit,
    dlrm,
    dropout_nnx,
    dynamic_conv,
    ensemble,
    expert_choice,
    fnet,
    fno,
    gat,
    gemma3,
    glow,
    gnn,
    gqa_decoder,
    hyena,
    kv_cache_decoder,
    linen_scan_transformer,
    llama_gqa,
    lru,
    lstm_dropout,
    mae,
    mamba,
    mixed_precision,
    mixer_mod,
    mla_packed,
    mobilenet,
    named_axis_bn,
    nchw_sr,
    neural_ode,
    nnx_scan_transformer,
    numbered_layers,
    padded_lm,
    perceiver,
    phi3_fused,
    pinn,
    pointnet,
    qwen3,
    recurrent_bn,
    resnet,
    rwkv,
    safe_norm,
    shared_layers,
    sngan,
    soft_moe,
    sparsemax_tabular,
    ste,
    swin,
    switch_moe,
    t5_encdec,
    unet,
    vit,
    vivit,
    vq_vae,
    wavenet,
    wgan_gp,
    whisper,
)

__all__ = ["CORPUS", "Entry", "get", "names"]


@dataclasses.dataclass(frozen=True)
class Entry:
    """One corpus model.

    Attributes:
      name: registry name.
      api: ``"linen"`` (``loss_fn(params, batch)``) or ``"nnx"`` (``loss_fn(model, batch)``).
      make: ``make(dtype=..., **options) -> (loss_fn, params_or_module, batch)``.
      description: one line: the idioms it exercises.
      has_conv: it convolves (plans must not split convolutions spatially: see
        `soapjax.apply.step.constrained_loss`).
      options: the keyword arguments `get` passes by default (the small, fast variant).
      gradients_in: where ``make test`` holds its float64 gradients to ``jax.grad``:
        ``"corpus"`` (tests/test_corpus.py: one device, and cpu8 under data parallel,
        Megatron, FSDP, a searched plan and `shard_training`) or ``"fuzz"``
        (tests/test_corpus.py too, by tests/fuzzing.py: one device, and a seeded random
        strategy on cpu8 or cpu8-nodes). Every model is in the randomized suite's long run
        either way.
      exact_compile: XLA options its exactness checks compile with over the suite's fast
        ones, where those compute the model wrongly (docs/xla-workarounds.md).
    """

    name: str
    api: Literal["linen", "nnx"]
    make: Callable[..., tuple[Callable, Any, Any]]
    description: str
    has_conv: bool = False
    options: tuple[tuple[str, Any], ...] = ()
    gradients_in: Literal["corpus", "fuzz"] = "corpus"
    exact_compile: tuple[tuple[str, Any], ...] = ()


CORPUS: dict[str, Entry] = {e.name: e for e in (
    Entry("resnet18", "linen", resnet.make,
          "ResNet-18, 32x32 inputs: BatchNorm with batch statistics (mutable, discarded), "
          "zero-initialised last BN scale per block, projection shortcuts, 7x7/2 stem, max pool",
          has_conv=True, options=(("width", 8),)),
    Entry("ste", "linen", ste.make,
          "MLP quantising activations with a straight-through estimator (jax.custom_vjp "
          "around jnp.round, backward = identity)"),
    Entry("safe_norm", "linen", safe_norm.make,
          "cosine classifier over L2-normalised features; a jax.custom_jvp norm whose "
          "derivative is 0 at the origin (padding rows are all zero)"),
    Entry("nnx_scan_transformer", "nnx", nnx_scan_transformer.make,
          "nnx transformer: layers made by nnx.vmap, applied by nnx.scan with nnx.remat, "
          "BatchNorm and Dropout (nnx.Rngs) inside the block"),
    Entry("linen_scan_transformer", "linen", linen_scan_transformer.make,
          "linen transformer: nn.scan over an nn.remat block, params stacked on axis 0, "
          "dropout from a fixed key"),
    Entry("linen_remat_scan_transformer", "linen", linen_scan_transformer.make,
          "the same transformer's blocks applied by nn.remat_scan (lengths (2, 2))",
          options=(("use_remat_scan", True),)),
    Entry("gqa_decoder", "linen", gqa_decoder.make,
          "decoder: grouped-query attention (4 query, 2 kv heads), RoPE, sliding-window "
          "causal mask, RMSNorm, SwiGLU, tied embeddings (embed.attend), unrolled layers"),
    Entry("lstm_dropout", "linen", lstm_dropout.make,
          "LSTM tagger: nn.scan over time of a cell that drops out its input at every step "
          "(split_rngs={'dropout': True}), one set of weights"),
    Entry("dropout_nnx", "nnx", dropout_nnx.make,
          "nnx conv + MLP with nnx.Dropout keyed by the model's nnx.Rngs state"),
    Entry("mixed_precision", "linen", mixed_precision.make,
          "linen Dense/LayerNorm/attention block computing in bfloat16 over float32 (or "
          "float64) parameters"),
    Entry("named_axis_bn", "linen", named_axis_bn.make,
          "BatchNorm(axis_name='batch') in a per-example loss bound by jax.vmap(..., "
          "axis_name='batch'): a psum in the jaxpr"),
    Entry("bert_encoder", "linen", bert_encoder.make,
          "HF-Flax-style BERT classifier: word + learned position + token-type embeddings, "
          "additive padding mask by lax.select of jnp.full, post-LN, layers named '0', '1'"),
    Entry("t5_encdec", "linen", t5_encdec.make,
          "HF-Flax-style T5: shared embedding, relative position buckets (log/where/minimum) "
          "shared across layers, cross-attention, RMS LayerNorm, labels shifted right"),
    Entry("numbered_layers", "linen", numbered_layers.make,
          "a LayerNorm + Dense block applied under the names '0'..'3' (ModuleList naming), "
          "MSE loss"),
    Entry("llama_gqa", "linen", llama_gqa.make,
          "HF-Flax-style Llama: 8 query over 4 kv heads by reshape after Dense, rotate-half "
          "RoPE from a gathered sin/cos table, jnp.tril causal mask, RMSNorm, SwiGLU"),
    Entry("vit", "linen", vit.make,
          "HF-Flax-style ViT: nn.Conv patch embedding (kernel = stride), class token by "
          "broadcast_to + concatenate, learned positions, pre-LN layers '0', '1'",
          has_conv=True),
    Entry("convnext", "nnx", convnext.make,
          "nnx ConvNeXt: patchify stem, 7x7 depthwise convolutions (feature_group_count = "
          "channels), LayerNorm, inverted-bottleneck MLP, layer scale, a strided downsampling "
          "convolution, layers in an nnx.List", has_conv=True, gradients_in="fuzz"),
    Entry("mobilenet", "linen", mobilenet.make,
          "MobileNetV2-style inverted residuals: 1x1 expansions, 3x3 depthwise convolutions "
          "(one strided, one with a channel multiplier of 2), BatchNorm, ReLU6, a 4-group "
          "convolution", has_conv=True, gradients_in="fuzz"),
    Entry("mamba", "linen", mamba.make,
          "Mamba-style selective-scan LM: in_proj split, causal depthwise conv1d by jnp.pad "
          "with a dead conv state sliced from the padded input, softplus step sizes, a "
          "lax.scan over time, gated by silu(z)", has_conv=True, gradients_in="fuzz"),
    Entry("gemma3", "linen", gemma3.make,
          "Gemma-3-style decoder: sliding-window and global layers, GQA with q/k RMSNorms, "
          "RoPE bases per layer kind, pre and post norms, GeGLU, tied soft-capped logits",
          gradients_in="fuzz"),
    Entry("qwen3", "nnx", qwen3.make,
          "Qwen-3-style nnx decoder: per-head q/k RMSNorms before RoPE, GQA by jnp.repeat, "
          "jnp.tril causal mask, SwiGLU, layers in an nnx.List ('0', '1'), untied head",
          gradients_in="fuzz"),
    Entry("whisper", "linen", whisper.make,
          "Whisper-style encoder-decoder: a 1-D convolutional front end (stride 2), "
          "sinusoidal positions, bidirectional encoder, causal decoder with cross-attention, "
          "tied logits", has_conv=True, gradients_in="fuzz"),
    Entry("kv_cache_decoder", "nnx", kv_cache_decoder.make,
          "nnx decoder writing its keys and values into nnx.Cache variables by "
          "dynamic_update_slice (dead in training), causal mask by jnp.full/where, tied "
          "embeddings", gradients_in="fuzz"),
    Entry("clip", "linen", clip.make,
          "CLIP-style contrastive pair of towers: L2-normalised embeddings, a weakly typed "
          "temperature (jnp.array), logits img @ txt.T over pairs of samples (the samples "
          "interact: one microbatch), symmetric cross-entropy", gradients_in="fuzz"),
    Entry("fnet", "linen", fnet.make,
          "FNet-style encoder: tokens mixed by jnp.fft.fft2's real part (complex values, no "
          "parameters), residual LayerNorms, GELU MLP, blocks in a list", gradients_in="fuzz"),
    Entry("unet", "linen", unet.make,
          "diffusion U-Net: sinusoidal timestep MLP added per channel, GroupNorm, a strided "
          "downsampling convolution, attention at low resolution, nn.ConvTranspose upsampling, "
          "a skip concatenated on the channels, noise levels gathered by timestep",
          has_conv=True, gradients_in="fuzz"),
    Entry("gnn", "linen", gnn.make,
          "message-passing graph network over graphs padded to one size: vmapped gathers of "
          "edge ends, jax.ops.segment_sum per receiver (a batched scatter-add) and in-degree "
          "mean, residual LayerNorm, layers '0'..'2', sum pooling", gradients_in="fuzz"),
    Entry("neural_ode", "linen", neural_ode.make,
          "neural ODE: a vector field of self.param weights integrated by RK4 in a "
          "jax.lax.fori_loop (a while loop), the loss read off the final state (the loop and "
          "its batch mean one operator)", gradients_in="fuzz"),
    Entry("padded_lm", "linen", padded_lm.make,
          "OPT/BLOOM-style LM on right-padded batches: positions and ALiBi biases from "
          "cumsum of the padding mask, a linear recurrence by lax.associative_scan, "
          "nn.WeightNorm, layer scale, per-sample stochastic depth, label smoothing, a "
          "masked mean", gradients_in="fuzz"),
    Entry("mixer_mod", "linen", mixer_mod.make,
          "MLP-Mixer blocks (token mixing by a Dense over swapaxes) sharing one block's "
          "parameters under nn.remat with a policy, a mixture-of-depths MLP (lax.top_k, "
          "take_along_axis, .at[].add), a latent cross-attention readout (broadcast_to), "
          "nn.SpectralNorm", gradients_in="fuzz"),
    Entry("switch_moe", "linen", switch_moe.make,
          "Switch-Transformer-style encoder: top-1 routing by argmax, buffer positions by "
          "cumsum of one-hot choices, a capacity mask, dispatch and combine einsums over "
          "stacked expert weights, a load-balancing loss", gradients_in="fuzz"),
    Entry("wavenet", "linen", wavenet.make,
          "WaveNet-style audio model: dilated causal convolutions (kernel_dilation 1-8), gated "
          "tanh*sigmoid activations, GroupNorm, summed skip connections, an ensemble of output "
          "heads by nn.vmap over the parameters, a masked mean guarded by lax.cond",
          gradients_in="fuzz"),
    Entry("nchw_sr", "nnx", nchw_sr.make,
          "super-resolution network ported from PyTorch in NCHW: lax.conv_general_dilated with "
          "OIHW kernels, reflection padding, hand-written BatchNorm2d with running stats, "
          "strided conv, reduce_window max pool, PixelShuffle", has_conv=True, gradients_in="fuzz"),
    Entry("vivit", "linen", vivit.make,
          "ViViT-style video classifier: a 3D-convolution tubelet embedding, factorised "
          "space-time attention (frames folded into the batch, then patches after a transpose), "
          "a tiled class token", has_conv=True, gradients_in="fuzz"),
    Entry("recurrent_bn", "linen", recurrent_bn.make,
          "LSTM with recurrent batch normalisation (batch statistics inside the nn.scan'd "
          "cell at every step), mean and max pooling over time, hard-example mining by "
          "lax.top_k over the batch's per-sample losses", gradients_in="fuzz"),
    Entry("expert_choice", "linen", expert_choice.make,
          "expert-choice mixture of experts: each expert takes its top-C tokens of the whole "
          "batch (lax.top_k over transposed router scores), gathers them by index, stacked "
          "expert weights, outputs added back with .at[index].add", gradients_in="fuzz"),
    Entry("bigru_tagger", "linen", bigru_tagger.make,
          "bidirectional GRU tagger with Flax's RNN API over variable-length sequences "
          "(nn.Bidirectional of nn.RNN with seq_lengths: per-sample masks and flips), "
          "return_carry, a masked token loss and a sentence loss", gradients_in="fuzz"),
    Entry("dynamic_conv", "linen", dynamic_conv.make,
          "image classifier with a weight-standardised convolution (an nn.Conv param hook) "
          "and a per-sample dynamic depthwise convolution (kernels predicted per sample, "
          "jax.vmap'd conv), spatial dims pooled inside the operator", has_conv=True,
          gradients_in="fuzz"),
    Entry("swin", "linen", swin.make,
          "Swin Transformer: patches by reshape and transpose, window partition, attention "
          "inside windows by jax.nn.dot_product_attention with a relative position bias "
          "gathered from a table, shifted windows by jnp.roll and a region mask, patch merging "
          "by strided slices", gradients_in="fuzz"),
    Entry("dit", "nnx", dit.make,
          "diffusion transformer: patchify, sinusoidal timestep MLP, label dropout by "
          "jnp.where of an nnx.Rngs draw, adaLN-Zero (one Dense split six ways, zero-"
          "initialised), nnx.MultiHeadAttention, unpatchify, noise and variance split, the "
          "forward diffusion by jnp.cumprod in the loss", gradients_in="fuzz"),
    Entry("mla_packed", "linen", mla_packed.make,
          "DeepSeek-V2-style multi-head latent attention over packed documents: positions "
          "from segment ids by lax.cummax, a same-document causal mask into "
          "jax.nn.dot_product_attention, low-rank queries and a compressed key-value latent, "
          "a shared rotary key broadcast to the heads, RoPE by complex numbers",
          gradients_in="fuzz"),
    Entry("pinn", "linen", pinn.make,
          "physics-informed network for Burgers' equation: the PDE residual by jax.grad of "
          "the network in its inputs inside the loss (second order for u_xx), vmap'd over "
          "collocation points, initial and boundary losses", gradients_in="fuzz"),
    Entry("wgan_gp", "linen", wgan_gp.make,
          "WGAN-GP critic step: strided-conv critic and a ConvTranspose generator, fakes under "
          "stop_gradient, the gradient penalty by jax.vmap of jax.grad of the critic in its "
          "input (a second-order backward), the generator's loss through stop_gradient'd "
          "critic parameters", has_conv=True, gradients_in="fuzz"),
    Entry("gat", "linen", gat.make,
          "graph attention network over a batch of graphs (jax.vmap'd per-graph code): edge "
          "logits gathered by sender and receiver, a segment softmax by jax.ops.segment_max "
          "(scatter-max) and segment_sum, heads concatenated then averaged, a masked node "
          "loss", gradients_in="fuzz"),
    Entry("conformer", "linen", conformer.make,
          "Conformer ASR encoder with CTC: strided 2D-convolution subsampling, macaron "
          "feed-forward halves, self-attention with a key padding mask, the convolution "
          "module (GLU by jnp.split of the channels, a depthwise 1D convolution, batch "
          "statistics), optax.ctc_loss", has_conv=True, gradients_in="fuzz"),
    Entry("glow", "linen", glow.make,
          "Glow normalizing flow: squeeze by reshape and transpose, ActNorm, an invertible 1x1 "
          "convolution whose log-determinant is jnp.linalg.slogdet of its matrix (an LU in "
          "the step), affine couplings (jnp.split, a zero-initialised convolution), bits per "
          "dimension", has_conv=True, gradients_in="fuzz"),
    Entry("shared_layers", "linen", shared_layers.make,
          "weights shared across depth: ALBERT's factorised embedding and one encoder layer "
          "called three times in a Python loop, then a Universal-Transformer recurrence by "
          "nn.scan with variable_broadcast='params' and a per-step embedding, a tied "
          "masked-token head", gradients_in="fuzz"),
    Entry("phi3_fused", "linen", phi3_fused.make,
          "Phi-3-style decoder with fused projections: one qkv_proj cut into unequal query, "
          "key and value columns by slicing (GQA), one gate_up_proj split by jnp.split, "
          "rotate-half RoPE, logits[:, :-1] against tokens[:, 1:]", gradients_in="fuzz"),
    Entry("dlrm", "linen", dlrm.make,
          "DLRM-style recommender: a bottom MLP, multi-hot embedding bags (ids hashed by %, "
          "an nn.Embed and two jnp.take tables, masked means, empty bags), pairwise dot "
          "interactions gathered by jnp.triu_indices, a top MLP, sigmoid cross-entropy",
          gradients_in="fuzz"),
    Entry("pointnet", "linen", pointnet.make,
          "PointNet classifier: T-Nets predicting per-sample 3x3 and 16x16 transforms "
          "(kernel-1 convolutions, BatchNorm, max over points, identity-initialised), points "
          "times their transform (both operands activations), an orthogonality penalty, "
          "dropout", has_conv=True, gradients_in="fuzz",
          # XLA:CPU at backend optimisation level 0 loses the max pool's gradient (its
          # location mask compares the pooled value with an input it computed apart)
          exact_compile=(("xla_backend_optimization_level", 1),)),
    Entry("vq_vae", "linen", vq_vae.make,
          "VQ-VAE: strided-conv encoder, nearest codebook vector by argmin of distances, "
          "codes gathered by jnp.take, codebook and commitment losses by stop_gradient, the "
          "straight-through z + sg(q - z), a ConvTranspose decoder", has_conv=True,
          gradients_in="fuzz"),
    Entry("rwkv", "linen", rwkv.make,
          "RWKV-4-style LM: token shift by jnp.pad, the WKV recurrence as a lax.scan over "
          "time in log space (a running maximum), learned decays, squared-ReLU channel "
          "mixing, checkpoint_name'd projections under nn.remat(save_only_these_names), "
          "tied logits", gradients_in="fuzz"),
    Entry("deep_kernel_gp", "linen", deep_kernel_gp.make,
          "deep kernel learning: an MLP's features into an RBF kernel over the batch's pairs "
          "of samples plus noise on the diagonal, the exact GP marginal likelihood by "
          "cho_factor / cho_solve (Cholesky and triangular solves)", gradients_in="fuzz"),
    Entry("capsnet", "linen", capsnet.make,
          "capsule network: primary capsules by reshape of a strided convolution, squash, "
          "per-pair transforms by an einsum over a 4-D parameter, routing by agreement in a "
          "lax.fori_loop (a scan) over stop_gradient'd predictions, the margin loss", has_conv=True,
          gradients_in="fuzz"),
    Entry("hyena", "linen", hyena.make,
          "Hyena-style LM: a short depthwise causal convolution, implicit long filters from an "
          "MLP over positional sinusoids with a decay window, the long convolution by "
          "jnp.fft.rfft / irfft padded to twice the length, gating", has_conv=True,
          gradients_in="fuzz"),
    Entry("soft_moe", "linen", soft_moe.make,
          "Soft MoE ViT: slots as softmax-over-tokens mixes of every token, combine weights a "
          "softmax over slots, experts as einsums over stacked weights, L2-normalised logits "
          "with a learned scale", gradients_in="fuzz"),
    Entry("sparsemax_tabular", "linen", sparsemax_tabular.make,
          "TabNet-style tabular classifier: sparsemax masks by jnp.sort, jnp.cumsum and "
          "take_along_axis, priors multiplied across decision steps, GLU blocks, BatchNorm "
          "with batch statistics, an entropy regulariser", gradients_in="fuzz",
          # XLA:CPU at backend optimisation level 0 computes its sharded step wrongly (the
          # unsharded reference rightly): level 1 gives jax.grad's gradients
          exact_compile=(("xla_backend_optimization_level", 1),)),
    Entry("byol", "linen", byol.make,
          "BYOL step: two views made in the loss (a flip, a per-sample jitter), online "
          "encoder, projector and predictor, the target network held in the parameters "
          "under stop_gradient (a zero gradient), the symmetric cosine loss", has_conv=True,
          gradients_in="fuzz"),
    Entry("mae", "linen", mae.make,
          "masked autoencoder: per-sample random masking by jnp.argsort of noise, the kept "
          "patches and the unshuffle by take_along_axis with per-sample indices, a tiled mask "
          "token, norm_pix targets, the loss over the masked patches alone", gradients_in="fuzz"),
    Entry("sngan", "linen", sngan.make,
          "SN-GAN discriminator: Flax's nn.SpectralNorm around strided convolutions (a power "
          "iteration per call, u and sigma in batch_stats, mutable and discarded) and "
          "nn.WeightNorm around the head, the hinge loss on real and fake images",
          has_conv=True, gradients_in="fuzz"),
    Entry("perceiver", "linen", perceiver.make,
          "Perceiver IO: a learned latent array broadcast to the batch, cross-attention to "
          "inputs with Fourier position features and a length mask, one latent block's "
          "weights called twice, a learned decoder query", gradients_in="fuzz"),
    Entry("ensemble", "linen", ensemble.make,
          "deep ensemble by nn.vmap: every parameter with a leading member axis, the input "
          "shared (in_axes=None), a Gaussian NLL per member", gradients_in="fuzz"),
    Entry("fno", "linen", fno.make,
          "Fourier neural operator: complex spectral weights (complex64, complex128 beside "
          "float64), rfft2, two corners of low modes mixed by a complex einsum and written "
          "into a zero spectrum by .at[].set, irfft2, a 1x1 conv path, the relative L2 loss",
          has_conv=True, gradients_in="fuzz"),
    Entry("lru", "linen", lru.make,
          "Linear Recurrent Unit: a complex diagonal recurrence by jax.lax.associative_scan, "
          "complex matrices from real and imaginary parameters, gamma_log initialised from two "
          "other parameters, the layer nn.vmap'ed over the batch with its parameters broadcast",
          gradients_in="fuzz"),
)}


def names() -> tuple[str, ...]:
    """The corpus models' names, in registry order."""
    return tuple(CORPUS)


def get(name: str, *, dtype: Any = jnp.float32, **options: Any) -> tuple[Callable, Any, Any]:
    """``(loss_fn, params_or_module, batch)`` of corpus model `name`.

    Args:
      name: a name in `CORPUS`.
      dtype: the parameters' and float inputs' dtype (float64 needs ``jax.enable_x64``).
      **options: the model's options, over the entry's defaults (e.g. ``width=64`` for the
        full ResNet-18).

    Raises:
      KeyError: an unknown name (with the nearest names).
    """
    if name not in CORPUS:
        near = difflib.get_close_matches(name, CORPUS, n=3)
        hint = f"; did you mean {', '.join(map(repr, near))}?" if near else ""
        raise KeyError(f"no corpus model {name!r}; expected one of {names()}{hint}")
    entry = CORPUS[name]
    return entry.make(dtype=dtype, **{**dict(entry.options), **options})


# XLA's options for a test's programs: compiled fast, run once on a handful of values
FAST_COMPILE = {"xla_cpu_use_fusion_emitters": False, "xla_backend_optimization_level": 0,
                "xla_llvm_disable_expensive_passes": True}


@functools.cache
def made64(name: str) -> tuple[Callable, Any, Any]:
    """`get`'s float64 model, its init compiled with `FAST_COMPILE`, made once per process
    and shared by every test that reads it (making a model, its init compiled, is most of
    what a test of one costs): tests/test_corpus.py's cases and tests/fuzzing.py's subjects.
    Callers copy before changing it (an nnx module: ``nnx.clone``)."""
    with jax.enable_x64(True):
        return get(name, dtype=jnp.float64, compiler_options=FAST_COMPILE)
