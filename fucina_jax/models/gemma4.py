"""Gemma 4 (`gemma4`), every text variant: dense (31B), MoE (26B-A4B), per-layer-embedding (E2B/E4B).

Wiring as llama.cpp 0.3.36 runs it (src/models/gemma4.cpp, llama-model.cpp, llama-hparams.cpp):
- Embeddings scaled by sqrtf(n_embd) in f32 (not rounded to bf16 as HF/DeepMind do); tied output; logits
  soft-capped (final_logit_softcapping, absent = off). GGUF norm weights are raw (no +1 baked in, unlike Gemma 3).
- Sliding layers from the bool array attention.sliding_window_pattern (true = sliding); each layer type has its own
  head dim (key_length vs key_length_swa), rotated dims (rope.dimension_count vs _swa), kv-head count (head_count_kv
  may be per layer) and RoPE base (rope.freq_base vs rope.freq_base_swa, default 10000; sliding layers ignore rope
  scaling). Global layers divide their RoPE speeds by the `rope_freqs` tensor: Gemma 4's "proportional" partial RoPE
  is [1]*k + [1e30]*rest, i.e. only the first k pairs rotate.
- Attention scale 1.0 (q/k norms do the scaling), q/k RMSNorm with weights, V RMSNorm without weight. A layer with no
  attn_v uses its raw K projection as V (K=V global layers of 31B/26B): V is normed, K is k-normed and rotated, so
  both are cached.
- Sandwich norms: h += norm(attn) * post_attention_norm; h += norm(ffn) * post_ffw_norm.
- MoE layers (26B-A4B): a dense GeGLU branch (ffn_norm -> FFN -> post_ffw_norm_1) in parallel with routed experts
  (pre_ffw_norm_2 -> experts -> post_ffw_norm_2), summed before post_ffw_norm. The router reads
  rmsnorm(h) (no weight) * n_embd^-0.5 * ffn_gate_inp.scale; softmax, top-k, renormalised, times ffn_down_exps.scale.
  Experts come fused (ffn_gate_up_exps: gate rows first) or as separate gate/up tensors.
- Per-layer embeddings (E2B/E4B): ple[l] = (rmsnorm(e @ per_layer_model_proj^T * n_embd^-0.5) * per_layer_proj_norm
  + per_layer_token_embd[tok][l] * sqrt(P)) / sqrt(2), e the scaled embedding; after the FFN each layer adds
  norm(proj(gelu(inp_gate h) * ple[l])) * post_norm.
- layer_output_scale multiplies the whole residual stream at the end of the layer.
- KV sharing (attention.shared_kv_layers = n): layers >= n_layer - n own no K/V and read the cache of a fixed donor,
  the last non-shared layer of their type: n_layer - n - 2 (must be sliding) or n_layer - n - 1 (must be global).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from fucina_jax.errors import MetadataError, MissingTensorError
from fucina_jax.kernels import QWeight
from fucina_jax.models.cache import KVCache, stepped
from fucina_jax.models.config import LayerSpec, ModelConfig, meta_float, meta_get, meta_int, per_layer, read_hparams
from fucina_jax.models.layers import (
    ACTIVATIONS,
    attention_block,
    embed,
    ffn_block,
    linear,
    lookup,
    moe_ffn,
    rms_norm,
    rope_inv_freq,
)
from fucina_jax.models.loading import TensorSpec, output_specs

__all__ = ["ARCH", "config_from_metadata", "tensor_table", "forward_hidden", "kv_donor"]

ARCH = "gemma4"
SWA_ROPE_BASE_DEFAULT = 10000.0  # llama_hparams::rope_freq_base_train_swa when the key is absent

# Keys llama.cpp refuses to load without (or aborts the process on): fail early with a clear message instead.
REQUIRED_KEYS = (
    "context_length",
    "attention.sliding_window",
    "attention.sliding_window_pattern",
    "attention.key_length",
    "attention.value_length",
    "attention.key_length_swa",
    "attention.value_length_swa",
    "embedding_length_per_layer_input",
)


def kv_donor(layer: int, sliding: bool, first_shared: int) -> int:
    """The layer whose cache a shared-KV layer reads (llama.cpp's reuse callback in llama_model::create_memory)."""
    return first_shared - (2 if sliding else 1) if layer >= first_shared else layer


def config_from_metadata(md: dict, n_vocab: int, has_output: bool) -> ModelConfig:
    def g(key, default=None, required=False):
        return meta_get(md, f"{ARCH}.{key}", default, required=required)

    def gi(key, default=None, lo=1, hi=None):
        return meta_int(g(key, default, required=default is None), f"{ARCH}.{key}", lo, hi)

    for key in REQUIRED_KEYS:
        g(key, required=True)
    hp = read_hparams(md, ARCH)
    L = hp.n_layer
    pattern = g("attention.sliding_window_pattern")
    if not isinstance(pattern, (list, tuple)) or len(pattern) != L:
        raise MetadataError(
            f"{ARCH}.attention.sliding_window_pattern must be a bool array with one entry per layer ({L}); "
            f"got {pattern!r}"
        )
    sliding = [bool(x) for x in pattern]
    if any(sliding) and hp.window <= 0:
        raise MetadataError(f"{ARCH}: sliding layers need attention.sliding_window > 0 (got {hp.window})")
    hd_swa = gi("attention.key_length_swa")
    if gi("attention.value_length_swa") != hd_swa:
        raise MetadataError(f"{ARCH}: key_length_swa != value_length_swa (llama.cpp rejects this file too)")
    n_rot_swa = gi("rope.dimension_count_swa", hp.n_rot)  # llama.cpp: defaults to the global n_rot
    if n_rot_swa > hd_swa or hp.n_rot > hp.head_dim:
        raise MetadataError(
            f"{ARCH}: rotated dims exceed the head dim (rope.dimension_count {hp.n_rot} vs key_length {hp.head_dim}, "
            f"rope.dimension_count_swa {n_rot_swa} vs key_length_swa {hd_swa}); write rope.dimension_count_swa"
        )
    base_swa = meta_float(g("rope.freq_base_swa", SWA_ROPE_BASE_DEFAULT), f"{ARCH}.rope.freq_base_swa", positive=True)

    n_shared = gi("attention.shared_kv_layers", 0, lo=0, hi=L)
    first_shared = L - n_shared
    if n_shared and first_shared < 2:
        raise MetadataError(f"{ARCH}: attention.shared_kv_layers {n_shared} leaves fewer than 2 layers with a cache")
    for l in range(first_shared, L):
        donor = kv_donor(l, sliding[l], first_shared)
        if sliding[donor] != sliding[l]:
            raise MetadataError(
                f"{ARCH}: shared-KV layer {l} ({'sliding' if sliding[l] else 'global'}) would read layer {donor}, "
                "which is of the other type; llama.cpp fixes the donors at first_shared-2 (sliding) and "
                "first_shared-1 (global)"
            )

    n_expert = gi("expert_count", 0, lo=0)
    n_used = expert_ff = 0
    if n_expert:
        n_used = gi("expert_used_count")
        ffs = set(per_layer(g("expert_feed_forward_length", required=True), L, f"{ARCH}.expert_feed_forward_length"))
        if len(ffs) != 1:
            raise MetadataError(f"{ARCH}: a per-layer expert_feed_forward_length is not supported ({sorted(ffs)})")
        expert_ff = meta_int(ffs.pop(), f"{ARCH}.expert_feed_forward_length", 1)
        if not 0 < n_used <= n_expert:
            raise MetadataError(f"{ARCH}: expert_used_count {n_used} must be in [1, expert_count {n_expert}]")

    layers = tuple(
        LayerSpec(
            sliding=s,
            head_dim=hd_swa if s else hp.head_dim,
            n_kv_heads=hp.n_kv[l],
            ffn_dim=hp.n_ff[l],
            rope_base=base_swa if s else hp.rope_base,
            rope_scale=1.0 if s else hp.rope_scale,
            n_rot=n_rot_swa if s else hp.n_rot,
            kv_slot=kv_donor(l, s, first_shared),
            writes_kv=l < first_shared,
            attn_scale=1.0,
            moe=n_expert > 0,
        )
        for l, s in enumerate(sliding)
    )
    return ModelConfig(
        arch=ARCH,
        n_vocab=n_vocab,
        d_model=hp.n_embd,
        n_heads=hp.n_head,
        rms_eps=hp.eps,
        context_length=hp.ctx,
        layers=layers,
        window=hp.window,
        act="gelu",
        embed_scale=math.sqrt(hp.n_embd),
        final_softcap=hp.softcap,
        tied_output=not has_output,
        n_expert=n_expert,
        n_expert_used=n_used,
        expert_ffn_dim=expert_ff,
        ple_dim=gi("embedding_length_per_layer_input", lo=0),
    )


def tensor_table(cfg: ModelConfig):
    D, V, L, P = cfg.d_model, cfg.n_vocab, cfg.n_layers, cfg.ple_dim
    glob = output_specs(cfg)
    global_dims = {s.head_dim for s in cfg.layers if not s.sliding}
    if global_dims:
        # one tensor shared by every global layer, half a global head long (llama.cpp: {n_embd_head / 2})
        glob.append(TensorSpec("rope_freqs", "rope_freqs.weight", (max(global_dims) // 2,)))
    if P:
        glob += [
            TensorSpec("per_layer_token_embd", "per_layer_token_embd.weight", (V, L * P)),
            TensorSpec("per_layer_model_proj", "per_layer_model_proj.weight", (L * P, D)),
            TensorSpec("per_layer_proj_norm", "per_layer_proj_norm.weight", (P,)),
        ]

    def layer(l: int) -> list[TensorSpec]:
        s = cfg.layers[l]
        H, K, Dh, F = cfg.n_heads, s.n_kv_heads, s.head_dim, s.ffn_dim
        specs = [
            TensorSpec("attn_norm", "blk.{l}.attn_norm.weight", (D,)),
            TensorSpec("attn_q", "blk.{l}.attn_q.weight", (H * Dh, D)),
            TensorSpec("attn_q_norm", "blk.{l}.attn_q_norm.weight", (Dh,)),
            TensorSpec("attn_output", "blk.{l}.attn_output.weight", (D, H * Dh)),
            TensorSpec("post_attention_norm", "blk.{l}.post_attention_norm.weight", (D,)),
            TensorSpec("ffn_norm", "blk.{l}.ffn_norm.weight", (D,)),
            TensorSpec("ffn_gate", "blk.{l}.ffn_gate.weight", (F, D)),
            TensorSpec("ffn_up", "blk.{l}.ffn_up.weight", (F, D)),
            TensorSpec("ffn_down", "blk.{l}.ffn_down.weight", (D, F)),
            TensorSpec("post_ffw_norm", "blk.{l}.post_ffw_norm.weight", (D,)),
            TensorSpec("layer_output_scale", "blk.{l}.layer_output_scale.weight", (1,), optional=True),
        ]
        if s.writes_kv:
            specs += [
                TensorSpec("attn_k", "blk.{l}.attn_k.weight", (K * Dh, D)),
                TensorSpec("attn_k_norm", "blk.{l}.attn_k_norm.weight", (Dh,)),
                # absent on K=V layers: attention_block then uses the raw K projection as V
                TensorSpec("attn_v", "blk.{l}.attn_v.weight", (K * Dh, D), optional=True),
            ]
        if s.moe:
            E, Fe = cfg.n_expert, cfg.expert_ffn_dim
            specs += [
                TensorSpec("ffn_gate_inp", "blk.{l}.ffn_gate_inp.weight", (E, D)),
                TensorSpec("ffn_gate_inp_scale", "blk.{l}.ffn_gate_inp.scale", (D,)),
                TensorSpec("pre_ffw_norm_2", "blk.{l}.pre_ffw_norm_2.weight", (D,)),
                TensorSpec("post_ffw_norm_1", "blk.{l}.post_ffw_norm_1.weight", (D,)),
                TensorSpec("post_ffw_norm_2", "blk.{l}.post_ffw_norm_2.weight", (D,)),
                TensorSpec("ffn_gate_up_exps", "blk.{l}.ffn_gate_up_exps.weight", (E, 2 * Fe, D), optional=True),
                TensorSpec("ffn_gate_exps", "blk.{l}.ffn_gate_exps.weight", (E, Fe, D), optional=True),
                TensorSpec("ffn_up_exps", "blk.{l}.ffn_up_exps.weight", (E, Fe, D), optional=True),
                TensorSpec("ffn_down_exps", "blk.{l}.ffn_down_exps.weight", (E, D, Fe)),
                TensorSpec("ffn_down_exps_scale", "blk.{l}.ffn_down_exps.scale", (E,), optional=True),
            ]
        if P:
            specs += [
                TensorSpec("inp_gate", "blk.{l}.inp_gate.weight", (P, D)),
                TensorSpec("proj", "blk.{l}.proj.weight", (D, P)),
                TensorSpec("post_norm", "blk.{l}.post_norm.weight", (D,)),
            ]
        return specs

    return glob, layer


def _expert_weights(p: dict):
    """(gate, up) expert tensors [E, Fe, D]: halves of the fused ffn_gate_up_exps, or the separate pair; (the fused
    stack, None) when it is packed."""
    if "ffn_gate_up_exps" in p:
        gu = p["ffn_gate_up_exps"]
        if isinstance(gu, QWeight):  # packed: one expert call gives gate and up side by side (layers.moe_ffn)
            return gu, None
        fe = gu.shape[1] // 2
        return gu[:, :fe], gu[:, fe:]
    if "ffn_gate_exps" in p and "ffn_up_exps" in p:
        return p["ffn_gate_exps"], p["ffn_up_exps"]
    raise MissingTensorError(
        "a gemma4 MoE layer needs ffn_gate_up_exps.weight (or both ffn_gate_exps.weight and ffn_up_exps.weight); "
        "the file has neither: re-convert the model"
    )


def moe_block(p: dict, h, cfg: ModelConfig):
    """Dense GeGLU branch + routed experts, each with its own post-norm; input is the post-attention residual."""
    eps = cfg.rms_eps
    dense = ffn_block(rms_norm(h, p["ffn_norm"], eps, cfg.kernels), p, cfg.act)
    # rmsnorm(h) * n_embd^-0.5 * scale as one product with the folded [D] vector: left as two, XLA folds them itself
    # only where that saves work (T > 1), which made a row's router input depend on the step's row count
    scale = p["ffn_gate_inp_scale"] * np.float32(1.0 / np.sqrt(np.float32(cfg.d_model)))
    router_in = rms_norm(h, None, eps, cfg.kernels) * scale
    gate, up = _expert_weights(p)
    experts = moe_ffn(
        rms_norm(h, p["pre_ffw_norm_2"], eps, cfg.kernels), linear(router_in, p["ffn_gate_inp"]), gate, up, p["ffn_down_exps"],
        cfg.n_expert_used, cfg.act, expert_scale=p.get("ffn_down_exps_scale"),
    )
    return (rms_norm(dense, p["post_ffw_norm_1"], eps, cfg.kernels)
            + rms_norm(experts, p["post_ffw_norm_2"], eps, cfg.kernels))


def per_layer_inputs(params: dict, tokens, e, cfg: ModelConfig):
    """PLE inputs [B, T, L, P] from the token ids and the scaled embeddings e [B, T, D].

    The n_embd^-0.5 and 1/sqrt(2) factors are llama.cpp's; RMS norms downstream make the result nearly blind to them
    (only through eps), while sqrt(P) sets the balance between the two summed parts and does matter."""
    L, P = cfg.n_layers, cfg.ple_dim
    lead = tokens.shape
    tok = lookup(params["per_layer_token_embd"], tokens).reshape(*lead, L, P) * jnp.float32(math.sqrt(P))
    proj = linear(e, params["per_layer_model_proj"]) * jnp.float32(1.0 / math.sqrt(cfg.d_model))
    proj = rms_norm(proj.reshape(*lead, L, P), params["per_layer_proj_norm"], cfg.rms_eps, cfg.kernels)
    return (proj + tok) * jnp.float32(1.0 / math.sqrt(2.0))


def forward_hidden(params: dict, tokens, positions, cache: KVCache, cfg: ModelConfig):
    """tokens/positions [B, T] -> (final-normed hidden [B, T, D], cache with this step's K/V written)."""
    eps = cfg.rms_eps
    act = ACTIVATIONS[cfg.act]
    h = embed(params, tokens, cfg)
    ple = per_layer_inputs(params, tokens, h, cfg) if cfg.ple_dim else None
    ks, vs = list(cache.k), list(cache.v)
    for l, (p, spec) in enumerate(zip(params["layers"], cfg.layers)):
        inv_freq = None
        if not spec.sliding:  # proportional RoPE: speeds divided by the file's freq factors (1e30 = no rotation)
            base = rope_inv_freq(spec.n_rot, spec.rope_base, spec.rope_scale)
            inv_freq = base / params["rope_freqs"][: spec.n_rot // 2]
        x = rms_norm(h, p["attn_norm"], eps, cfg.kernels)
        a = attention_block(p, x, positions, ks, vs, spec, cfg, qk_norm=True, v_norm=True, inv_freq=inv_freq,
                            rows=cache.rows, tree=cache.tree)
        h = h + rms_norm(a, p["post_attention_norm"], eps, cfg.kernels)
        if spec.moe:
            f = moe_block(p, h, cfg)
        else:
            f = ffn_block(rms_norm(h, p["ffn_norm"], eps, cfg.kernels), p, cfg.act)
        h = h + rms_norm(f, p["post_ffw_norm"], eps, cfg.kernels)
        if ple is not None:
            g = act(linear(h, p["inp_gate"])) * ple[:, :, l]
            h = h + rms_norm(linear(g, p["proj"]), p["post_norm"], eps, cfg.kernels)
        if "layer_output_scale" in p:
            h = h * p["layer_output_scale"]
    h = rms_norm(h, params["output_norm"], eps, cfg.kernels)
    return h, stepped(cache, ks, vs, positions)
