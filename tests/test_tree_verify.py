"""Tree verification: a verify's rows form a tree, and every row is computed exactly as plain decoding computes
its own prefix.

The attention level (kernels and the pure-JAX reference), the model level (every verify bucket, random tree
shapes, against decode rows), the cache compaction to an accepted path (== a fresh prefill of it), the sampler's
per-row penalty windows, the accept rule over a tree, and the decoder with adversarial trees (== plain decoding,
greedy and sampled).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fucina_jax import kernels
from fucina_jax.models import layers

needs_kernels = pytest.mark.skipif(not kernels.available(), reason="kernels not built")


def random_parents(rng, T: int) -> np.ndarray:
    """A random tree over T rows in topological order: row 0 is the root (-1), row t's parent is below t."""
    return np.array([-1] + [int(rng.integers(0, t)) for t in range(1, T)], np.int32)


def layout(parents: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(ancestor masks, depths) of a parents vector, from the definition (an independent reference of
    engine.tree_layout)."""
    T = len(parents)
    masks, depth = np.zeros(T, np.int64), np.zeros(T, np.int32)
    for t in range(T):
        p = parents[t]
        masks[t] = (1 << t) | (masks[p] if p >= 0 else 0)
        depth[t] = depth[p] + 1 if p >= 0 else 0
    return masks.astype(np.int32), depth


def path_of(parents: np.ndarray, t: int) -> list[int]:
    """The rows from the root to t."""
    out = [t]
    while parents[out[-1]] >= 0:
        out.append(int(parents[out[-1]]))
    return out[::-1]


def attention_cases(rng, T, L, S, K, Dh, H, dtype):
    q = rng.standard_normal((1, T, H, Dh)).astype(np.float32)
    k_new = rng.standard_normal((1, T, K, Dh)).astype(np.float32)
    v_new = rng.standard_normal((1, T, K, Dh)).astype(np.float32)
    kc = rng.standard_normal((1, S, K, Dh)).astype(dtype)  # slots >= L are stale junk a row must never see
    vc = rng.standard_normal((1, S, K, Dh)).astype(dtype)
    return q, k_new, v_new, kc, vc


@needs_kernels
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("window", [0, 3, 8])
def test_tree_attention_rows_are_their_chains_rows_bitwise(dtype, window):
    """Every row of a random tree (attention_write over the tree) is bitwise the last row of a chain verify of its
    own path written contiguously after the same cache, over random trees of every width; the reference path
    agrees within float rounding; stale slots past the root never leak."""
    rng = np.random.default_rng(31)
    H, K, Dh, S, L = 4, 2, 48, 96, 37
    tree_att = jax.jit(lambda *a: kernels.attention_write(*a[:6], 0.3, window, tree=a[6]))
    chain_att = jax.jit(lambda *a: kernels.attention_write(*a, 0.3, window))
    ref_att = jax.jit(lambda q, kc, vc, pos, tree: layers.attention(q, kc, vc, pos, 0.3, window, tree=tree))
    for T in (2, 4, 8, 16):
        for _ in range(3):
            parents = random_parents(rng, T)
            masks, depth = layout(parents)
            q, k_new, v_new, kc, vc = attention_cases(rng, T, L, S, K, Dh, H, dtype)
            pos = (L + depth)[None].astype(np.int32)
            out, kt, vt = (np.asarray(x) for x in tree_att(q, k_new, v_new, kc, vc, pos, masks[None]))
            # the rows landed at slot L + t, whatever their depth
            np.testing.assert_array_equal(kt[0, L : L + T], k_new[0].astype(dtype))
            ref = np.asarray(ref_att(q, kt, vt, pos, masks[None]))
            np.testing.assert_allclose(ref, out, rtol=2e-5, atol=2e-5)
            for t in range(T):
                p = path_of(parents, t)
                sel = np.asarray(p)
                cpos = (L + np.arange(len(p)))[None].astype(np.int32)
                want = np.asarray(chain_att(q[:, sel], k_new[:, sel], v_new[:, sel], kc, vc, cpos)[0])
                np.testing.assert_array_equal(out[0, t], want[0, -1])
            # the tree changes what a row sees: a row with a sibling-only neighbour differs from the chain layout
            if any(parents[t] != t - 1 for t in range(1, T)):
                chain = np.asarray(chain_att(q, k_new, v_new, kc, vc, (L + np.arange(T))[None].astype(np.int32))[0])
                assert not np.array_equal(chain, out)


@needs_kernels
def test_tree_masks_are_checked():
    rng = np.random.default_rng(3)
    q, k_new, v_new, kc, vc = attention_cases(rng, 4, 10, 32, 1, 16, 2, np.float32)
    pos = np.array([[10, 11, 11, 12]], np.int32)
    att = jax.jit(lambda *a: kernels.attention_write(*a[:6], 0.3, 0, tree=a[6]))
    np.asarray(att(q, k_new, v_new, kc, vc, pos, np.asarray([[1, 3, 5, 9]], np.int32))[0])  # a valid tree
    # row 2 blind to itself; row 1 sees row 2; row 3 sees a row past the step
    for bad in ([1, 3, 1, 9], [1, 7, 5, 9], [1, 3, 5, 9 | 16]):
        with pytest.raises(Exception, match="tree row"):
            np.asarray(att(q, k_new, v_new, kc, vc, pos, np.asarray([bad], np.int32))[0])


# ---- the model level ----------------------------------------------------------------------------------------------

from fucina_jax import engine  # noqa: E402
from fucina_jax.models import truncate  # noqa: E402

PROMPT = list(range(5, 27))


def chain_last_rows(model, base_cache_fn, paths_tokens):
    """The logits plain decoding computes after each token list (after the cached prompt): a chain verify padded
    to its bucket, its row len - 1 (verify rows are decode rows, tests/test_forward.py)."""
    out = []
    for toks in paths_tokens:
        k = engine.bucket_for(max(len(toks), 2), engine.VERIFY_BUCKETS)
        padded = np.zeros((1, k), np.int32)
        padded[0, : len(toks)] = toks
        logits, _ = engine.verify_step(model.params, jnp.asarray(padded), base_cache_fn(), model.config)
        out.append(np.asarray(logits[0, len(toks) - 1]))
    return np.stack(out)


def tree_case(model, rng, k):
    parents = random_parents(rng, k)
    tokens = rng.integers(3, model.config.n_vocab, size=k).astype(np.int32)
    if k >= 4:  # a duplicated token among siblings and a token repeated down a path
        kids = [t for t in range(1, k) if parents[t] == 0]
        if len(kids) >= 2:
            tokens[kids[1]] = tokens[kids[0]]
        tokens[k - 1] = tokens[parents[k - 1]]
    return parents, tokens


def prompt_cache(model, capacity=256):
    _, cache = model.prefill(np.asarray(PROMPT, np.int32), model.new_cache(capacity))
    return cache


@needs_kernels
@pytest.mark.parametrize("kind, qtype", [("qwen3", "Q4_1"), ("gemma3", "F32"), ("gemma4-e2b", "Q8_0"),
                                         ("qwen3moe", "Q8_0")])
def test_tree_rows_are_plain_rows_bitwise(quantized, kind, qtype):
    """Every row of random trees at every verify width: bitwise the logits plain decoding computes after that row's
    path (kernels); the f32 reference path within rounding, with the same argmax."""
    fast, ref, _ = quantized(kind, qtype)
    rng = np.random.default_rng(hash(kind) % 1000)
    for model, exact in ((fast, True), (ref, False)):
        for k in engine.VERIFY_BUCKETS:
            parents, tokens = tree_case(model, rng, k)
            logits, cache = engine.tree_verify_step(model.params, jnp.asarray(tokens[None]),
                                                    jnp.asarray(parents[None]), prompt_cache(model), model.config)
            assert int(cache.length[0]) == len(PROMPT) + k
            got = np.asarray(logits[0])
            want = chain_last_rows(model, lambda: prompt_cache(model),
                                   [tokens[path_of(parents, t)] for t in range(k)])
            if exact:
                np.testing.assert_array_equal(got, want)
            else:
                np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
                assert (got.argmax(-1) == want.argmax(-1)).all()


@needs_kernels
@pytest.mark.parametrize("kind, qtype", [("qwen3", "Q4_1"), ("gemma4-e2b", "Q8_0")])
def test_compaction_equals_a_fresh_prefill_of_the_path(quantized, kind, qtype):
    """After a tree verify, compact_step on an accepted path (a deep leaf's, off the first chain) gives the cache a
    fresh prefill of prompt + path has, slot for slot, and the next decode step's logits are bitwise the same."""
    fast, _, _ = quantized(kind, qtype)
    rng = np.random.default_rng(5)
    for k in (4, 8, 16):
        parents, tokens = tree_case(fast, rng, k)
        parents[1:] = np.minimum(parents[1:], np.arange(k - 1))  # keep it a tree; make a deep path likely
        leaf = max(range(k), key=lambda t: (len(path_of(parents, t)), t))
        path = path_of(parents, leaf)  # rows, root first
        n0 = len(PROMPT)
        _, cache = engine.tree_verify_step(fast.params, jnp.asarray(tokens[None]), jnp.asarray(parents[None]),
                                           prompt_cache(fast), fast.config)
        moves = np.full((1, engine.COMPACT_SLOTS), -1, np.int32)
        moves[0, : len(path) - 1] = path[1:]
        cache = truncate(engine.compact_step(cache, np.asarray([n0], np.int32), moves), n0 + len(path))
        fresh = fast.new_cache(256)
        _, fresh = fast.prefill(np.asarray(PROMPT + tokens[path].tolist(), np.int32), fresh)
        n = n0 + len(path)
        for a, b in zip(cache.k + cache.v, fresh.k + fresh.v):
            np.testing.assert_array_equal(np.asarray(a)[0, :n], np.asarray(b)[0, :n])
        nxt = jnp.asarray([7], jnp.int32)
        la, _ = engine.decode_step(fast.params, nxt, cache, fast.config)
        lb, _ = engine.decode_step(fast.params, nxt, fresh, fast.config)
        np.testing.assert_array_equal(np.asarray(la), np.asarray(lb))
        if path != list(range(len(path))):  # a path off the first chain: without the move it would differ
            _, raw = engine.tree_verify_step(fast.params, jnp.asarray(tokens[None]), jnp.asarray(parents[None]),
                                             prompt_cache(fast), fast.config)
            lc, _ = engine.decode_step(fast.params, nxt, truncate(raw, n), fast.config)
            assert not np.array_equal(np.asarray(lc), np.asarray(lb))


def test_tree_layout_and_paths_match_the_definition():
    rng = np.random.default_rng(9)
    for k in (2, 4, 8, 16):
        parents = np.stack([random_parents(rng, k) for _ in range(3)])
        tokens = rng.integers(0, 1000, size=(3, k)).astype(np.int32)
        masks, depth = (np.asarray(x) for x in engine.tree_layout(jnp.asarray(parents)))
        paths = np.asarray(engine.tree_paths(jnp.asarray(tokens), jnp.asarray(masks), jnp.asarray(depth)))
        for b in range(3):
            m, d = layout(parents[b])
            np.testing.assert_array_equal(masks[b], m)
            np.testing.assert_array_equal(depth[b], d)
            for t in range(k):
                want = tokens[b, path_of(parents[b], t)[1:]].tolist()
                assert paths[b, t].tolist() == want + [-1] * (k - 1 - len(want))
    chain = np.arange(-1, 7, dtype=np.int32)[None]
    masks, depth = engine.tree_layout(jnp.asarray(chain))
    assert np.asarray(masks)[0].tolist() == [2 ** (t + 1) - 1 for t in range(8)]
    assert np.asarray(depth)[0].tolist() == list(range(8))


# ---- the accept rule over a tree ----------------------------------------------------------------------------------

from fucina_jax.decoder import Decoder, Request, accept, accept_tree  # noqa: E402


def plain_reference(stream, tokens, parents, stops, limit):
    """What plain decoding commits, from its stream: the longest run of `stream` the tree holds as a path below
    the root, plus the next id, cut before a stop id and at `limit` (an independent reference of accept_tree)."""
    out, node = [], 0
    while True:
        t = stream[len(out)]
        if t in stops:
            return out, True
        out.append(t)
        if len(out) >= limit:
            return out, False
        kids = [c for c in range(1, len(tokens)) if parents[c] == node and tokens[c] == t]
        if not kids:
            return out, False
        node = kids[0]


def test_accept_tree_is_plain_decoding_over_random_trees():
    """Random trees (duplicated siblings, the stream's ids planted on random paths, stop ids inside branches, every
    limit): accept_tree commits what plain decoding commits, only rows whose path is the committed stream are read,
    and on a chain it is `accept`."""
    rng = np.random.default_rng(11)
    for case in range(3000):
        k = int(rng.choice([2, 4, 8, 16]))
        parents = random_parents(rng, k)
        stream = rng.integers(0, 6, size=k + 2).tolist()  # a tiny vocabulary: collisions and duplicates abound
        tokens = rng.integers(0, 6, size=k).astype(np.int32)
        masks, depth = layout(parents)
        for t in rng.choice(k, size=k // 2):  # plant the stream along some paths
            for r in path_of(parents, int(t))[1:]:
                tokens[r] = stream[depth[r] - 1]
        stops = {int(rng.integers(0, 6))} if case % 3 == 0 else set()
        limit = int(rng.integers(1, k + 2))
        # a row whose path is the stream is sampled with the stream's next id; any other row with junk
        on_stream = [all(tokens[r] == stream[depth[r] - 1] for r in path_of(parents, t)[1:]) for t in range(k)]
        sampled = [stream[depth[t]] if on_stream[t] else int(rng.integers(0, 6)) for t in range(k)]
        o = accept_tree(sampled, tokens, parents, stops, limit)
        want, stopped = plain_reference(stream, tokens, parents, stops, limit)
        assert list(o.committed) == want and o.stopped == stopped, case
        assert all(on_stream[r] for r in o.path) and o.path[0] == 0
        assert o.accepted == len(o.path) - 1 and o.rows == o.path[: len(o.committed)]
        chain = np.arange(-1, k - 1)
        c = accept_tree(sampled, tokens, chain, stops, limit)
        assert (c.committed, c.stopped, c.accepted) == (lambda a: (a.committed, a.stopped, a.accepted))(
            accept(sampled, tokens[1:], stops, limit))


# ---- the decoder with adversarial trees ---------------------------------------------------------------------------

from spec_helpers import ScriptedSource, garbage, perfect  # noqa: E402

from fucina_jax.generate import generate  # noqa: E402
from fucina_jax.sampling import SamplerConfig  # noqa: E402
from fucina_jax.speculative import SpecOptions  # noqa: E402
from fucina_jax.speculative.economics import AcceptanceModel  # noqa: E402

GREEDY = SamplerConfig(temperature=0.0, top_k=20, seed=0)
SAMPLED = SamplerConfig(temperature=0.8, top_k=20, repeat_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.3,
                        repeat_last_n=64, seed=99)
TREES = SpecOptions(tree_siblings=3, min_gain=0.0)


class TreeSource(ScriptedSource):
    """A ScriptedSource that also offers siblings(k): sib_fn(stream, step) -> ids."""

    def __init__(self, draft_fn, sib_fn):
        super().__init__(draft_fn)
        self.sib_fn = sib_fn

    def siblings(self, k):
        return [(t, f"sibling{i}") for i, t in enumerate(self.sib_fn(self.observed, self.suggests - 1)[:k])]


def truth_at(truth):
    return lambda stream: truth[len(stream)] if len(stream) < len(truth) else 0


def sibling_fns(truth, V):
    nxt = truth_at(truth)
    return {
        # the chain is wrong and the truth is a sibling: every accepted path leaves the first chain (compaction)
        "truth-sibling": (garbage(truth, V), lambda s, i: [(nxt(s) + 1) % V, nxt(s), nxt(s)]),
        # the chain is right, the siblings wrong (and one duplicates the chain's first token)
        "wrong-siblings": (perfect(truth), lambda s, i: [nxt(s), (nxt(s) + 2) % V, (nxt(s) + 5) % V]),
        # steps alternate: which branch holds the truth changes
        "mixed": (lambda s, i: perfect(truth)(s, i) if i % 2 else garbage(truth, V)(s, i),
                  lambda s, i: [(nxt(s) + 3) % V, nxt(s)] if i % 3 else [(nxt(s) + 4) % V]),
    }


def tree_decode(model, prompt, source, sampler, max_tokens, stops=(), ctx=128):
    dec = Decoder(model, ctx=ctx, options=TREES)
    dec.acceptance = AcceptanceModel(prior_mean=0.9)  # every key promising: the trees get verified
    req = Request(tuple(prompt), max_tokens, sampler.validate(), frozenset(stops), source)
    tokens = list(dec.first(dec.begin([req]))[0].committed)
    paths_off_chain = 0
    while dec.active:
        o = dec.step()[0]
        tokens += o.committed
        paths_off_chain += bool(o.path) and list(o.path[1:]) != list(range(1, len(o.path)))
    return tokens, dec, paths_off_chain


@pytest.fixture(scope="module")
def qwen3(fixture_path, load_model):
    return load_model(fixture_path("qwen3"))


@pytest.mark.parametrize("sampler", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("kind", ["truth-sibling", "wrong-siblings", "mixed"])
def test_tree_decoding_is_plain_decoding(qwen3, kind, sampler):
    """Speculative decoding with sibling trees commits the plain stream, greedy and sampled (penalties on: each
    tree row is penalised with its own path), with paths off the first chain (compacted) where the truth is a
    sibling; the source observes exactly the committed stream, and its top-K rows are the committing rows'."""
    prompt = qwen3.tokenizer.encode("0 1 2 3 0 1 2 3 0 1 2", add_special=True)
    plain = generate(qwen3, prompt, max_tokens=40, sampler=sampler, ctx=128, stop_ids=()).run()
    truth = prompt + plain.tokens
    draft, sib = sibling_fns(truth, qwen3.config.n_vocab)[kind]
    src = TreeSource(draft, sib)
    got, dec, off = tree_decode(qwen3, prompt, src, sampler, 40)
    assert got == plain.tokens
    assert src.observed == truth
    assert dec.tree_steps > 0
    if kind != "wrong-siblings":
        assert off > 0
    for committed, rows in src.topk_calls:
        assert rows.shape[0] == len(committed)


def test_tree_decoding_stops_inside_a_branch_and_at_the_limit(qwen3):
    """A stop id the truth-holding sibling branch samples ends the run uncommitted; max_tokens mid-branch cuts it."""
    prompt = qwen3.tokenizer.encode("hello world hello world, the quick brown fox", add_special=True)
    free = generate(qwen3, prompt, max_tokens=40, sampler=GREEDY, ctx=128, stop_ids=()).run()
    j = next(i for i, t in enumerate(free.tokens) if i >= 6 and t not in free.tokens[:i])
    stop = free.tokens[j]
    truth = prompt + free.tokens
    draft, sib = sibling_fns(truth, qwen3.config.n_vocab)["truth-sibling"]
    plain = generate(qwen3, prompt, max_tokens=40, sampler=GREEDY, ctx=128, stop_ids=(stop,)).run()
    src = TreeSource(draft, sib)
    got, dec, _ = tree_decode(qwen3, prompt, src, GREEDY, 40, stops=(stop,))
    assert got == plain.tokens and dec.rows[0].finish == "stop"
    assert src.observed == prompt + plain.tokens
    for max_tokens in (1, 2, 5, 11):
        src = TreeSource(*sibling_fns(truth, qwen3.config.n_vocab)["mixed"])
        got, dec, _ = tree_decode(qwen3, prompt, src, GREEDY, max_tokens)
        assert got == free.tokens[:max_tokens] and dec.rows[0].finish == "max_tokens"


def test_tree_rows_in_a_batch_are_the_rows_alone(qwen3):
    """Two rows, one with a tree source and one with a chain source, stepped together (trees and chains in one
    tree program, compaction of one row only): each commits its own plain stream."""
    prompts = [qwen3.tokenizer.encode(t, add_special=True) for t in ("0 1 2 3 0 1 2 3", "hello world hello")]
    plains = [generate(qwen3, p, max_tokens=30, sampler=SAMPLED, ctx=128, stop_ids=()).run() for p in prompts]
    truths = [p + r.tokens for p, r in zip(prompts, plains)]
    V = qwen3.config.n_vocab
    sources = [TreeSource(*sibling_fns(truths[0], V)["truth-sibling"]), ScriptedSource(perfect(truths[1]))]
    dec = Decoder(qwen3, 2, ctx=128, options=TREES)
    dec.acceptance = AcceptanceModel(prior_mean=0.9)
    reqs = [Request(tuple(p), 30, SAMPLED.validate(), frozenset(), s) for p, s in zip(prompts, sources)]
    dec.first(dec.begin(reqs))
    while dec.active:
        dec.step()
    assert [dec.rows[b].generated for b in range(2)] == [r.tokens for r in plains]
    assert dec.tree_steps > 0


def test_bad_siblings_are_reported(qwen3):
    """A source whose siblings are out of the vocabulary or not (token, key) pairs fails the step with a
    DraftSourceError naming it, before anything is committed."""
    from fucina_jax.errors import DraftSourceError

    prompt = qwen3.tokenizer.encode("0 1 2 3 0 1 2 3", add_special=True)
    V = qwen3.config.n_vocab
    for bad, match in (([V + 5], "outside the vocabulary"), ([-1], "outside the vocabulary")):
        src = TreeSource(lambda s, i: [1, 2, 3], lambda s, i, bad=bad: bad)
        with pytest.raises(DraftSourceError, match=match):
            tree_decode(qwen3, prompt, src, GREEDY, 10)

    class Malformed(TreeSource):
        def siblings(self, k):
            return [5]

    with pytest.raises(DraftSourceError, match="pairs"):
        tree_decode(qwen3, prompt, Malformed(lambda s, i: [1, 2, 3], None), GREEDY, 10)
