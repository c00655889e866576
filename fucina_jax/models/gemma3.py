"""Gemma 3 (`gemma3`): 5 sliding : 1 global layers, sandwich norms, sqrt(D) embedding scale, GeGLU, tied output.

Quirks as llama.cpp runs them (src/models/gemma3.cpp, llama-model.cpp):
- GGUF norm weights already include Gemma's +1; they are used as stored.
- Layer il is sliding iff il % 6 < 5 (llama.cpp hard-codes set_swa_pattern(6)); no window key -> all global.
- Sliding layers use RoPE base 10000 and no scaling whatever the file says; global layers use rope.freq_base and
  the linear scaling factor.
- Q is scaled by 1/sqrt(head_dim), except the 27B (62 layers) which uses 1/sqrt(n_embd / n_head).
"""

from __future__ import annotations

import math

from fucina_jax.models.cache import KVCache, stepped
from fucina_jax.models.config import LayerSpec, ModelConfig, read_hparams
from fucina_jax.models.layers import attention_block, embed, ffn_block, residual_norm, rms_norm
from fucina_jax.models.loading import TensorSpec, output_specs

ARCH = "gemma3"
SWA_PERIOD = 6
SWA_ROPE_BASE = 10000.0


def config_from_metadata(md: dict, n_vocab: int, has_output: bool) -> ModelConfig:
    hp = read_hparams(md, ARCH)
    attn_scale = 1.0 / math.sqrt(hp.n_embd / hp.n_head) if hp.n_layer == 62 else 1.0 / math.sqrt(hp.head_dim)
    layers = []
    for l in range(hp.n_layer):
        sliding = hp.window > 0 and l % SWA_PERIOD < SWA_PERIOD - 1
        layers.append(
            LayerSpec(
                sliding=sliding,
                head_dim=hp.head_dim,
                n_kv_heads=hp.n_kv[l],
                ffn_dim=hp.n_ff[l],
                rope_base=SWA_ROPE_BASE if sliding else hp.rope_base,
                rope_scale=1.0 if sliding else hp.rope_scale,
                n_rot=hp.n_rot,
                kv_slot=l,
                attn_scale=attn_scale,
            )
        )
    return ModelConfig(
        arch=ARCH,
        n_vocab=n_vocab,
        d_model=hp.n_embd,
        n_heads=hp.n_head,
        rms_eps=hp.eps,
        context_length=hp.ctx,
        layers=tuple(layers),
        window=hp.window,
        act="gelu",
        embed_scale=math.sqrt(hp.n_embd),
        final_softcap=hp.softcap,
        tied_output=not has_output,
    )


def tensor_table(cfg: ModelConfig):
    D = cfg.d_model
    glob = output_specs(cfg)

    def layer(l: int) -> list[TensorSpec]:
        s = cfg.layers[l]
        H, K, Dh, F = cfg.n_heads, s.n_kv_heads, s.head_dim, s.ffn_dim
        return [
            TensorSpec("attn_norm", "blk.{l}.attn_norm.weight", (D,)),
            TensorSpec("attn_q", "blk.{l}.attn_q.weight", (H * Dh, D)),
            TensorSpec("attn_k", "blk.{l}.attn_k.weight", (K * Dh, D)),
            TensorSpec("attn_v", "blk.{l}.attn_v.weight", (K * Dh, D)),
            TensorSpec("attn_q_norm", "blk.{l}.attn_q_norm.weight", (Dh,)),
            TensorSpec("attn_k_norm", "blk.{l}.attn_k_norm.weight", (Dh,)),
            TensorSpec("attn_output", "blk.{l}.attn_output.weight", (D, H * Dh)),
            TensorSpec("post_attention_norm", "blk.{l}.post_attention_norm.weight", (D,)),
            TensorSpec("ffn_norm", "blk.{l}.ffn_norm.weight", (D,)),
            TensorSpec("ffn_gate", "blk.{l}.ffn_gate.weight", (F, D)),
            TensorSpec("ffn_up", "blk.{l}.ffn_up.weight", (F, D)),
            TensorSpec("ffn_down", "blk.{l}.ffn_down.weight", (D, F)),
            TensorSpec("post_ffw_norm", "blk.{l}.post_ffw_norm.weight", (D,)),
        ]

    return glob, layer


def forward_hidden(params: dict, tokens, positions, cache: KVCache, cfg: ModelConfig):
    h = embed(params, tokens, cfg)
    ks, vs = list(cache.k), list(cache.v)
    layers, eps = params["layers"], cfg.rms_eps
    x = rms_norm(h, layers[0]["attn_norm"], eps, cfg.kernels)
    for i, (p, spec) in enumerate(zip(layers, cfg.layers)):
        a = attention_block(p, x, positions, ks, vs, spec, cfg, qk_norm=True, rows=cache.rows, tree=cache.tree)
        h, x = residual_norm(h, a, p["post_attention_norm"], p["ffn_norm"], eps, cfg.kernels)
        nxt = layers[i + 1]["attn_norm"] if i + 1 < len(layers) else params["output_norm"]
        h, x = residual_norm(h, ffn_block(x, p, cfg.act), p["post_ffw_norm"], nxt, eps, cfg.kernels)
    return x, stepped(cache, ks, vs, positions)
