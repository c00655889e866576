"""Qwen3 dense (`qwen3`): pre-norm blocks, per-head q/k RMSNorm before NEOX RoPE, SwiGLU, optionally tied output.

Also the shared wiring for the other plain pre-norm architectures: Llama (no q/k norm, NORM RoPE) and Qwen3-MoE
(the FFN replaced by a routed mixture of experts) reuse `tensor_table`, `forward_hidden` and `config_from_metadata`.
"""

from __future__ import annotations

from fucina_jax.models.cache import KVCache, stepped
from fucina_jax.models.config import LayerSpec, ModelConfig, read_hparams
from fucina_jax.models.layers import (
    attention_block, embed, ffn_block, layer_inv_freq, linear, moe_ffn, residual_norm, rms_norm,
)
from fucina_jax.models.loading import TensorSpec, output_specs

ARCH = "qwen3"


def config_from_metadata(md: dict, n_vocab: int, has_output: bool, arch: str = ARCH, **overrides) -> ModelConfig:
    hp = read_hparams(md, arch)
    layers = tuple(
        LayerSpec(
            sliding=False,
            head_dim=hp.head_dim,
            n_kv_heads=hp.n_kv[l],
            ffn_dim=hp.n_ff[l],
            rope_base=hp.rope_base,
            rope_scale=hp.rope_scale,
            n_rot=hp.n_rot,
            kv_slot=l,
            moe=overrides.get("n_expert", 0) > 0,
        )
        for l in range(hp.n_layer)
    )
    return ModelConfig(
        arch=arch,
        n_vocab=n_vocab,
        d_model=hp.n_embd,
        n_heads=hp.n_head,
        rms_eps=hp.eps,
        context_length=hp.ctx,
        layers=layers,
        tied_output=not has_output,
        **overrides,
    )


def tensor_table(cfg: ModelConfig, qk_norm: bool = True, rope_freqs: bool = False):
    """rope_freqs: the file may hold rope_freqs.weight, per-pair divisors of the RoPE speeds (llama: Llama 3's rope
    scaling, which its converter writes as this tensor, not as metadata; llama.cpp reads it for every layer)."""
    D = cfg.d_model
    glob = output_specs(cfg)
    if rope_freqs:
        glob.append(TensorSpec("rope_freqs", "rope_freqs.weight", (cfg.layers[0].n_rot // 2,), optional=True))

    def layer(l: int) -> list[TensorSpec]:
        s = cfg.layers[l]
        H, K, Dh, F = cfg.n_heads, s.n_kv_heads, s.head_dim, s.ffn_dim
        specs = [
            TensorSpec("attn_norm", "blk.{l}.attn_norm.weight", (D,)),
            TensorSpec("attn_q", "blk.{l}.attn_q.weight", (H * Dh, D)),
            TensorSpec("attn_k", "blk.{l}.attn_k.weight", (K * Dh, D)),
            TensorSpec("attn_v", "blk.{l}.attn_v.weight", (K * Dh, D)),
            TensorSpec("attn_output", "blk.{l}.attn_output.weight", (D, H * Dh)),
            TensorSpec("ffn_norm", "blk.{l}.ffn_norm.weight", (D,)),
        ]
        if qk_norm:
            specs += [
                TensorSpec("attn_q_norm", "blk.{l}.attn_q_norm.weight", (Dh,)),
                TensorSpec("attn_k_norm", "blk.{l}.attn_k_norm.weight", (Dh,)),
            ]
        if s.moe:
            E, Fe = cfg.n_expert, cfg.expert_ffn_dim
            specs += [
                TensorSpec("ffn_gate_inp", "blk.{l}.ffn_gate_inp.weight", (E, D)),
                TensorSpec("ffn_gate_exps", "blk.{l}.ffn_gate_exps.weight", (E, Fe, D)),
                TensorSpec("ffn_up_exps", "blk.{l}.ffn_up_exps.weight", (E, Fe, D)),
                TensorSpec("ffn_down_exps", "blk.{l}.ffn_down_exps.weight", (E, D, Fe)),
            ]
        else:
            specs += [
                TensorSpec("ffn_gate", "blk.{l}.ffn_gate.weight", (F, D)),
                TensorSpec("ffn_up", "blk.{l}.ffn_up.weight", (F, D)),
                TensorSpec("ffn_down", "blk.{l}.ffn_down.weight", (D, F)),
            ]
        return specs

    return glob, layer


def ffn(p: dict, x, spec: LayerSpec, cfg: ModelConfig):
    if spec.moe:
        return moe_ffn(
            x, linear(x, p["ffn_gate_inp"]), p["ffn_gate_exps"], p["ffn_up_exps"], p["ffn_down_exps"],
            cfg.n_expert_used, cfg.act,
        )
    return ffn_block(x, p, cfg.act)


def forward_hidden(params: dict, tokens, positions, cache: KVCache, cfg: ModelConfig, qk_norm: bool = True):
    """tokens/positions [B, T] -> (final-normed hidden [B, T, D], cache with this step's K/V written)."""
    h = embed(params, tokens, cfg)
    ks, vs = list(cache.k), list(cache.v)
    layers, eps = params["layers"], cfg.rms_eps
    x = rms_norm(h, layers[0]["attn_norm"], eps, cfg.kernels)
    for i, (p, spec) in enumerate(zip(layers, cfg.layers)):
        inv_freq = layer_inv_freq(spec) / params["rope_freqs"] if "rope_freqs" in params else None
        a = attention_block(p, x, positions, ks, vs, spec, cfg, qk_norm=qk_norm, inv_freq=inv_freq,
                            rows=cache.rows, tree=cache.tree)
        h, x = residual_norm(h, a, None, p["ffn_norm"], eps, cfg.kernels)
        nxt = layers[i + 1]["attn_norm"] if i + 1 < len(layers) else params["output_norm"]
        h, x = residual_norm(h, ffn(p, x, spec, cfg), None, nxt, eps, cfg.kernels)
    return x, stepped(cache, ks, vs, positions)
