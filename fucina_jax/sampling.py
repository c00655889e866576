"""The sampler pipeline: llama.cpp's default chain for penalties, top-k, top-p, min-p and temperature, in JAX.

Order and semantics are those of llama.cpp's sampler chain (common/sampling.cpp, src/llama-sampler.cpp):

  penalties -> top_k -> top_p -> min_p -> temperature -> dist

  penalties    over the last `repeat_last_n` committed tokens (0: off; -1: the whole context, as llama.cpp's
               --repeat-last-n documented until recent versions, which reject -1): a token seen c > 0 times gets
               its logit divided by `repeat_penalty` if positive, multiplied if <= 0, then minus
               c * frequency + presence.
  top_k        keep the k largest logits (k <= 0: off; k > V: V).
  top_p        softmax over the survivors, keep the shortest descending prefix whose cumulative probability
               reaches top_p (top_p >= 1: off), never fewer than min_keep.
  min_p        keep logits >= max_logit + log(min_p), i.e. p >= min_p * p_max (min_p <= 0: off), >= min_keep.
  temperature  divide logits by it; temperature <= 0 keeps only the argmax (greedy, through the same chain).
  dist         draw one token from the softmax of the survivors.

The filters only ever remove the tail of the descending order, so the survivors are a prefix of the row sorted by
logit. The pipeline therefore sorts once (the top `cap` candidates: `cap` a static bucket >= top_k, or
TOP_K_OFF_CAP when top-k is off, with a full sort of the vocab for rows whose survivors do not fit) and expresses
top-k, top-p and min-p as prefix lengths. Greedy rows skip the sort (argmax). Ties are ordered lower token id first;
llama.cpp leaves the order of equal logits to std::partial_sort (unspecified), which only matters where a cut falls
inside a run of equal logits (top-k, top-p) and for which of several equal maxima greedy picks.

Randomness is counter-based: the uniform that picks the token committed at absolute position p is
uniform(fold_in(key(seed), p)), one draw per committed token, mapped through the inverse CDF of the survivors in
descending order (as llama.cpp's dist does with its mt19937 draw). A verify row committed at position base + i uses
that position, so a speculative run draws exactly what the plain run draws (design record §2, obligation 1). The
stream differs from llama.cpp's mt19937 for the same seed; only greedy output is comparable token for token.

Penalty history is a fixed-capacity window (`History`), so a growing history never changes a traced shape. For a
verify over R rows, row i is penalised with history + drafts[:i]: accepted drafts enter the history before the next
row is sampled (design record §2, obligation 3), all rows in one jitted call. Rows run one at a time through the
same per-row program (lax.map): a row's token cannot depend on its batch, and temporaries stay [V]-sized.

Everything a call varies (temperature, top-p, seed, history contents, positions) enters jit as arrays
(`SamplerParams`, `History`); only the candidate bucket `cap` is static.
"""

from __future__ import annotations

import dataclasses
import math
import os
import secrets
from functools import partial
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fucina_jax import aot
from fucina_jax.checks import is_int, is_real
from fucina_jax.errors import SamplerConfigError

__all__ = [
    "SamplerConfig",
    "SamplerParams",
    "validated_config",
    "History",
    "TOP_K_OFF_CAP",
    "GREEDY_UNPENALIZED",
    "history_from_tokens",
    "push_history",
    "row_windows",
    "penalize",
    "filter_mask",
    "fused_candidates",
    "logits_cap",
    "greedy_pick",
    "position_uniform",
    "sample_rows",
    "sample_row",
    "sample_candidates",
    "token_probs",
    "top_k",
    "widen_cap",
]


# sample_rows works on all rows at once up to this many bytes of logits (8 rows of a 262k vocab), one row at a time
# beyond: a few [R, V] temporaries past glibc's mmap threshold come back as fresh pages on every call, and the page
# faults cost more than the sampling (measured: 12 ms instead of 2 ms for 8 rows at V = 262k).
_BATCH_BYTES = 8 << 20

# Candidates sorted when top-k is off. top_p 0.95 / min_p 0.05 leave far fewer on real LM rows; a row with more
# survivors (e.g. top-k, top-p and min-p all off) costs a full sort: ~60 ms for a 262k vocab on one CPU core,
# against ~1 ms for the top 1024.
TOP_K_OFF_CAP = 1024

# The candidate cap of a greedy config whose penalties leave every logit as it is (SamplerConfig.candidate_cap): the
# token is the argmax of the raw logits, which the decoder's step may take in the output layer's kernel without
# writing the logits out (engine.decode_sample_rows_step). 0 is the cap of a greedy config with penalties.
# FUCINA_FUSED_PICK=0 (read at import) keeps every greedy step on the logits path: the same tokens, for measuring.
GREEDY_UNPENALIZED = -1
_FUSED_PICK = os.environ.get("FUCINA_FUSED_PICK", "1") != "0"

# Caps below -1 are sampled configs whose penalties are neutral and whose top-k is on: cap -c means that the top c
# candidates of the raw logits (c >= 2, a power of two, below the vocabulary, at least top_k) decide every token, so
# the decoder's step may take them in the output layer's kernel too (engine.decode_sample_rows_step,
# sample_candidates). Where logits are at hand instead, such a cap samples as cap c does (logits_cap): the same tokens.


def fused_candidates(cap: int) -> int | None:
    """The candidates a fused step takes in the output layer's kernel for this cap: 0 for GREEDY_UNPENALIZED (the
    pick alone), c for a fused sampled cap -c, None when the step needs the logits."""
    if cap == GREEDY_UNPENALIZED:
        return 0
    return -cap if cap < GREEDY_UNPENALIZED else None


def logits_cap(cap: int) -> int:
    """The cap that samples logits as `cap` does: -c -> c (GREEDY_UNPENALIZED and caps >= 0 are themselves)."""
    return -cap if cap < GREEDY_UNPENALIZED else cap


def widen_cap(a: int, b: int) -> int:
    """A cap that gives the tokens of both caps' configs: two fused caps stay fused (the wider candidate count;
    a fused sampled step picks greedy rows by the same argmax), otherwise the logits path with the wider count."""
    ca, cb = fused_candidates(a), fused_candidates(b)
    if ca is not None and cb is not None:
        return -max(ca, cb) if max(ca, cb) else GREEDY_UNPENALIZED
    return max(logits_cap(a), logits_cap(b))

# Penalty windows up to this many slots count repeats pairwise ([R, H, H]); longer ones use a vocab histogram.
_PAIRWISE_MAX_WINDOW = 256

# llama.cpp's LLAMA_DEFAULT_SEED (0xFFFFFFFF) means "pick a random seed"; we spell that None.
_MAX_SEED = 2**32 - 1

# top_k, min_keep and repeat_last_n travel as int32; larger values mean the same as this one (the whole vocab, every
# token, the whole context), so params() clamps them.
_MAX_INT32 = 2**31 - 1


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class SamplerConfig:
    """Sampling parameters with llama.cpp's defaults (common/common.h, common_params_sampling).

    top_k 0 = off; top_p 1.0 = off; min_p 0.0 = off; repeat_penalty 1.0 / frequency 0.0 / presence 0.0 = off;
    repeat_last_n 0 = penalties off, -1 = the whole context; temperature <= 0 = greedy argmax.
    min_keep: top-p and min-p never keep fewer tokens (llama.cpp's --min-keep, default 0).
    seed None = a fresh random seed, fixed by validate().
    """

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    min_keep: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def penalties_neutral(self) -> bool:
        """Whether the penalties sampler leaves every logit bitwise as it is (see penalize)."""
        return self.repeat_last_n == 0 or (self.repeat_penalty == 1.0 and self.frequency_penalty == 0.0
                                           and self.presence_penalty == 0.0)

    def validate(self) -> SamplerConfig:
        """Check every value; return the config with a concrete seed (a random one when seed is None)."""

        def bad(name: str, value, why: str) -> SamplerConfigError:
            return SamplerConfigError(f"{name} = {value!r} is invalid: {why}")

        def f32_finite(v, reciprocal: bool = False) -> bool:
            # The pipeline computes in float32 (as llama.cpp does): 1e39 or 1 / 1e-45 overflow there.
            with np.errstate(over="ignore", divide="ignore"):
                x = np.float32(v)
                return math.isfinite(v) and bool(np.isfinite(np.float32(1.0) / x if reciprocal else x))

        for name in ("temperature", "top_p", "min_p", "repeat_penalty", "frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            if not is_real(v) or not f32_finite(v):
                raise bad(name, v, "it must be a finite (float32) number")
        for name in ("top_k", "repeat_last_n", "min_keep"):
            if not is_int(getattr(self, name)):
                raise bad(name, getattr(self, name), "it must be an integer")
        if self.top_k < 0:
            raise bad("top_k", self.top_k, "it must be >= 0 (0 disables top-k)")
        if not 0.0 <= self.top_p <= 1.0:
            raise bad("top_p", self.top_p, "it must be in [0, 1] (1 disables top-p)")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", self.min_p, "it must be in [0, 1] (0 disables min-p)")
        # llama.cpp rejects these too (common_sampler_init): 1/penalty must stay finite.
        if self.repeat_penalty <= 0.0:
            raise bad("repeat_penalty", self.repeat_penalty, "it must be > 0 (1 disables it)")
        if not f32_finite(self.repeat_penalty, reciprocal=True):  # logits are multiplied by its float32 reciprocal
            raise bad("repeat_penalty", self.repeat_penalty, "its reciprocal overflows float32 (use >= 3e-39)")
        if self.repeat_last_n < -1:
            raise bad("repeat_last_n", self.repeat_last_n, "it must be >= -1 (0 disables penalties, -1 = context)")
        if self.min_keep < 0:
            raise bad("min_keep", self.min_keep, "it must be >= 0")
        if self.seed is None:
            return dataclasses.replace(self, seed=secrets.randbelow(_MAX_SEED + 1))
        if not is_int(self.seed) or not 0 <= self.seed <= _MAX_SEED:
            raise bad("seed", self.seed, f"it must be an integer in [0, {_MAX_SEED}] (or None for a random seed)")
        return self

    def params(self) -> SamplerParams:
        """The per-call values as 0-d arrays (validates first; call validate() once yourself if seed is None,
        or every call draws a new random seed)."""
        c = self.validate()
        f32, i32 = np.float32, np.int32
        return jax.device_put(SamplerParams(  # device_put of host values: a copy, no compiled op (start-up cost)
            temperature=np.asarray(c.temperature, f32),
            top_k=np.asarray(min(c.top_k, _MAX_INT32), i32),
            top_p=np.asarray(c.top_p, f32),
            min_p=np.asarray(c.min_p, f32),
            min_keep=np.asarray(min(c.min_keep, _MAX_INT32), i32),
            repeat_penalty=np.asarray(c.repeat_penalty, f32),
            repeat_last_n=np.asarray(min(c.repeat_last_n, _MAX_INT32), i32),
            frequency_penalty=np.asarray(c.frequency_penalty, f32),
            presence_penalty=np.asarray(c.presence_penalty, f32),
            seed=np.asarray(c.seed, np.uint32),
        ))

    def candidate_cap(self, n_vocab: int) -> int:
        """Static number of sorted candidates: top_k rounded up to a power of two (so nearby top_k values share a
        compiled program), or TOP_K_OFF_CAP when top-k is off (rows whose survivors do not fit fall back to a
        full sort of the vocab). Any cap gives the same tokens; it only sets the cost. A greedy config
        (temperature <= 0) gets 0: the compiled step then holds only the argmax, not the sampling pipeline (whose
        tracing and lowering alone take ~0.3 s at start-up), or GREEDY_UNPENALIZED (-1) when its penalties are neutral
        too: the argmax of the raw logits. A sampled config with neutral penalties and top-k on gets -cap (see
        fused_candidates). Caps only widen (a decoder steps with widen_cap of its rows' caps), and every cap a
        config can be widened to gives its tokens."""
        if self.temperature <= 0.0:
            return GREEDY_UNPENALIZED if self.penalties_neutral and _FUSED_PICK else 0
        if self.top_k <= 0:
            return min(int(n_vocab), TOP_K_OFF_CAP)
        cap = min(int(n_vocab), _pow2_at_least(self.top_k))
        # neutral penalties: the top `cap` raw logits decide the token (fused_candidates)
        return -max(cap, 2) if self.penalties_neutral and _FUSED_PICK and max(cap, 2) < n_vocab else cap

    def history_capacity(self, n_ctx: int) -> int:
        """Static window size that holds the last repeat_last_n tokens (the whole context for -1), never more than
        the context: a stream never holds more than n_ctx tokens, so a longer window penalises the same ones."""
        if self.repeat_last_n < 0:
            return int(n_ctx)
        return min(_pow2_at_least(max(1, self.repeat_last_n)), int(n_ctx))


def validated_config(sampler: SamplerConfig | None) -> SamplerConfig:
    """`sampler` validated (None = SamplerConfig()); anything but a SamplerConfig is a TypeError."""
    if sampler is None:
        return SamplerConfig().validate()
    if not isinstance(sampler, SamplerConfig):
        raise TypeError(f"sampler must be a SamplerConfig (or None for the defaults), got {type(sampler).__name__} "
                        f"{sampler!r}: e.g. sampler=SamplerConfig(temperature=0) for greedy decoding")
    return sampler.validate()


class SamplerParams(NamedTuple):
    """SamplerConfig's values as 0-d arrays: a pytree, so new values never recompile."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    min_keep: jax.Array
    repeat_penalty: jax.Array
    repeat_last_n: jax.Array
    frequency_penalty: jax.Array
    presence_penalty: jax.Array
    seed: jax.Array


class History(NamedTuple):
    """The most recent committed tokens, oldest first: tokens[:count] valid, the rest -1.

    tokens int32 [W] (W fixed: a window, not the whole stream, once more than W tokens were committed), count int32 [].
    """

    tokens: jax.Array
    count: jax.Array


def history_from_tokens(tokens: Sequence[int], capacity: int) -> History:
    """Host-side: the window of the last `capacity` tokens of a committed stream (prompt included, as llama.cpp's
    CLI accepts prompt tokens into the penalty history)."""
    if capacity < 1:
        raise SamplerConfigError(f"history capacity = {capacity} is invalid: it must be >= 1")
    tail = np.asarray(list(tokens)[-capacity:] if len(tokens) else [], dtype=np.int32)
    buf = np.full((capacity,), -1, dtype=np.int32)
    buf[: tail.size] = tail
    return jax.device_put(History(buf, np.asarray(tail.size, np.int32)))


@aot.jit
def push_history(history: History, new: jax.Array, n_new: jax.Array) -> History:
    """Append new[:n_new] (int32 [N]) to the window, dropping the oldest tokens past its capacity. Jittable, so the
    decode loop can keep the history on device."""
    W, N = history.tokens.shape[0], new.shape[0]
    n_new = jnp.clip(n_new, 0, N)
    total = history.count + n_new
    start = jnp.maximum(total - W, 0)
    c = start + jnp.arange(W, dtype=jnp.int32)  # chronological index of each output slot
    old = history.tokens[jnp.clip(c, 0, W - 1)]
    fresh = new.astype(jnp.int32)[jnp.clip(c - history.count, 0, N - 1)]
    tok = jnp.where(c < history.count, old, fresh)
    return History(jnp.where(c < total, tok, -1), jnp.minimum(total, W).astype(jnp.int32))


def row_windows(history: History, drafts: jax.Array | None, repeat_last_n: jax.Array, n_rows: int):
    """Per-row penalty windows for a verify: row i sees history + drafts[:i], cut to its last repeat_last_n tokens
    (and to the window capacity W). drafts [R, D] (a tree verify, engine.tree_paths): row i sees history +
    drafts[i], its own path, -1 past its depth.

    Returns tokens int32 [R, W + D] and a bool mask [R, W + D] (D = len(drafts), 0 without drafts). Chronological
    index: base slot j is j, draft d is count + d; row i's stream has length count + i (a tree's: count + its
    depth).
    """
    W = history.tokens.shape[0]
    R = n_rows
    rows = jnp.arange(R, dtype=jnp.int32)[:, None]
    last_n = jnp.where(repeat_last_n < 0, W, jnp.minimum(repeat_last_n, W))
    if drafts is not None and drafts.ndim == 2:  # a tree: each row's own path, left-aligned
        D = drafts.shape[1]
        own = drafts >= 0
        depth = jnp.sum(own, axis=1, dtype=jnp.int32)[:, None]
        tokens = jnp.concatenate([jnp.broadcast_to(history.tokens, (R, W)), drafts.astype(jnp.int32)], axis=1)
        chron = jnp.concatenate([jnp.arange(W, dtype=jnp.int32), history.count + jnp.arange(D, dtype=jnp.int32)])
        valid = jnp.concatenate([jnp.broadcast_to(jnp.arange(W)[None, :] < history.count, (R, W)), own], axis=1)
        return tokens, valid & (chron[None, :] >= history.count + depth - last_n)
    if drafts is None:
        drafts = jnp.zeros((0,), jnp.int32)
    D = drafts.shape[0]
    tokens = jnp.concatenate(
        [jnp.broadcast_to(history.tokens, (R, W)), jnp.broadcast_to(drafts.astype(jnp.int32), (R, D))], axis=1
    )
    d = jnp.arange(D, dtype=jnp.int32)[None, :]
    chron = jnp.concatenate([jnp.arange(W, dtype=jnp.int32), history.count + jnp.arange(D, dtype=jnp.int32)])
    valid = jnp.concatenate(
        [jnp.broadcast_to(jnp.arange(W)[None, :] < history.count, (R, W)), jnp.broadcast_to(d < rows, (R, D))], axis=1
    )
    # Never more than the last W tokens (-1 = the whole context = W when the window is sized to the context, see
    # SamplerConfig.history_capacity): a sequential run, whose window drops its oldest tokens, sees the same.
    in_window = chron[None, :] >= history.count + jnp.minimum(rows, D) - last_n  # row i's stream: count + min(i, D)
    return tokens, valid & in_window


def penalize(logits: jax.Array, tokens: jax.Array, mask: jax.Array, params: SamplerParams) -> jax.Array:
    """llama.cpp's penalties sampler on logits [R, V] given each row's window (tokens/mask [R, H]).

    A token seen c > 0 times: logit / repeat if logit > 0 else logit * repeat, then - (c * frequency + presence).
    Neutral values (1, 0, 0) leave every logit bitwise unchanged, so no branch is needed to switch it off.
    """
    R, V = logits.shape
    H = tokens.shape[-1]
    ok = mask & (tokens >= 0) & (tokens < V)
    rows = jnp.arange(R)[:, None]
    idx = jnp.where(ok, tokens, V)  # V = out of range, dropped by the scatters

    if H <= _PAIRWISE_MAX_WINDOW:
        # Touch only the window's tokens: counts by pairwise comparison [R, H, H], then write the penalised
        # logits back. Equal tokens write equal values, so duplicate scatter indices are harmless.
        same = (idx[:, :, None] == idx[:, None, :]) & ok[:, None, :]
        counts = jnp.sum(same, axis=-1)
        l = jnp.take_along_axis(logits, jnp.clip(idx, 0, V - 1), axis=-1)
    else:
        # Long windows (repeat_last_n = -1 over a long context): one histogram over the vocab per row.
        hist = jnp.zeros((R, V), jnp.int32).at[rows, idx].add(1, mode="drop")
        counts = jnp.take_along_axis(hist, jnp.clip(idx, 0, V - 1), axis=-1)
        l = jnp.take_along_axis(logits, jnp.clip(idx, 0, V - 1), axis=-1)

    rp = params.repeat_penalty
    l = jnp.where(l <= 0, l * rp, l / rp)
    l = l - (counts.astype(jnp.float32) * params.frequency_penalty
             + (counts > 0).astype(jnp.float32) * params.presence_penalty)
    return logits.at[rows, idx].set(l, mode="drop")


def _cumsum_split(x: jax.Array, split: int) -> jax.Array:
    """cumsum along the last axis whose first `split` entries are computed exactly as for an array of width `split`:
    the fast (top-`split`) and the full-sort paths then agree bitwise on every row the fast path can decide, so the
    token never depends on `cap`."""
    if x.shape[-1] <= split:
        return jnp.cumsum(x, axis=-1)
    head = jnp.cumsum(x[:, :split], axis=-1)
    return jnp.concatenate([head, jnp.cumsum(x[:, split:], axis=-1) + head[:, -1:]], axis=-1)


def _survivors(row, V: int, vals, params: SamplerParams, split: int):
    """Top-k, top-p and min-p as a prefix length of the descending order.

    vals [R, C] are the C largest of logits [R, V], descending; row() returns the logits [R, V] (called only where
    top-p needs the whole row's normaliser, top-k off; row None: the caller knows top-k is on). Returns n_keep [R]
    (survivors = the first n_keep) and exact [R]: whether C entries were enough to decide (else the caller redoes the row with C = V).
    """
    C = vals.shape[-1]
    j = jnp.arange(C, dtype=jnp.int32)[None, :]

    # top-k: the current list is the first n0 entries of the descending order.
    k = params.top_k
    whole_row = (k <= 0) | (k >= V)
    n0 = jnp.broadcast_to(jnp.where(whole_row, V, k), vals.shape[:1])
    live0 = j < n0[:, None]

    # top-p: softmax over the current list (renormalised after top-k, as llama.cpp's softmax_impl), then the
    # shortest prefix whose cumulative probability reaches top_p, never shorter than min_keep.
    mx = vals[:, :1]
    e = jnp.where(live0, jnp.exp(vals - mx), 0.0)
    cum_e = _cumsum_split(e, split)
    prefix_total = jnp.take_along_axis(cum_e, jnp.clip(n0 - 1, 0, C - 1)[:, None], axis=-1)[:, 0]
    # With top-k off the normaliser is the whole row's: one pass over the vocab, skipped when not needed. Computed
    # the same way at every width, so the full-sort path reproduces the fast path's cut bit for bit.
    total = prefix_total if row is None else jax.lax.cond(
        whole_row & (params.top_p < 1.0), lambda: jnp.sum(jnp.exp(row() - mx), axis=-1), lambda: prefix_total)
    cum = _cumsum_split(e / total[:, None], split)
    reach = (cum >= params.top_p) & (j + 1 >= params.min_keep) & live0
    n1 = jnp.where(jnp.any(reach, axis=-1), jnp.argmax(reach, axis=-1) + 1, n0)
    n1 = jnp.where(params.top_p >= 1.0, n0, n1)

    # min-p compares logits: p_i >= min_p * p_max <=> l_i >= l_max + log(min_p). The passing tokens are a prefix of
    # the descending order; if all C pass, the count is only known to be >= C (V stands for "more than C").
    thr = mx[:, 0] + jnp.log(jnp.maximum(params.min_p, jnp.float32(1e-38)))
    n_pass = jnp.sum(vals >= thr[:, None], axis=-1)
    n_pass = jnp.where((n_pass >= C) & (C < V), V, n_pass)
    n2 = jnp.minimum(n1, jnp.maximum(jnp.maximum(n_pass, params.min_keep), 1))
    n = jnp.where(params.min_p > 0.0, n2, n1).astype(jnp.int32)

    # Decided by C entries when the survivors fit and top-p's normaliser was known (prefix inside C, or whole row).
    # If top-p's cut was not reached inside C, n1 is an upper bound, and n <= C means min-p cut first.
    exact = (n <= C) & ((n0 <= C) | (n0 >= V))
    return n, exact


def _select(row, V: int, params: SamplerParams, cap: int, finish, top=None):
    """Sort the top `cap` candidates of one row, find the survivors and hand (vals, ids, n_keep) to `finish`, whose
    result must not depend on the candidate width. A row the top `cap` cannot decide (top-k off and more than `cap`
    survivors) is redone with a full sort: exact always, fast when filters leave <= cap tokens.

    row() returns the row's logits [1, V] with -0.0 made +0.0 (TopK orders -0.0 below +0.0, a total order on the
    bits; they are equal logits, so they must be one value and the lower id wins, as for every other tie). `top`:
    the row's top `cap` (vals, ids) when the caller computed them already; row() is then called only by the rare
    paths that need the whole row."""
    split = min(cap, V)

    def run(c):
        vals, ids = top_k(row(), c)
        n, exact = _survivors(row, V, vals, params, split)
        return vals, ids, n, exact

    if split >= V:
        vals, ids, n, _ = run(V)
        return finish(vals, ids, n, split)
    if top is None:
        vals, ids, n, exact = run(split)
    else:
        vals, ids = top
        n, exact = _survivors(row, V, vals, params, split)

    def full():
        v, i, m, _ = run(V)
        return finish(v, i, m, split)

    return jax.lax.cond(jnp.all(exact), lambda: finish(vals, ids, n, split), full)


def _draw(vals, ids, n, split, *, u, temperature):
    """The sampled id of a row's sorted survivors: inverse CDF in descending order, as llama.cpp's dist walks its
    (sorted) list: the first entry whose cumulative weight reaches u * total."""
    cdf = _cumsum_split(_weights(vals, n, temperature), split)
    target = u * cdf[:, -1]
    pick = jnp.minimum(jnp.sum(cdf < target[:, None], axis=-1), n - 1)
    return jnp.take_along_axis(ids, pick[:, None], axis=-1)[:, 0]


def _zeros_equal(logits: jax.Array) -> jax.Array:
    return jnp.where(logits == 0.0, jnp.float32(0.0), logits)


def _kernels():
    """fucina_jax.kernels when its compiled selections are available (they are exact drop-ins), else None."""
    from fucina_jax import kernels

    return kernels if kernels.available() else None


def top_k(x: jax.Array, k: int, fold_zero: bool = False) -> tuple[jax.Array, jax.Array]:
    """jax.lax.top_k over the last axis (of _zeros_equal(x) with fold_zero). With the compiled kernels: the same
    values and ids in one pass per row instead of XLA's sort (~17x faster at V = 262144), folding -0.0 on the way."""
    if k < x.shape[-1] and _kernels() is not None:
        return _kernels().top_k(x, k, fold_zero)
    if fold_zero:
        x = _zeros_equal(x)
    # The barrier keeps XLA from rewriting TopK + slice into a full sort (60x slower on the CPU). One barrier per
    # array: a barrier over the (vals, ids) tuple aborts XLA CPU's TopkDecomposer in multi-device programs.
    vals, ids = jax.lax.top_k(x, k)
    return jax.lax.optimization_barrier(vals), jax.lax.optimization_barrier(ids)


def greedy_pick(logits: jax.Array) -> jax.Array:
    """The greedy token of each row of logits [..., V]: the lowest id among equal maxima (+0.0 == -0.0). A row with
    NaN logits has no meaningful maximum: the kernel skips NaNs, the XLA fallback (whose max may or may not see
    them) may answer V - 1; any valid id would do, as long as decode and verify rows agree, and they do: both come
    here."""
    if _kernels() is not None:
        return _kernels().argmax(logits)
    # max + min-index is ~4x faster than XLA's CPU argmax
    V = logits.shape[-1]
    is_max = logits == jnp.max(logits, axis=-1, keepdims=True)
    first = jnp.min(jnp.where(is_max, jnp.arange(V, dtype=jnp.int32), V), axis=-1)
    return jnp.minimum(first, V - 1)


def position_uniform(seed: jax.Array, positions: jax.Array) -> jax.Array:
    """The uniform in [0, 1) that picks the token committed at each absolute position: a pure function of
    (seed, position), float32 [R]."""
    key = jax.random.key(jnp.asarray(seed, jnp.uint32), impl="threefry2x32")
    draw = lambda p: jax.random.uniform(jax.random.fold_in(key, p), (), jnp.float32)
    return jax.vmap(draw)(jnp.asarray(positions, jnp.int32))


def _weights(vals, n, temperature):
    """Unnormalised probabilities of the survivors after temperature (llama.cpp: l / T, then exp(l - l_max));
    greedy (T <= 0) keeps only the first entry, the lowest id among equal maxima."""
    j = jnp.arange(vals.shape[-1], dtype=jnp.int32)[None, :]
    t = jnp.where(temperature > 0.0, temperature, 1.0)
    scaled = vals / t
    e = jnp.where(j < n[:, None], jnp.exp(scaled - scaled[:, :1]), 0.0)
    return jnp.where(temperature > 0.0, e, (j == 0).astype(jnp.float32))


def _by_row(fn, logits, history, drafts, params, *extra):
    """fn(penalised [1, V], *extra rows [1, ...]) applied one row at a time (lax.map).

    Every row runs the same per-row program, whatever R is, so a row's result cannot depend on its batch; and the
    temporaries are [V]-sized instead of [R, V]: at R = 8, V = 262k the batched form needed 64 MiB of temporaries,
    which glibc serves with fresh mmap pages on every call (page faults cost more than the sampling itself).
    """
    tokens, mask = row_windows(history, drafts, params.repeat_last_n, logits.shape[0])

    def one(row):
        l, t, m, *ex = (x[None] for x in row)
        out = fn(penalize(l.astype(jnp.float32), t, m, params), *ex)
        return out[0]

    return jax.lax.map(one, (logits, tokens, mask, *extra))


@aot.jit(static_argnames=("cap",))
def filter_mask(logits: jax.Array, history: History, drafts, params: SamplerParams, *, cap: int) -> jax.Array:
    """The survivors of penalties -> top-k -> top-p -> min-p for each row of logits [R, V], bool [R, V]."""
    V = logits.shape[-1]
    cap = logits_cap(cap)
    cap = cap if cap > 0 else min(V, TOP_K_OFF_CAP)  # a greedy config's cap sorts nothing; the filters need some

    def row(penalised):
        def finish(vals, ids, n, split):
            live = jnp.arange(vals.shape[-1])[None, :] < n[:, None]
            return jnp.zeros((1, V), bool).at[0, ids[0]].set(live[0])

        return _select(lambda: _zeros_equal(penalised), penalised.shape[-1], params, cap, finish)

    return _by_row(row, logits, history, drafts, params)


@aot.jit(static_argnames=("cap",))
def sample_rows(
    logits: jax.Array,
    positions: jax.Array,
    history: History,
    drafts: jax.Array | None,
    params: SamplerParams,
    *,
    cap: int,
) -> jax.Array:
    """Sample one token per row of logits [R, V]; row i is committed at positions[i] and penalised with
    history + drafts[:i] (drafts int32 [R]: drafts[i] is the proposal row i is checked against, so the last entry
    is never read; None = every row sees only `history`). `cap` = SamplerConfig.candidate_cap. Returns int32 [R]."""
    R, V = logits.shape
    cap = logits_cap(cap)
    if cap == GREEDY_UNPENALIZED:  # greedy, penalties neutral (SamplerConfig.candidate_cap): the raw argmax
        return greedy_pick(logits.astype(jnp.float32))
    if R * V * 4 > _BATCH_BYTES:
        return _sample_by_row(logits, positions, history, drafts, params, cap)
    if cap == 0:  # a greedy config (SamplerConfig.candidate_cap): only the argmax is compiled
        tokens, mask = row_windows(history, drafts, params.repeat_last_n, R)
        return greedy_pick(penalize(logits.astype(jnp.float32), tokens, mask, params))
    tokens, mask = row_windows(history, drafts, params.repeat_last_n, R)
    # Penalties, the -0.0 fold, the top-`cap` selection and the greedy argmax are elementwise or exact selections,
    # the same for a row whatever the other rows: done for all rows at once. Only the candidate arithmetic (cumsums
    # over [1, cap], whose XLA code may depend on the shape) runs one row at a time, as in _by_row.
    penalised = penalize(logits.astype(jnp.float32), tokens, mask, params)
    u = position_uniform(params.seed, positions)

    def sampled():
        split = min(cap, V)
        top = top_k(penalised, split, fold_zero=True) if split < V else None

        def one(i):
            finish = partial(_draw, u=u[i][None], temperature=params.temperature)
            # the -0.0 fold of a whole row, only where a rare path needs the row (the top-k folds its own)
            row = lambda: _zeros_equal(jax.lax.dynamic_slice_in_dim(penalised, i, 1))
            row_top = None if top is None else tuple(jax.lax.dynamic_slice_in_dim(t, i, 1) for t in top)
            return _select(row, V, params, cap, finish, row_top)[0]

        return jax.lax.map(one, jnp.arange(R))

    # Greedy needs no sort: the filters always keep the maximum; take the first (lowest id) of equal maxima, the
    # token the pipeline's greedy branch picks.
    return jax.lax.cond(params.temperature > 0.0, sampled, lambda: greedy_pick(penalised))


def _sample_by_row(logits, positions, history, drafts, params, cap):
    """sample_rows one whole row at a time (the same tokens): [V]-sized temporaries for batches too large to hold
    several [R, V] copies without glibc serving fresh pages on every call."""

    def row(penalised, u):
        finish = partial(_draw, u=u, temperature=params.temperature)
        if cap == 0:
            return greedy_pick(penalised)
        select = lambda: _select(lambda: _zeros_equal(penalised), penalised.shape[-1], params, cap, finish)
        return jax.lax.cond(params.temperature > 0.0, select, lambda: greedy_pick(penalised))

    return _by_row(row, logits, history, drafts, params, position_uniform(params.seed, positions))


def sample_candidates(picks: jax.Array, vals: jax.Array, ids: jax.Array, positions: jax.Array, params: SamplerParams,
                      n_vocab: int) -> jax.Array:
    """sample_rows' tokens from the output layer's fused selections (kernels.qlinear_candidates), for rows whose
    config has a fused cap (fused_candidates): picks int32 [R] the raw argmax, vals / ids [R, C] the C largest raw
    logits with the -0.0 fold. Neutral penalties leave the logits as they are and top-k keeps at most C, so these
    decide every token, through the very code sample_rows runs on the same candidates: a row's token is bitwise the
    one sampling its logits gives. Returns int32 [R]."""
    R, C = vals.shape
    u = position_uniform(params.seed, positions)

    def sampled():
        def one(i):
            finish = partial(_draw, u=u[i][None], temperature=params.temperature)
            v, d = (jax.lax.dynamic_slice_in_dim(t, i, 1) for t in (vals, ids))
            n, _ = _survivors(None, n_vocab, v, params, C)  # top-k on, within C: always decided
            return finish(v, d, n, C)[0]

        return jax.lax.map(one, jnp.arange(R))

    return jax.lax.cond(params.temperature > 0.0, sampled, lambda: picks)


def sample_row(logits: jax.Array, position, history: History, params: SamplerParams, *, cap: int) -> jax.Array:
    """One row: the token committed at `position` given logits [V] and the committed history. Returns int32 []."""
    pos = jnp.asarray(position, jnp.int32).reshape(1)
    return sample_rows(logits[None, :], pos, history, None, params, cap=cap)[0]


@aot.jit(static_argnames=("cap",))
def token_probs(logits, history: History, drafts, params: SamplerParams, *, cap: int) -> jax.Array:
    """The distribution each row is sampled from, float32 [R, V] (one-hot on the greedy pick for T <= 0)."""
    V = logits.shape[-1]
    cap = logits_cap(cap)
    cap = cap if cap > 0 else min(V, TOP_K_OFF_CAP)

    def row(penalised):
        def finish(vals, ids, n, split):
            e = _weights(vals, n, params.temperature)
            return jnp.zeros((1, V), jnp.float32).at[0, ids[0]].set(e[0] / jnp.sum(e))

        return _select(lambda: _zeros_equal(penalised), penalised.shape[-1], params, cap, finish)

    return _by_row(row, logits, history, drafts, params)
