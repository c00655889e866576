"""Tiny random-weight Gemma 4 GGUFs, one per text variant, that llama.cpp (0.3.36) loads and runs.

Each variant copies the configuration *pattern* of a released Gemma 4 model at tiny sizes:

  dense  31B-style: sliding/global mix ([S,S,F]x2), per-layer head_count_kv (2 sliding / 1 global), global heads
         twice as wide (64 vs 32) with K=V (no attn_v) and proportional RoPE (rope_freqs = [1]*8 + [1e30]*24: a
         quarter of the pairs rotate), value norm, layer_output_scale, final softcap 30.
  moe    26B-A4B-style: the same attention, every layer a dense GeGLU branch in parallel with 16 experts top-4 (router
         scale, per-expert scale, fused ffn_gate_up_exps, pre_ffw_norm_2 / post_ffw_norm_1 / post_ffw_norm_2).
  e2b    E2B-style: (S,S,S,S,F) then 2 KV-shared layers (S,F) reading donors 3 (sliding) and 4 (global), per-layer
         embeddings (P = 16), double-wide FFN on the shared layers (per-layer feed_forward_length array), 1 kv head,
         attn_v present.
  e4b    E4B-style: (S x5, F) then 2 KV-shared layers (S,F) reading donors 4 and 5, per-layer embeddings, 2 kv heads,
         one FFN width.

Stacks are short (6-8 layers) on purpose: llama.cpp's CPU GELU rounds through an fp16 table, and a last-bit difference
that lands on an fp16 rounding boundary becomes a 5e-4 jump; those flips cascade with depth (measured: the median
per-position logit difference against llama.cpp, with the table emulated, grows from ~1e-4 at 6 layers to ~2e-3 at
12), which would blur the parity bound. The sliding window is 8, so 64 positions cross it many times. Embedding widths
64/80/96 make sqrt(n_embd) exact (64) or not bf16-representable (80, 96), so a parity test can tell whether the
reference rounds that scale.

The vocabulary is a small Gemma 4-style one (`tokenizer.ggml.model = "gemma4"`: specials at their real ids, newline
runs at 107.., byte tokens <0x00>.. at 238.., U+2581 for spaces, a few BPE merges); llama.cpp needs only tokens and
merges for it to load.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from fucina_jax.testing.fixtures import add_tensors

__all__ = ["Gemma4FixtureSpec", "GEMMA4_VARIANTS", "gemma4_vocab", "write_gemma4_fixture"]

S, F = True, False  # sliding / global entries of attention.sliding_window_pattern


@dataclass(frozen=True)
class Gemma4FixtureSpec:
    pattern: tuple[bool, ...]  # per layer, True = sliding
    n_embd: int = 64
    n_head: int = 4
    n_kv_swa: int = 2
    n_kv_global: int = 1
    head_dim_swa: int = 32
    head_dim_global: int = 64
    rotary_pairs_global: int = 8  # pairs of a global head that rotate (partial_rotary_factor 0.25 of 32 pairs)
    window: int = 8
    n_ff: int = 128
    n_ff_shared: int = 0  # FFN width of KV-shared layers (E2B's double-wide MLP); 0 = same as n_ff
    k_eq_v: bool = False  # global layers without attn_v
    n_expert: int = 0
    n_expert_used: int = 0
    expert_ff: int = 0
    fused_gate_up: bool = True  # ffn_gate_up_exps (as converted files have) or separate ffn_gate_exps/ffn_up_exps
    ple_dim: int = 0
    shared_kv_layers: int = 0
    softcap: float = 30.0
    rope_base: float = 1_000_000.0
    rope_base_swa: float = 10_000.0
    eps: float = 1e-6
    ctx: int = 512
    n_vocab: int = 640

    @property
    def n_layer(self) -> int:
        return len(self.pattern)


GEMMA4_VARIANTS: dict[str, Gemma4FixtureSpec] = {
    "dense": Gemma4FixtureSpec(pattern=(S, S, F) * 2, k_eq_v=True),
    "moe": Gemma4FixtureSpec(
        pattern=(S, S, F) * 2, n_embd=80, k_eq_v=True, n_ff=64, n_expert=16, n_expert_used=4, expert_ff=32
    ),
    "e2b": Gemma4FixtureSpec(
        pattern=(S, S, S, S, F, S, F), n_embd=96, n_kv_swa=1, n_kv_global=1, n_ff=96, n_ff_shared=192, ple_dim=16,
        shared_kv_layers=2,
    ),
    "e4b": Gemma4FixtureSpec(
        pattern=(S, S, S, S, S, F, S, F), n_kv_swa=2, n_kv_global=2, ple_dim=16, shared_kv_layers=2
    ),
}

# Gemma 4's control tokens at their real ids (the rest of 0..237 are <unusedN> controls like the real file's).
_SPECIALS = {0: "<pad>", 1: "<eos>", 2: "<bos>", 3: "<unk>", 4: "<mask>", 105: "<|turn>", 106: "<turn|>"}
_NEWLINES = range(107, 138)  # "\n" * 1..31
_BYTES = 238  # <0x00>..<0xFF> at 238..493
_NORMAL, _CONTROL, _UNUSED, _BYTE = 1, 3, 5, 6
_MERGES = [("▁", "t"), ("h", "e"), ("▁t", "he"), ("i", "n"), ("e", "r"), ("▁", "a"), ("o", "n"), ("▁", "s"),
           ("a", "t"), ("e", "n")]


def gemma4_vocab(n_vocab: int = 640) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of a small Gemma 4-style vocabulary padded to n_vocab."""
    tokens, types = [], []
    for i in range(_BYTES + 256):
        if i in _SPECIALS:
            tokens.append(_SPECIALS[i])
            types.append(_CONTROL)
        elif i in _NEWLINES:
            tokens.append("\n" * (i - _NEWLINES[0] + 1))
            types.append(_NORMAL)
        elif i >= _BYTES:
            tokens.append(f"<0x{i - _BYTES:02X}>")
            types.append(_BYTE)
        else:
            tokens.append(f"<unused{i}>")
            types.append(_CONTROL)
    for c in ["▁"] + [chr(c) for c in range(0x21, 0x7F)]:
        tokens.append(c)
        types.append(_NORMAL)
    merges = []
    for a, b in _MERGES:
        tokens.append(a + b)
        types.append(_NORMAL)
        merges.append(f"{a} {b}")
    if len(tokens) > n_vocab:
        raise ValueError(f"n_vocab {n_vocab} is smaller than the {len(tokens)} tokens of the base vocabulary")
    while len(tokens) < n_vocab:
        tokens.append(f"<unused{len(tokens)}>")
        types.append(_UNUSED)
    return tokens, types, merges


def _layer_ff(spec: Gemma4FixtureSpec) -> list[int]:
    first_shared = spec.n_layer - spec.shared_kv_layers
    return [spec.n_ff_shared if (spec.n_ff_shared and l >= first_shared) else spec.n_ff for l in range(spec.n_layer)]


def _metadata(spec: Gemma4FixtureSpec) -> dict:
    """gemma4.* hyper-parameters, in the forms llama.cpp's converter writes them (arrays where layers differ)."""
    kv = [spec.n_kv_swa if s else spec.n_kv_global for s in spec.pattern]
    ff = _layer_ff(spec)
    md = {
        "context_length": spec.ctx,
        "embedding_length": spec.n_embd,
        "block_count": spec.n_layer,
        "feed_forward_length": ff if len(set(ff)) > 1 else ff[0],
        "attention.head_count": spec.n_head,
        "attention.head_count_kv": kv if len(set(kv)) > 1 else kv[0],
        "attention.key_length": spec.head_dim_global,
        "attention.value_length": spec.head_dim_global,
        "attention.key_length_swa": spec.head_dim_swa,
        "attention.value_length_swa": spec.head_dim_swa,
        "rope.dimension_count": spec.head_dim_global,
        "rope.dimension_count_swa": spec.head_dim_swa,
        "rope.freq_base": spec.rope_base,
        "rope.freq_base_swa": spec.rope_base_swa,
        "attention.layer_norm_rms_epsilon": spec.eps,
        "attention.sliding_window": spec.window,
        "attention.sliding_window_pattern": list(spec.pattern),
        "embedding_length_per_layer_input": spec.ple_dim,
        "final_logit_softcapping": spec.softcap,
    }
    if spec.shared_kv_layers:
        md["attention.shared_kv_layers"] = spec.shared_kv_layers
    if spec.n_expert:
        md["expert_count"] = spec.n_expert
        md["expert_used_count"] = spec.n_expert_used
        md["expert_feed_forward_length"] = spec.expert_ff
    return md


def _weights(spec: Gemma4FixtureSpec, rng: np.random.Generator) -> dict[str, np.ndarray]:
    D, H, V, L, P = spec.n_embd, spec.n_head, spec.n_vocab, spec.n_layer, spec.ple_dim
    first_shared = L - spec.shared_kv_layers

    def mat(*shape, scale=1.0):  # fan-in scaled: unit-RMS inputs give outputs of RMS ~scale
        return (rng.standard_normal(shape) * scale / np.sqrt(shape[-1])).astype(np.float32)

    def norm(n):  # Gemma 4 stores raw norm weights (no +1): values around 1
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    # Tied output: logits = h . token_embd rows with h of unit RMS; std 0.5 spreads logits over ~0.5 sqrt(D) = 4-5
    # units, so a 1e-2 difference (llama.cpp's fp16 GELU table) rarely meets a near-tie at the argmax.
    t = {"token_embd.weight": (rng.standard_normal((V, D)) * 0.5).astype(np.float32), "output_norm.weight": norm(D)}
    if not all(spec.pattern):
        half = spec.head_dim_global // 2
        t["rope_freqs.weight"] = np.where(np.arange(half) < spec.rotary_pairs_global, 1.0, 1e30).astype(np.float32)
    if P:
        t["per_layer_token_embd.weight"] = (rng.standard_normal((V, L * P)) * 0.5).astype(np.float32)
        t["per_layer_model_proj.weight"] = mat(L * P, D)
        t["per_layer_proj_norm.weight"] = norm(P)
    ff = _layer_ff(spec)
    for l, sliding in enumerate(spec.pattern):
        p = f"blk.{l}."
        Dh = spec.head_dim_swa if sliding else spec.head_dim_global
        K = spec.n_kv_swa if sliding else spec.n_kv_global
        t[p + "attn_norm.weight"] = norm(D)
        t[p + "attn_q.weight"] = mat(H * Dh, D)
        # Attention scale is 1.0 in Gemma 4: q/k norm weights of (2/Dh)^(1/4) give q.k scores of std ~1.4 instead
        # of sqrt(Dh), i.e. soft attention rather than a near-argmax that turns last-bit differences into jumps.
        qk = (2.0 / Dh) ** 0.25
        t[p + "attn_q_norm.weight"] = norm(Dh) * np.float32(qk)
        if l < first_shared:  # shared-KV layers have no K/V projections
            t[p + "attn_k.weight"] = mat(K * Dh, D)
            t[p + "attn_k_norm.weight"] = norm(Dh) * np.float32(qk)
            if sliding or not spec.k_eq_v:
                t[p + "attn_v.weight"] = mat(K * Dh, D)
        t[p + "attn_output.weight"] = mat(D, H * Dh)
        t[p + "post_attention_norm.weight"] = norm(D)
        t[p + "ffn_norm.weight"] = norm(D)
        t[p + "ffn_gate.weight"] = mat(ff[l], D)
        t[p + "ffn_up.weight"] = mat(ff[l], D)
        t[p + "ffn_down.weight"] = mat(D, ff[l])
        t[p + "post_ffw_norm.weight"] = norm(D)
        t[p + "layer_output_scale.weight"] = rng.uniform(0.6, 1.2, 1).astype(np.float32)
        if spec.n_expert:
            E, Fe = spec.n_expert, spec.expert_ff
            # Router logits of RMS ~3: clear top-k margins, so near-ties between experts are rare.
            t[p + "ffn_gate_inp.weight"] = mat(E, D, scale=3.0 * np.sqrt(D))  # its input has RMS D^-0.5
            t[p + "ffn_gate_inp.scale"] = norm(D)
            t[p + "pre_ffw_norm_2.weight"] = norm(D)
            t[p + "post_ffw_norm_1.weight"] = norm(D)
            t[p + "post_ffw_norm_2.weight"] = norm(D)
            gate_up = mat(E, 2 * Fe, D)  # rows [0, Fe) gate, [Fe, 2 Fe) up
            if spec.fused_gate_up:
                t[p + "ffn_gate_up_exps.weight"] = gate_up
            else:
                t[p + "ffn_gate_exps.weight"] = np.ascontiguousarray(gate_up[:, :Fe])
                t[p + "ffn_up_exps.weight"] = np.ascontiguousarray(gate_up[:, Fe:])
            t[p + "ffn_down_exps.weight"] = mat(E, D, Fe)
            t[p + "ffn_down_exps.scale"] = rng.uniform(0.5, 1.5, E).astype(np.float32)
        if P:
            t[p + "inp_gate.weight"] = mat(P, D)
            t[p + "proj.weight"] = mat(D, P)
            t[p + "post_norm.weight"] = norm(D)
    return t


def write_gemma4_fixture(path: str | os.PathLike, variant: str = "dense", seed: int = 0,
                         spec: Gemma4FixtureSpec | None = None, drop_keys: tuple[str, ...] = (),
                         qtype: str | None = None) -> str:
    """Write the tiny Gemma 4 `variant` (a key of GEMMA4_VARIANTS, or `spec`) to path; returns the path.

    drop_keys: gemma4.* metadata keys (without the prefix) to leave out, for tests of loader defaults and errors.
    qtype: quantize the matmul weights (fixtures.add_tensors); default F32.
    Weights are deterministic for (variant, seed).
    """
    import gguf

    if spec is None:
        if variant not in GEMMA4_VARIANTS:
            raise ValueError(f"unknown Gemma 4 fixture variant {variant!r}; choose from {sorted(GEMMA4_VARIANTS)}")
        spec = GEMMA4_VARIANTS[variant]
    tokens, types, merges = gemma4_vocab(spec.n_vocab)
    tensors = _weights(spec, np.random.default_rng(seed))

    path = os.fspath(path)
    w = gguf.GGUFWriter(path, "gemma4")
    w.add_name(f"fucina_jax tiny gemma4 {variant}")
    for key, value in _metadata(spec).items():
        if key in drop_keys:
            continue
        key = f"gemma4.{key}"
        if isinstance(value, list):
            w.add_array(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_uint32(key, value)
    w.add_tokenizer_model("gemma4")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(2)
    w.add_eos_token_id(106)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(False)
    add_tensors(w, tensors, qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
