"""The jit boundary: every compiled step the decoder and the model's methods call.

Where does compilation happen? Here: one compiled program per (step, bucket shape, static values), kept across
processes by `aot.jit` (a warm start loads it: no trace, no compile), and counted by `aot.events()`, the one
counter the timers read. Every traced shape comes from the declared buckets below; per-call values (where each
row starts, how many rows are valid, the draft tokens, the sampler's values) are arrays, never static arguments,
so a new prompt length, a longer history or another temperature never recompiles.

The pure forwards (the model alone, for users who embed it in their own JAX code):

  prefill_step   tokens [B, T in PREFILL_BUCKETS]  -> logits of each row's last valid token [B, V]
  decode_step    tokens [B]                        -> logits [B, V]
  verify_step    tokens [B, k in VERIFY_BUCKETS]   -> logits of every row [B, k, V]
  tree_verify_step  the same over a tree: parents [B, k], row t's logits are those after its own path

A tree verify's rows are a tree in topological order (row 0 the root, parents[t] < t): row t sits at stream position
root + its depth, in cache slot root + t, and attends to the cache before the root plus its ancestors, so its values
are bitwise those plain decoding computes after its path. `compact_step` then moves an accepted path's slots to
where plain decoding keeps them (root + 1, root + 2, ...).

Each writes its rows into the cache and returns it with `length` advanced by the rows the caller declared valid
(prefill) or by all rows (decode/verify). The cache argument is donated: the caller must use the returned cache.

The decoder's fused steps (forward + sampler in one program, decoder.py drives them):

  sample_step              prefill logits [B, V]         -> each row's first token
  decode_sample_step       tokens [B, k in STEP_WIDTHS]  -> every row's sample; k = 1 is the plain decode step
  decode_sample_rows_step  tokens [n, k], rows [n]       -> the same for n of the cache's B rows (the active ones)
                           (both take parents [n, k]: the rows of a tree verify, each sampled after its own path)
  compact_step             path [B, P]                   -> the cache with each row's accepted tree path moved into
                                                            place

`prefill` (host) feeds a prompt per row through prefill_step in bucketed chunks; `prepare_prefill` brings its
programs in beforehand, so that a timer can tell loading from running.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fucina_jax import aot, sampling
from fucina_jax.models import forward_hidden, truncate, unembed, unembed_pick
from fucina_jax.models.cache import KVCache, on_rows, on_tree
from fucina_jax.models.config import ModelConfig

__all__ = [
    "PREFILL_BUCKETS",
    "VERIFY_BUCKETS",
    "STEP_WIDTHS",
    "TOPK_FEEDBACK",
    "bucket_for",
    "prefill",
    "prepare_prefill",
    "prefill_step",
    "prefill_row_step",
    "decode_step",
    "verify_step",
    "tree_verify_step",
    "TreeDraft",
    "tree_layout",
    "tree_paths",
    "compact_step",
    "COMPACT_SLOTS",
    "sample_step",
    "decode_sample_step",
    "decode_sample_rows_step",
    "ROW_BUCKETS",
    "row_bucket",
    "feedback_topk",
    "push_rows",
]

# Prompt chunks: a prompt is prefilled in chunks of the largest bucket; the last chunk is padded to the smallest
# bucket that holds it. Three shapes keep compile time bounded while a short chat turn pays for <= 16 padded rows.
PREFILL_BUCKETS = (16, 64, 256)
# Verify widths (carried token + draft), padded up to the next bucket.
VERIFY_BUCKETS = (2, 4, 8, 16)
# The decoder's step widths: 1 is the plain decode step, the rest are the verify buckets.
STEP_WIDTHS = (1, *VERIFY_BUCKETS)
# Candidates per verified row handed to DraftSource.observe_topk (the recycling matrix keeps 8 per token).
TOPK_FEEDBACK = 8


def bucket_for(n: int, buckets: tuple[int, ...]) -> int:
    """Smallest bucket >= n (n must not exceed the largest)."""
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"{n} rows exceed the largest bucket {buckets[-1]}")


def _positions(cache: KVCache, T: int) -> jax.Array:
    return cache.length[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]


# ---- the pure forwards --------------------------------------------------------------------------------------------


@aot.jit(static_argnames=("cfg",), donate_argnames=("cache",))
def prefill_step(params, tokens: jax.Array, n_valid: jax.Array, cache: KVCache, cfg: ModelConfig):
    """Prefill one padded chunk; tokens [B, T], n_valid [B] (a row with 0 rides along: its rows land past its
    length, stale). Only the last valid row is unembedded: computing [T, V] logits for a whole chunk would cost
    more than the chunk's transformer layers."""
    B, T = tokens.shape
    start = cache.length
    h, cache = forward_hidden(params, tokens, _positions(cache, T), cache, cfg)
    last = h[jnp.arange(B), n_valid - 1]
    return unembed(params, last, cfg), truncate(cache, start + n_valid)


@aot.jit(static_argnames=("cfg",), donate_argnames=("cache",))
def decode_step(params, tokens: jax.Array, cache: KVCache, cfg: ModelConfig):
    """One token per row; tokens [B]."""
    h, cache = forward_hidden(params, tokens[:, None], _positions(cache, 1), cache, cfg)
    return unembed(params, h[:, 0], cfg), cache


@aot.jit(static_argnames=("cfg",), donate_argnames=("cache",))
def verify_step(params, tokens: jax.Array, cache: KVCache, cfg: ModelConfig):
    """Logits of every row of tokens [B, k]; the cache comes back advanced by k (truncate to what you commit:
    rows past the committed length are stale and never visible after truncation)."""
    h, cache = forward_hidden(params, tokens, _positions(cache, tokens.shape[1]), cache, cfg)
    return unembed(params, h, cfg), cache


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TreeDraft:
    """A step's drafts as a tree verify (decode_sample_step's `drafts`): parents int32 [n, k], row t's parent row
    (< t; row 0, the carried token, is the root). A chain's drafts are the plain int32 [n, k] array."""

    parents: jax.Array


def tree_layout(parents: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(ancestor masks, depths), int32 [B, T] each, of a tree verify's parents [B, T] (parents[:, 0] the root's,
    ignored; parents[:, t] in [0, t), clipped there). Bit m of masks[b, t] is set iff row m is row t or one of its
    ancestors; depths[b, t] is the number of its ancestors. A chain (parents[t] = t - 1) has masks 2^(t+1) - 1 and
    depths t."""
    B, T = parents.shape
    masks = jnp.zeros((B, T), jnp.int32).at[:, 0].set(1)
    depth = jnp.zeros((B, T), jnp.int32)
    for t in range(1, T):  # T <= 16: unrolled
        p = jnp.clip(parents[:, t], 0, t - 1)[:, None]
        masks = masks.at[:, t].set(jnp.take_along_axis(masks, p, 1)[:, 0] | (1 << t))
        depth = depth.at[:, t].set(jnp.take_along_axis(depth, p, 1)[:, 0] + 1)
    return masks, depth


def tree_paths(tokens: jax.Array, masks: jax.Array, depth: jax.Array) -> jax.Array:
    """Each tree row's path below the root, int32 [B, T, T - 1]: paths[b, t, j] is the token of row t's ancestor
    (or itself) at depth j + 1, -1 past its depth. A chain's row t gets tokens[1 : t + 1]: the draft prefix
    sampling.row_windows penalises it with."""
    T = tokens.shape[1]
    m = jnp.arange(T, dtype=jnp.int32)
    bits = ((masks[:, :, None] >> m[None, None, :]) & 1) == 1  # [B, t, m]
    at = depth[:, None, None, :] == (jnp.arange(1, T, dtype=jnp.int32)[None, None, :, None])  # [B, 1, j, m]
    sel = bits[:, :, None, :] & at  # [B, t, j, m]: row m is row t's path entry j
    picked = jnp.sum(jnp.where(sel, tokens[:, None, None, :], 0), axis=-1)
    return jnp.where(jnp.any(sel, axis=-1), picked, -1).astype(jnp.int32)


@aot.jit(static_argnames=("cfg",), donate_argnames=("cache",))
def tree_verify_step(params, tokens: jax.Array, parents: jax.Array, cache: KVCache, cfg: ModelConfig):
    """Logits of every row of a tree verify, tokens and parents [B, k] (see the module docstring): row t's are the
    logits after the committed stream, its ancestors' tokens and its own. The cache comes back with the k rows in
    slots length .. length + k - 1 and its length advanced by k (compact_step an accepted path into place, then
    truncate to what you commit)."""
    masks, depth = tree_layout(parents)
    h, cache = forward_hidden(params, tokens, cache.length[:, None] + depth, on_tree(cache, masks), cfg)
    return unembed(params, h, cfg), cache


# Slots compact_step moves per row: a tree verify's deepest accepted path below its root.
COMPACT_SLOTS = 15


@aot.jit(donate_argnames=("cache",))
def compact_step(cache: KVCache, start: jax.Array, path: jax.Array) -> KVCache:
    """Each row's accepted tree path moved to where plain decoding keeps it: slot start[b] + 1 + j gets the K and
    V of slot start[b] + path[b, j] (path int32 [B, COMPACT_SLOTS]: the tree rows accepted at depths 1, 2, ...;
    -1 past the path, whose slots are left as they are), on every layer. The length is left alone (the next
    step sets it). Every source slot is at or after its destination (a row's depth is at most its index), and all
    are read before any is written."""
    B, P = path.shape
    S = cache.capacity
    src = jnp.clip(start[:, None] + path, 0, S - 1)
    dst = start[:, None] + 1 + jnp.arange(P, dtype=jnp.int32)[None, :]
    dst = jnp.where((path >= 0) & (dst < S), dst, S)  # S: dropped
    rows = jax.lax.broadcasted_iota(jnp.int32, (B, P), 0)
    idx = jnp.stack([rows, dst], axis=-1)
    dnums = jax.lax.ScatterDimensionNumbers(update_window_dims=(2, 3), inserted_window_dims=(0, 1),
                                            scatter_dims_to_operand_dims=(0, 1))

    def move(x):
        moved = jnp.take_along_axis(x, src[:, :, None, None], axis=1)
        return jax.lax.scatter(x, idx, moved, dnums, mode=jax.lax.GatherScatterMode.FILL_OR_DROP)

    return KVCache(k=tuple(map(move, cache.k)), v=tuple(map(move, cache.v)), length=cache.length)


@aot.jit(static_argnames=("cfg",), donate_argnames=("cache",))
def prefill_row_step(params, tokens: jax.Array, n_valid: jax.Array, row: jax.Array, cache: KVCache, cfg: ModelConfig):
    """prefill_step for one row of a batched cache: tokens [1, T] go into row `row` (int32 []) alone. The row's
    slots are cut out, prefilled as a batch of one and put back, so a request joining a running batch costs its
    own prefill (a copy of one row's slots) instead of one for every row."""
    one = KVCache(k=tuple(jax.lax.dynamic_slice_in_dim(x, row, 1) for x in cache.k),
                  v=tuple(jax.lax.dynamic_slice_in_dim(x, row, 1) for x in cache.v),
                  length=jax.lax.dynamic_slice_in_dim(cache.length, row, 1))
    logits, one = prefill_step.__wrapped__(params, tokens, n_valid, one, cfg)
    put = lambda big, small: jax.lax.dynamic_update_slice_in_dim(big, small.astype(big.dtype), row, 0)
    return logits, KVCache(k=tuple(map(put, cache.k, one.k)), v=tuple(map(put, cache.v, one.v)),
                           length=put(cache.length, one.length))


def _chunks(prompts: Sequence[np.ndarray | None]):
    """The prefill chunks of one prompt per row: (start, tokens [B, T], n_valid [B]) per chunk of the largest
    bucket, the last padded to the smallest bucket that holds it; a row with no ids left rides along (n_valid 0)."""
    B = len(prompts)
    lens = np.array([0 if p is None else len(p) for p in prompts], np.int32)
    biggest = PREFILL_BUCKETS[-1]
    for s in range(0, int(lens.max()), biggest):
        n_valid = np.clip(lens - s, 0, biggest).astype(np.int32)
        toks = np.zeros((B, bucket_for(int(n_valid.max()), PREFILL_BUCKETS)), np.int32)
        for b, p in enumerate(prompts):
            toks[b, : n_valid[b]] = p[s : s + n_valid[b]]
        yield s, toks, n_valid


def prefill(params, cfg: ModelConfig, prompts: Sequence[np.ndarray | None], cache: KVCache):
    """Append prompts[b] (int32 ids) to row b of the cache, every row in each chunk's one forward; a row whose
    prompt is None or empty only rides along (its length is kept). Returns (logits [B, V] after each prompted
    row's last id, cache)."""
    lens = np.array([0 if p is None else len(p) for p in prompts], np.int32)
    prompted = lens > 0
    if len(prompts) > 1 and prompted.sum() == 1:  # one row of a batch: prefilled alone, into its slots
        b = int(np.flatnonzero(prompted)[0])
        row = np.asarray(b, np.int32)
        logits = None
        for _, toks, n_valid in _chunks([prompts[b]]):
            logits, cache = prefill_row_step(params, toks, n_valid, row, cache, cfg)
        return jnp.broadcast_to(logits, (len(prompts), logits.shape[-1])), cache
    final = None
    for s, toks, n_valid in _chunks(prompts):
        logits, cache = prefill_step(params, toks, n_valid, cache, cfg)
        # rows whose prompt ended in an earlier chunk keep the logits of that chunk (an eager op only then)
        alive = lens > s
        final = logits if final is None or np.array_equal(alive, prompted) else \
            jnp.where(jnp.asarray(alive)[:, None], logits, final)
    return final, cache


def prepare_prefill(params, cfg: ModelConfig, prompts: Sequence[np.ndarray | None], cache: KVCache) -> None:
    """Bring in (load or compile) the programs prefill(params, cfg, prompts, cache) will run, without running them
    (aot.Step.prepare): a timer can then tell the prefill's own rate from its programs' loading."""
    prompted = [b for b, p in enumerate(prompts) if p is not None and len(p)]
    one = len(prompts) > 1 and len(prompted) == 1
    shapes = {}
    for _, toks, n_valid in _chunks([prompts[prompted[0]]] if one else prompts):
        shapes.setdefault(toks.shape, (toks, n_valid))
    for toks, n_valid in shapes.values():
        if one:
            prefill_row_step.prepare(params, toks, n_valid, np.asarray(prompted[0], np.int32), cache, cfg)
        else:
            prefill_step.prepare(params, toks, n_valid, cache, cfg)


# ---- the decoder's fused steps ------------------------------------------------------------------------------------


def _sample(logits, positions, history: sampling.History, drafts, sparams: sampling.SamplerParams, cap: int):
    """sampling.sample_rows for each row b: logits [B, R, V], positions [B, R], history and sparams with a leading
    batch axis, drafts [B, R] or None; int32 [B, R]. One row is sampled as it is alone (no batch axis in the
    program); several go through lax.map, not vmap: vmap would turn the sampler's lax.conds (greedy vs sort, top-`cap`
    vs full sort) into selects that always pay for the full vocab sort, and per row the program is then the very
    one a single row runs."""
    if logits.shape[0] == 1:
        one = jax.tree_util.tree_map(lambda x: x[0], (logits, positions, history, drafts, sparams))
        return sampling.sample_rows(*one, cap=cap)[None]

    def row(x):
        l, p, hist, d, sp = x
        return sampling.sample_rows(l, p, sampling.History(*hist), d, sampling.SamplerParams(*sp), cap=cap)

    if drafts is None:
        return jax.lax.map(lambda x: row((*x[:3], None, x[3])), (logits, positions, tuple(history), tuple(sparams)))
    return jax.lax.map(row, (logits, positions, tuple(history), drafts, tuple(sparams)))


def _sample_candidates(picks, vals, ids, positions, sparams: sampling.SamplerParams, n_vocab: int):
    """sampling.sample_candidates for each row b, as _sample runs sample_rows: picks [B, R], vals / ids [B, R, C],
    positions [B, R], sparams with a leading batch axis; int32 [B, R]."""
    if picks.shape[0] == 1:
        one = jax.tree_util.tree_map(lambda x: x[0], (picks, vals, ids, positions, sparams))
        return sampling.sample_candidates(*one, n_vocab)[None]

    def row(x):
        p, v, i, pos, sp = x
        return sampling.sample_candidates(p, v, i, pos, sampling.SamplerParams(*sp), n_vocab)

    return jax.lax.map(row, (picks, vals, ids, positions, tuple(sparams)))


def push_rows(history: sampling.History, new: jax.Array, n_new: jax.Array) -> sampling.History:
    """Each row's window gets its own count of new tokens: new [B, N], n_new [B] (a plain function: traced inside
    decode_sample_step, or run eagerly to inspect a decoder's state)."""
    if new.shape[0] == 1:
        one = sampling.push_history(sampling.History(history.tokens[0], history.count[0]), new[0], n_new[0])
        return sampling.History(one.tokens[None], one.count[None])
    return jax.vmap(sampling.push_history)(history, new, n_new)


def _padded(sampled: jax.Array) -> jax.Array:
    """Samples [B, k] as [B, STEP_WIDTHS[-1]] (-1 past k): the shape the next step pushes from, whatever k was."""
    return jnp.pad(sampled, ((0, 0), (0, STEP_WIDTHS[-1] - sampled.shape[1])), constant_values=-1)


@aot.jit(static_argnames=("cap",))
def sample_step(logits: jax.Array, positions: jax.Array, history: sampling.History, sparams: sampling.SamplerParams,
                cap: int) -> jax.Array:
    """Each row's first token from its prefill logits [B, V], drawn at stream positions [B] with the committed
    history (its prompt); int32 [B, STEP_WIDTHS[-1]], the token in column 0 (the shape decode_sample_step pushes)."""
    return _padded(_sample(logits[:, None], positions[:, None], history, None, sparams, cap))


@aot.jit(static_argnames=("cfg", "cap", "wants_topk", "with_logits"), donate_argnames=("cache",))
def decode_sample_step(
    params,
    tokens: jax.Array,
    drafts: jax.Array,
    start: jax.Array,
    cache: KVCache,
    history: sampling.History,
    pushed: jax.Array,
    n_pushed: jax.Array,
    sparams: sampling.SamplerParams,
    cfg: ModelConfig,
    cap: int,
    wants_topk: bool = False,
    with_logits: bool = False,
):
    """The decoder's step: every row's committed history is brought up to date, then its tokens are forwarded and
    every one of its rows is sampled.

    tokens int32 [B, k]: row b = [its carried token (the newest committed one), its draft..., padding]; k = 1 is
    a plain step. drafts int32 [B, k]: drafts[b, i] is the token row (b, i) is checked against, -1 past the draft.
    start int32 [B]: row b's committed length - 1, where its carried token goes: the cache is rewound to it first,
    so whatever a previous step wrote past it (rejected drafts) is stale and never visible. pushed int32 [B, N]
    and n_pushed [B]: the previous step's samples and how many of each row's were committed; they enter the
    history here, fused, instead of in a call of their own. history: tokens [B, W], count [B]; sparams: [B]
    leaves (each row's own values and seed).

    Row (b, i) holds the logits after the carried token and draft[:i], so it predicts stream position
    start[b] + 1 + i: it is sampled through the full pipeline at exactly that position (the RNG is keyed on it)
    and penalised with the history plus drafts[:i], the hypothetical prefix its logits are conditioned on (design
    record section 2). A row past the first mismatch was drawn from the counter-based RNG, so discarding it
    consumes nothing a plain run would see.

    Returns (sampled int32 [B, STEP_WIDTHS[-1]] (-1 past k), the history after the push, logits [B, k, V] or
    None, top-K ids int32 [B, k, TOPK_FEEDBACK] or None, cache advanced to start + k). `wants_topk` and
    `with_logits` are static, so neither output is traced unless asked for (the logits are for the decoder's
    row hook, a test/debug instrument).

    drafts = TreeDraft(parents [B, k]): every row's tokens are a tree verify (module docstring; row 0 the carried
    token, the root). Row (b, t) is then sampled at stream position start[b] + 1 + its depth and penalised with
    its own path (tree_paths); the rows land in slots start[b] + t (compact_step).
    """
    return decode_sample_rows_step.__wrapped__(params, tokens, drafts, None, start, cache, history, pushed, n_pushed,
                                               sparams, cfg, cap, wants_topk, with_logits)


# ---- the row-mapped step: n of the cache's B rows -----------------------------------------------------------------

# Step rows of decode_sample_rows_step: a decoder pads its active rows up to the smallest of these that holds them
# (never past its B), so that a batch with few active rows pays for those, not for B.
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def row_bucket(n_active: int, batch: int) -> int:
    """The step rows for n_active (>= 1) active rows of a B-row cache: the smallest ROW_BUCKETS entry holding them,
    capped at B (at B = 6, five active rows step all six)."""
    return min(next((b for b in ROW_BUCKETS if b >= n_active), batch), batch)


@aot.jit(static_argnames=("cfg", "cap", "wants_topk", "with_logits"), donate_argnames=("cache",))
def decode_sample_rows_step(params, tokens: jax.Array, drafts: jax.Array, rows: jax.Array | None, start: jax.Array,
                            cache: KVCache, history: sampling.History, pushed: jax.Array, n_pushed: jax.Array,
                            sparams: sampling.SamplerParams, cfg: ModelConfig, cap: int, wants_topk: bool = False,
                            with_logits: bool = False):
    """decode_sample_step for n of the cache's B rows: step row i is cache row rows[i] (rows None: every row in
    order, which is decode_sample_step).

    rows int32 [n]: distinct cache rows; padding entries (n a bucket above the active rows, see row_bucket) point at
    distinct other rows, computed and never looked at, exactly as a row riding along in decode_sample_step: given
    its carried token at start = its committed length - 1, a padding row rewrites that slot with the values its
    next step would write, and its slots past it are stale. tokens, drafts [n, k] and start [n] are per step row,
    as decode_sample_step's are per cache row. The cache, history, pushed [B, N], n_pushed [B] and sparams
    keep their B rows: the pending samples of every row are pushed (as decode_sample_step pushes them), and step
    row i is sampled with history[rows[i]] and sparams[rows[i]].

    Returns (sampled int32 [n, STEP_WIDTHS[-1]], the history of all B rows after the push, logits [n, k, V] or
    None, top-K ids [n, k, TOPK_FEEDBACK] or None, the cache with rows[i] advanced to start[i] + k and every other
    row untouched). Row i's values are bitwise those of cache row rows[i] stepped alone (B = 1) with the same cache
    contents; the caches are updated in place (no copy on the kernels' path). parents [n, k]: a tree verify, as
    in decode_sample_step (drafts = TreeDraft(parents)).
    """
    history = push_rows(history, pushed, n_pushed)
    n, k = tokens.shape
    parents = drafts.parents if isinstance(drafts, TreeDraft) else None
    if parents is None:
        in_pos = start[:, None] + jnp.arange(k, dtype=jnp.int32)[None, :]
    else:  # a tree: each row at its depth, penalised with its own path
        masks, depth = tree_layout(parents)
        in_pos = start[:, None] + depth
        drafts = tree_paths(tokens, masks, depth)
    if rows is None:
        cache = truncate(cache, start)
        step_history, step_sparams = history, sparams
    else:  # the forward writes and reads the mapped rows only; their history and sampler values are gathered
        cache = on_rows(cache, rows)
        step_history, step_sparams = jax.tree_util.tree_map(lambda x: x[rows], (history, sparams))
    if parents is not None:
        cache = on_tree(cache, masks)
    h, cache = forward_hidden(params, tokens, in_pos, cache, cfg)
    # Neutral penalties (greedy, or sampled with top-k on), and no hook wants the logits: the output layer's kernel
    # picks each row's token, or the sampler's candidates, and the recycling candidates, without writing the logits.
    fused = sampling.fused_candidates(cap)
    picked = unembed_pick(params, h, cfg, TOPK_FEEDBACK if wants_topk else 0, fused) \
        if fused is not None and not with_logits else None
    if picked is not None:
        sampled, topk, cands = picked
        if cands is not None:
            sampled = _sample_candidates(sampled, *cands, in_pos + 1, step_sparams, cfg.n_vocab)
        return _padded(sampled), history, None, (topk if wants_topk else None), cache
    # one row: unembedded as [k, D], the shape a lone decode/verify row has always had (row-exact either way)
    logits = unembed(params, h[0], cfg)[None] if n == 1 else unembed(params, h, cfg)
    sampled = _sample(logits, in_pos + 1, step_history, drafts if k > 1 else None, step_sparams, cap)
    topk = feedback_topk(logits) if wants_topk else None
    return _padded(sampled), history, (logits if with_logits else None), topk, cache


def feedback_topk(logits: jax.Array) -> jax.Array:
    """The recycling candidates of each verified row, int32 [..., TOPK_FEEDBACK]: taken from the raw rows (before
    penalties), as the design record specifies."""
    return sampling.top_k(logits, min(TOPK_FEEDBACK, logits.shape[-1]))[1].astype(jnp.int32)
