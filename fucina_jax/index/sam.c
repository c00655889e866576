/*
 * sam.c: the C core of fucina_jax.index, an online suffix automaton (SAM) over token streams.
 *
 * The automaton answers, after every appended token, "what is the longest suffix of the stream that
 * also occurs ending strictly before the current end, and where did it occur?". The continuation after
 * that earlier occurrence is the draft. The readable pure-Python twin of this file is sam_ref.py; the
 * tests require both to return identical answers on every stream.
 *
 * Sections:
 *   1. data structures (struct of arrays)
 *   2. build_ / free_ and geometric growth
 *   3. transition hash
 *   4. online extension: cursor-before-extend and the endpos sample discipline
 *   5. queries: internal cursor, drafts, external cursors over a frozen automaton
 *   6. occurrence counts: frequency-ranked drafts over a frozen automaton of many documents
 *   7. CPython binding (module fucina_jax.index._sam)
 *
 * Self-match exclusion, the subtle part. A plain SAM matches the stream against itself, so the longest
 * suffix "match" would always be the whole stream. Two mechanisms make the answer exact:
 *   - cursor-before-extend: the match cursor advances with token t_i over the automaton of t_0..t_{i-1}
 *     and only then is the automaton extended with t_i, so a successful transition proves an occurrence
 *     ending before i. When the extension clones the state the cursor sits on, the cursor is redirected
 *     to the clone (its string is one of the clone's shorter strings).
 *   - the sample discipline: every state stores one end index `pos` of an occurrence of its strings, and
 *     every write stores an index that is provably in the state's endpos set AND smaller than the end of
 *     the stream at any later query: a new state gets its own (only) end index, a clone inherits the end
 *     index of the state it splits (never the current end), and the recency refresh "the cursor just
 *     matched at i" is applied one append later, when i is no longer the current end.
 * Invariant: the internal cursor always equals (link(last), len(link(last))). The extension relies on
 * it to reuse the cursor's walk, checks it on every append (a violation poisons) and the tests check it.
 *
 * Recency: the draft copies the most recent earlier occurrence *seen by the cursor path* (the sample of
 * the state the cursor sits on), not always the globally most recent one: refreshing every ancestor
 * state would cost O(depth) per append. On random streams it is the most recent one ~89% of the time.
 *
 * Memory: 16 B/state (len, link, pos, first_edge) with states <= 2n+1, one global transition hash
 * (12 B/slot, load <= 3/4) holding <= 3n transitions, an 8 B/edge pool that mirrors the hash so a state's
 * edges can be enumerated when it is cloned (freed by freeze(): frozen automata never clone), and a 4 B
 * copy of every token; arrays grow by 1.5x. Code and text measure ~1.45 states and ~2.1 transitions per
 * token: ~90-105 B/token while growing, ~57 B/token frozen. Both classical bounds are checked after
 * every append.
 *
 * Cost: an append is a handful of hash probes and state reads, amortized O(1); on an index larger than
 * the caches each is a likely cache miss, which is what the per-token cost grows with.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------------------------------------------
 * 1. data structures
 * ------------------------------------------------------------------------------------------------- */

#define SAM_EMPTY UINT32_MAX /* source-state word of a free hash slot (no state has this index) */
/* Token cap that keeps every index in int32: states <= 2n+1 and transitions <= 3n. */
#define SAM_MAX_TOKENS ((int64_t)((INT32_MAX - 3) / 3))

/* Return codes of the core. Everything except SAM_OK on an append poisons the automaton. */
enum {
    SAM_OK = 0,
    SAM_ERR_FROZEN = 1,   /* append to a frozen automaton: a usage error, does not poison */
    SAM_ERR_POISONED = 2, /* the automaton was already poisoned: the append is ignored */
    SAM_ERR_TOKEN = 3,    /* token id outside [0, INT32_MAX] */
    SAM_ERR_FULL = 4,     /* max_tokens reached */
    SAM_ERR_NOMEM = 5,    /* malloc/realloc failed */
    SAM_ERR_BOUND = 6,    /* states > 2n+1, transitions > 3n or a broken invariant: a bug */
};

typedef struct {
    /* the indexed stream */
    int32_t *tokens;     /* [cap_tokens] token ids; the first n_tokens are the stream */
    int64_t n_tokens;    /* tokens appended so far */
    int64_t cap_tokens;  /* allocated length of tokens, elements */
    int64_t max_tokens;  /* an append beyond this many tokens fails and poisons */
    /* states, struct of arrays, each [cap_states]; state 0 is the root (the empty string) */
    int32_t *len;        /* length of the longest string in the state's endpos class, tokens */
    int32_t *link;       /* suffix link: state of the longest suffix in a different class; -1 at root */
    int32_t *pos;        /* end index (into tokens) of one occurrence of the class; -1 at the root */
    int32_t *first_edge; /* head of the state's out-edge list in the edge pool; -1 if none */
    int64_t n_states;    /* states in use */
    int64_t cap_states;  /* allocated length of each state array, elements */
    /* edge pool: enumeration mirror of the hash, needed only to copy edges when a state is cloned */
    int32_t *edge_next;  /* [cap_edges] next edge of the same source state; -1 ends the list */
    int32_t *edge_token; /* [cap_edges] label of the edge, token id */
    int64_t n_edges;     /* transitions in use (== entries in the hash) */
    int64_t cap_edges;   /* allocated length of the edge arrays, elements; 0 after freeze */
    /* transition hash: open addressing, linear probing. A slot is 3 consecutive words (source state,
     * token, target state) so one probe touches one cache line; this is the one array-of-structs here. */
    uint32_t *hash;      /* [3 * hash_cap] slots; source word SAM_EMPTY marks a free slot */
    int64_t hash_cap;    /* slots (any size: the slot index is a multiply-high range reduction) */
    /* construction state */
    int32_t last;          /* state of the whole stream */
    int32_t cur_state;     /* internal cursor: state of the longest suffix with an earlier occurrence */
    int32_t cur_len;       /* its length, tokens (0: the cursor is at the root, no match) */
    int32_t refresh_state; /* deferred recency refresh: pos[refresh_state] = refresh_pos; -1 if none */
    int32_t refresh_pos;   /* end index the refresh writes, tokens */
    int frozen;            /* 1 after freeze(): no more appends, external cursors allowed */
    int poisoned;          /* 1 after a failed append: every query answers "no match" */
    /* occurrence counts (section 6), NULL unless freeze_counted() computed them; each [n_states] */
    int32_t *occ;        /* |endpos| of the state: occurrences of each of its strings */
    int32_t *last_end;   /* largest end index of those occurrences (the most recent one) */
    int32_t *best;       /* label of the most frequent continuation (ties: most recent); -1 if none */
} Sam;

/* An external cursor over a frozen automaton: the longest suffix of the cursor's own token stream that
 * occurs in the indexed stream. A cursor over a growing automaton would dangle (clones split the state it
 * sits on and only the internal cursor gets the fix-up), hence the frozen requirement. */
typedef struct {
    int32_t state; /* state of the matched string */
    int32_t len;   /* matched length, tokens; may be shorter than len[state] */
} SamCursor;

/* ---------------------------------------------------------------------------------------------------
 * 2. build_ / free_ and growth
 * ------------------------------------------------------------------------------------------------- */

/* Arrays grow by 1.5x (not 2x): the slack is what keeps a growing index near ~100 B/token. */
static int64_t next_cap(int64_t cap, int64_t need) {
    int64_t c = cap < 16 ? 16 : cap;
    while (c < need) c += c / 2;
    return c;
}

static int grow_tokens(Sam *s, int64_t need) {
    if (need <= s->cap_tokens) return SAM_OK;
    int64_t cap = next_cap(s->cap_tokens, need);
    int32_t *t = realloc(s->tokens, (size_t)cap * sizeof(int32_t));
    if (!t) return SAM_ERR_NOMEM;
    s->tokens = t;
    s->cap_tokens = cap;
    return SAM_OK;
}

/* The four state arrays share cap_states; it is raised only when all four reallocations succeed, so it
 * stays a lower bound on every array's true capacity even after a partial failure. */
static int grow_states(Sam *s, int64_t need) {
    if (need <= s->cap_states) return SAM_OK;
    int64_t cap = next_cap(s->cap_states, need);
    int32_t **arrays[4] = {&s->len, &s->link, &s->pos, &s->first_edge};
    for (int k = 0; k < 4; k++) {
        int32_t *a = realloc(*arrays[k], (size_t)cap * sizeof(int32_t));
        if (!a) return SAM_ERR_NOMEM;
        *arrays[k] = a;
    }
    s->cap_states = cap;
    return SAM_OK;
}

static int grow_edges(Sam *s, int64_t need) {
    if (need <= s->cap_edges) return SAM_OK;
    int64_t cap = next_cap(s->cap_edges, need);
    int32_t *nx = realloc(s->edge_next, (size_t)cap * sizeof(int32_t));
    if (!nx) return SAM_ERR_NOMEM;
    s->edge_next = nx;
    int32_t *tk = realloc(s->edge_token, (size_t)cap * sizeof(int32_t));
    if (!tk) return SAM_ERR_NOMEM;
    s->edge_token = tk;
    s->cap_edges = cap;
    return SAM_OK;
}

/* A fresh all-free table of `cap` slots; NULL when out of memory. */
static uint32_t *hash_table_alloc(int64_t cap) {
    uint32_t *h = malloc((size_t)cap * 3 * sizeof(uint32_t));
    if (h)
        for (int64_t i = 0; i < cap; i++) h[3 * i] = SAM_EMPTY;
    return h;
}

/* Adds a state; returns its index or -1 when out of memory. */
static int32_t new_state(Sam *s, int32_t len, int32_t link, int32_t pos) {
    if (grow_states(s, s->n_states + 1) != SAM_OK) return -1;
    int32_t v = (int32_t)s->n_states++;
    s->len[v] = len;
    s->link[v] = link;
    s->pos[v] = pos;
    s->first_edge[v] = -1;
    return v;
}

/* Allocates an empty automaton (just the root) with room for `reserve` tokens, so a reference document
 * of known length is indexed without reallocation (freeze() trims what the reservation overestimated). */
static int build_sam(Sam *s, int64_t reserve, int64_t max_tokens) {
    memset(s, 0, sizeof(*s));
    s->max_tokens = max_tokens;
    s->last = 0;
    s->cur_state = 0;
    s->cur_len = 0;
    s->refresh_state = -1;
    s->refresh_pos = -1;
    if (reserve < 0) reserve = 0;
    if (reserve > max_tokens) reserve = max_tokens;
    /* text and code streams measure ~1.45 states and ~2.1 transitions per token; the worst case is 2n
     * and 3n, which the geometric growth covers */
    int64_t edges = reserve * 9 / 4;
    s->hash_cap = edges * 4 / 3 + 16; /* load <= 3/4 */
    s->hash = hash_table_alloc(s->hash_cap);
    if (!s->hash || grow_tokens(s, reserve) != SAM_OK || grow_states(s, reserve * 3 / 2 + 1) != SAM_OK ||
        grow_edges(s, edges) != SAM_OK)
        return SAM_ERR_NOMEM;
    if (new_state(s, 0, -1, -1) != 0) return SAM_ERR_NOMEM;
    return SAM_OK;
}

static void free_sam(Sam *s) {
    free(s->tokens);
    free(s->len);
    free(s->link);
    free(s->pos);
    free(s->first_edge);
    free(s->edge_next);
    free(s->edge_token);
    free(s->hash);
    free(s->occ);
    free(s->last_end);
    free(s->best);
    memset(s, 0, sizeof(*s));
}

/* Bytes of heap the automaton holds (capacities, not just the used part). */
static int64_t sam_nbytes(const Sam *s) {
    int64_t per_state = (s->first_edge ? 16 : 12) + (s->occ ? 12 : 0); /* freeze() releases first_edge */
    return s->cap_tokens * 4 + s->cap_states * per_state + s->cap_edges * 8 + s->hash_cap * 12;
}

/* ---------------------------------------------------------------------------------------------------
 * 3. transition hash
 * ------------------------------------------------------------------------------------------------- */

/* Home slot of (state, token): a Fibonacci hash of the 64-bit key, mapped onto [0, cap) with a
 * multiply-high instead of a modulo, so the capacity need not be a power of two. */
static inline int64_t hash_home(int64_t cap, uint32_t state, uint32_t token) {
    uint64_t h = (((uint64_t)state << 32) | token) * UINT64_C(0x9E3779B97F4A7C15);
#if defined(__SIZEOF_INT128__)
    return (int64_t)(((unsigned __int128)h * (uint64_t)cap) >> 64);
#else
    return (int64_t)((h >> 32) * (uint64_t)cap >> 32); /* caps stay far below 2^32 slots */
#endif
}

/* Slot index holding (state, token), or the free slot where it would go. The load factor stays <= 3/4,
 * so a free slot always exists and probe runs are short. */
static inline int64_t hash_find(const Sam *s, uint32_t state, uint32_t token) {
    const uint32_t *h = s->hash;
    int64_t i = hash_home(s->hash_cap, state, token);
    for (;;) {
        const uint32_t *slot = h + 3 * i;
        if (slot[0] == SAM_EMPTY || (slot[0] == state && slot[1] == token)) return i;
        if (++i == s->hash_cap) i = 0;
    }
}

/* Target of the transition (state, token), or -1. */
static inline int32_t sam_go(const Sam *s, int32_t state, int32_t token) {
    const uint32_t *slot = s->hash + 3 * hash_find(s, (uint32_t)state, (uint32_t)token);
    return slot[0] == SAM_EMPTY ? -1 : (int32_t)slot[2];
}

static int hash_resize(Sam *s, int64_t cap) {
    uint32_t *old = s->hash, *fresh = hash_table_alloc(cap);
    int64_t old_cap = s->hash_cap;
    if (!fresh) return SAM_ERR_NOMEM;
    s->hash = fresh;
    s->hash_cap = cap;
    for (int64_t j = 0; j < old_cap; j++) {
        const uint32_t *src = old + 3 * j;
        if (src[0] == SAM_EMPTY) continue;
        uint32_t *dst = fresh + 3 * hash_find(s, src[0], src[1]);
        dst[0] = src[0];
        dst[1] = src[1];
        dst[2] = src[2];
    }
    free(old);
    return SAM_OK;
}

/* Adds the new transition (src, token) -> dst to the hash and to src's edge list. */
static int add_edge(Sam *s, int32_t src, int32_t token, int32_t dst) {
    if ((s->n_edges + 1) * 4 > s->hash_cap * 3) {
        int rc = hash_resize(s, next_cap(s->hash_cap, s->hash_cap + 1));
        if (rc != SAM_OK) return rc;
    }
    int rc = grow_edges(s, s->n_edges + 1);
    if (rc != SAM_OK) return rc;
    uint32_t *slot = s->hash + 3 * hash_find(s, (uint32_t)src, (uint32_t)token);
    slot[0] = (uint32_t)src;
    slot[1] = (uint32_t)token;
    slot[2] = (uint32_t)dst;
    int32_t e = (int32_t)s->n_edges++;
    s->edge_token[e] = token;
    s->edge_next[e] = s->first_edge[src];
    s->first_edge[src] = e;
    return SAM_OK;
}

/* ---------------------------------------------------------------------------------------------------
 * 4. online extension
 * ------------------------------------------------------------------------------------------------- */

/* Appends one token. On any failure except FROZEN/POISONED the automaton is poisoned: its structure may
 * be half-updated, so no query may ever read it again (they all answer "no match"). */
static int sam_append_one(Sam *s, int64_t token) {
    if (s->poisoned) return SAM_ERR_POISONED;
    if (s->frozen) return SAM_ERR_FROZEN;
    int rc = SAM_OK;
    if (token < 0 || token > INT32_MAX) rc = SAM_ERR_TOKEN;
    else if (s->n_tokens >= s->max_tokens) rc = SAM_ERR_FULL;
    else rc = grow_tokens(s, s->n_tokens + 1);
    if (rc != SAM_OK) {
        s->poisoned = 1;
        return rc;
    }
    int32_t c = (int32_t)token;

    /* the refresh recorded by the previous append: its end index is no longer the current end */
    if (s->refresh_state >= 0) {
        s->pos[s->refresh_state] = s->refresh_pos;
        s->refresh_state = -1;
    }
    int32_t i = (int32_t)s->n_tokens; /* end index of the new token */
    s->tokens[s->n_tokens++] = c;

    /* cursor-before-extend: match c against the automaton of tokens[0..i-1]. The walk ends at p, the
     * first state on the cursor's suffix-link path with a c-transition (-1: none), target q. */
    int32_t from = s->cur_state, p = from, l = s->cur_len, q = -1;
    while (p >= 0 && (q = sam_go(s, p, c)) < 0) {
        p = s->link[p];
        if (p >= 0) l = s->len[p];
    }
    if (p < 0) {
        s->cur_state = 0;
        s->cur_len = 0;
    } else {
        s->cur_state = q;
        s->cur_len = l + 1;
    }

    /* extend: the classical online construction. Its walk from `last` visits last (never has a
     * c-transition: nothing ends at i yet) and then exactly the states the cursor walk just proved to
     * lack c, because the cursor sits on link(last) (the invariant the tests check; a violation poisons).
     * So the edges to the new state are added without repeating those lookups. */
    if (s->n_tokens > 1 && s->link[s->last] != from) goto bound;
    int32_t cur = new_state(s, s->len[s->last] + 1, 0, i); /* endpos(cur) = {i} */
    if (cur < 0) goto nomem;
    if (add_edge(s, s->last, c, cur) != SAM_OK) goto nomem;
    if (s->n_tokens > 1)
        for (int32_t u = from; u != p; u = s->link[u])
            if (add_edge(s, u, c, cur) != SAM_OK) goto nomem;
    if (p >= 0) {
        if (s->len[p] + 1 == s->len[q]) {
            s->link[cur] = q;
        } else {
            /* split q: the clone takes the strings of length <= len(p)+1, which now also end at i.
             * Its sample is inherited from q (an earlier member of the clone's endpos), never i. */
            int32_t clone = new_state(s, s->len[p] + 1, s->link[q], s->pos[q]);
            if (clone < 0) goto nomem;
            for (int32_t e = s->first_edge[q]; e >= 0; e = s->edge_next[e]) {
                int32_t tok = s->edge_token[e];
                if (add_edge(s, clone, tok, sam_go(s, q, tok)) != SAM_OK) goto nomem;
            }
            for (; p >= 0; p = s->link[p]) {
                uint32_t *slot = s->hash + 3 * hash_find(s, (uint32_t)p, (uint32_t)c);
                if (slot[0] == SAM_EMPTY || slot[2] != (uint32_t)q) break;
                slot[2] = (uint32_t)clone;
            }
            s->link[q] = clone;
            s->link[cur] = clone;
            /* clone fix-up: the cursor's string (a suffix of the stream ending at i) is one of the
             * clone's strings; its length is <= len(clone) because q's longer strings do not end at i */
            if (s->cur_state == q) s->cur_state = clone;
        }
    }
    s->last = cur;

    /* recency: the cursor matched an occurrence ending at i; record it on the state one append later */
    if (s->cur_len > 0) {
        s->refresh_state = s->cur_state;
        s->refresh_pos = i;
    }

    /* the classical bounds; a violation is a bug, and a buggy index must not serve drafts */
    if (s->n_states > 2 * s->n_tokens + 1 || s->n_edges > 3 * s->n_tokens) goto bound;
    return SAM_OK;

nomem:
    s->poisoned = 1;
    return SAM_ERR_NOMEM;
bound:
    s->poisoned = 1;
    return SAM_ERR_BOUND;
}

/* Appends n tokens, stopping at the first failure; *done receives how many were appended. */
static int sam_extend(Sam *s, const int32_t *tokens, int64_t n, int64_t *done) {
    int64_t k = 0;
    int rc = SAM_OK;
    for (; k < n; k++) {
        rc = sam_append_one(s, tokens[k]);
        if (rc != SAM_OK) break;
    }
    *done = k;
    return rc;
}

/* Frozen automata serve external cursors. The pending refresh is applied (its end index is a valid
 * sample and there is no "current end" to exclude any more), the edge pool is released (only cloning
 * needs it), the other arrays are trimmed to their used length and an oversized hash is rebuilt at
 * load ~3/4. */
static void sam_freeze(Sam *s) {
    if (s->frozen) return;
    s->frozen = 1;
    if (s->poisoned) return;
    if (s->refresh_state >= 0) {
        s->pos[s->refresh_state] = s->refresh_pos;
        s->refresh_state = -1;
    }
    free(s->edge_next);
    free(s->edge_token);
    free(s->first_edge);
    s->edge_next = s->edge_token = s->first_edge = NULL;
    s->cap_edges = 0;
    int64_t nt = s->n_tokens > 0 ? s->n_tokens : 1, ns = s->n_states;
    int32_t *t = realloc(s->tokens, (size_t)nt * sizeof(int32_t));
    if (t) {
        s->tokens = t;
        s->cap_tokens = nt;
    }
    int32_t **arrays[3] = {&s->len, &s->link, &s->pos};
    int ok = 1;
    for (int k = 0; k < 3; k++) {
        int32_t *a = realloc(*arrays[k], (size_t)ns * sizeof(int32_t));
        if (a) *arrays[k] = a;
        else ok = 0;
    }
    if (ok) s->cap_states = ns;
    if (s->n_edges * 2 < s->hash_cap) hash_resize(s, s->n_edges * 4 / 3 + 16); /* on failure: keep it */
}

/* ---------------------------------------------------------------------------------------------------
 * 5. queries
 * ------------------------------------------------------------------------------------------------- */

static int32_t sam_match_len(const Sam *s) { return s->poisoned ? 0 : s->cur_len; }

/* End index of the sampled earlier occurrence of the matched suffix; -1 without a match. */
static int64_t sam_match_pos(const Sam *s) {
    return (s->poisoned || s->cur_len == 0) ? -1 : s->pos[s->cur_state];
}

/* Draft from the internal cursor: the tokens that followed the sampled earlier occurrence. When that
 * continuation runs into the present (the occurrence ends within `limit` tokens of the end) the copy
 * overlaps itself, as in LZ77: the drafted tokens continue the period, so a stream that repeats with
 * period d keeps drafting its period instead of stopping at the end. Always fills `limit` tokens when
 * there is a match. */
static int64_t sam_draft(const Sam *s, int32_t *buf, int64_t limit) {
    int64_t start = sam_match_pos(s) + 1, n = s->n_tokens;
    if (start <= 0) return 0;
    for (int64_t j = 0; j < limit; j++) {
        int64_t k = start + j;
        buf[j] = k < n ? s->tokens[k] : buf[k - n]; /* start < n, so k - n < j */
    }
    return limit;
}

static void sam_cursor_reset(SamCursor *c) {
    c->state = 0;
    c->len = 0;
}

static void sam_cursor_advance(const Sam *s, SamCursor *c, const int32_t *tokens, int64_t n) {
    if (s->poisoned) return;
    int32_t v = c->state, l = c->len;
    for (int64_t k = 0; k < n; k++) {
        int32_t t = -1;
        while (v >= 0 && (t = sam_go(s, v, tokens[k])) < 0) {
            v = s->link[v];
            if (v >= 0) l = s->len[v];
        }
        if (v < 0) {
            v = 0;
            l = 0;
        } else {
            v = t;
            l = l + 1;
        }
    }
    c->state = v;
    c->len = l;
}

static int32_t sam_cursor_match_len(const Sam *s, const SamCursor *c) { return s->poisoned ? 0 : c->len; }

static int64_t sam_cursor_match_pos(const Sam *s, const SamCursor *c) {
    return (s->poisoned || c->len == 0) ? -1 : s->pos[c->state];
}

/* Draft from an external cursor: the indexed stream after the sampled occurrence, cut at its end. */
static int64_t sam_cursor_draft(const Sam *s, const SamCursor *c, int32_t *buf, int64_t limit) {
    int64_t start = sam_cursor_match_pos(s, c) + 1;
    if (start <= 0) return 0;
    int64_t k = s->n_tokens - start;
    if (k > limit) k = limit;
    if (k > 0) memcpy(buf, s->tokens + start, (size_t)k * sizeof(int32_t));
    return k;
}

/* ---------------------------------------------------------------------------------------------------
 * 6. occurrence counts
 *
 * An automaton over many documents (a process's past outputs, concatenated with separator tokens: labels
 * >= label_bound) answers "what did the documents most often write after the matched string?". Every
 * string of a state has the same endpos set, so |endpos| of a state counts the occurrences of each of its
 * strings, and the transition (v, t) -> w leads, from every string x of v, to the state of x.t: the
 * occurrences of x followed by t number exactly occ[w]. A frequency-ranked draft is then a walk that takes,
 * at each state, the continuation with the largest occ (ties: the largest last_end, i.e. the most recent
 * occurrence), precomputed per state so a drafted token costs one hash lookup.
 *
 * Computing them (freeze_counted, O(n)): the primary states are the states of the stream's prefixes, one
 * per end index (their endpos own that index); walking the stream from the root along its solid edges
 * reaches each in turn (a solid edge is never redirected by a later clone). Each state's endpos is its own
 * index (primaries) plus the union over its suffix-link children, so occ and last_end are summed / maxed
 * up the link tree in order of decreasing len (a counting sort). `best` is one pass over the hash slots.
 * Memory: 12 B/state more; the counts survive freeze(), the edge pool does not (nothing needs it then).
 * ------------------------------------------------------------------------------------------------- */

/* Computes occ / last_end / best of a complete (not yet frozen, not poisoned) automaton. */
static int sam_count(Sam *s, int32_t label_bound) {
    int64_t ns = s->n_states, n = s->n_tokens;
    s->occ = malloc((size_t)ns * sizeof(int32_t));
    s->last_end = malloc((size_t)ns * sizeof(int32_t));
    s->best = malloc((size_t)ns * sizeof(int32_t));
    int32_t *order = malloc((size_t)ns * sizeof(int32_t));      /* states by decreasing len */
    int32_t *bucket = calloc((size_t)n + 2, sizeof(int32_t));    /* counting sort by len, len <= n */
    int32_t *best_w = malloc((size_t)ns * sizeof(int32_t));     /* target state of best[v] */
    int rc = SAM_OK;
    if (!s->occ || !s->last_end || !s->best || !order || !bucket || !best_w) {
        rc = SAM_ERR_NOMEM;
        goto done;
    }
    for (int64_t v = 0; v < ns; v++) {
        s->occ[v] = 0;
        s->last_end[v] = -1;
        s->best[v] = -1;
        best_w[v] = -1;
    }
    int32_t v = 0;
    for (int64_t i = 0; i < n; i++) { /* the primary states, along the solid edges */
        v = sam_go(s, v, s->tokens[i]);
        if (v < 0) {
            rc = SAM_ERR_BOUND;
            goto done;
        }
        s->occ[v] = 1;
        s->last_end[v] = (int32_t)i;
    }
    for (int64_t u = 0; u < ns; u++) bucket[s->len[u]]++;
    for (int64_t l = n; l >= 0; l--) bucket[l] += bucket[l + 1]; /* bucket[l]: states with len >= l */
    for (int64_t u = 0; u < ns; u++) order[--bucket[s->len[u]]] = (int32_t)u;
    /* order[0 ..] is now by decreasing len (the root, len 0, last): children before their link */
    for (int64_t k = 0; k < ns; k++) {
        int32_t u = order[k], p = s->link[u];
        if (p < 0) continue;
        s->occ[p] += s->occ[u];
        if (s->last_end[u] > s->last_end[p]) s->last_end[p] = s->last_end[u];
    }
    for (int64_t j = 0; j < s->hash_cap; j++) {
        const uint32_t *slot = s->hash + 3 * j;
        if (slot[0] == SAM_EMPTY || slot[1] >= (uint32_t)label_bound) continue;
        int32_t src = (int32_t)slot[0], w = (int32_t)slot[2], b = best_w[src];
        if (b < 0 || s->occ[w] > s->occ[b] || (s->occ[w] == s->occ[b] && s->last_end[w] > s->last_end[b])) {
            best_w[src] = w;
            s->best[src] = (int32_t)slot[1];
        }
    }
done:
    free(order);
    free(bucket);
    free(best_w);
    if (rc != SAM_OK) {
        free(s->occ);
        free(s->last_end);
        free(s->best);
        s->occ = s->last_end = s->best = NULL;
    }
    return rc;
}

/* Occurrences of the cursor's matched string; 0 without a match or without counts. */
static int64_t sam_cursor_match_count(const Sam *s, const SamCursor *c) {
    return (s->poisoned || !s->occ || c->len == 0) ? 0 : s->occ[c->state];
}

/* The frequency-ranked draft from an external cursor: up to `limit` tokens, each the most frequent
 * continuation of the matched string extended by the tokens drafted before it; counts[j] (when not NULL)
 * receives the occurrences of that extension. The walk stops where the best continuation occurs fewer than
 * min_count times or in less than min_prob of its parent's occurrences (the matched string's for j = 0). */
static int64_t sam_cursor_draft_frequent(const Sam *s, const SamCursor *c, int32_t *buf, int32_t *counts,
                                         int64_t limit, int64_t min_count, double min_prob) {
    if (s->poisoned || !s->best || c->len == 0) return 0;
    int32_t v = c->state;
    int64_t parent = s->occ[v], j = 0;
    for (; j < limit; j++) {
        int32_t t = s->best[v];
        if (t < 0) break;
        int32_t w = sam_go(s, v, t);
        int64_t o = s->occ[w];
        if (o < min_count || (double)o < min_prob * (double)parent) break;
        buf[j] = t;
        if (counts) counts[j] = (int32_t)o;
        parent = o;
        v = w;
    }
    return j;
}

/* Cuts the cursor's match to its last max_len tokens: the state of that suffix is the one on the link
 * path whose length range holds max_len. Capping after a walk equals capping after every token. */
static void sam_cursor_cap(const Sam *s, SamCursor *c, int64_t max_len) {
    if (c->len <= max_len) return;
    int32_t v = c->state;
    while (s->link[v] >= 0 && s->len[s->link[v]] >= max_len) v = s->link[v];
    c->state = v;
    c->len = (int32_t)max_len;
}

/* ---------------------------------------------------------------------------------------------------
 * 7. CPython binding
 * ------------------------------------------------------------------------------------------------- */

static PyObject *DraftIndexError;    /* fucina_jax.errors.DraftIndexError */
static PyObject *IndexFrozenError;   /* fucina_jax.errors.IndexFrozenError */
static PyObject *IndexPoisonedError; /* fucina_jax.errors.IndexPoisonedError */

typedef struct {
    PyObject_HEAD
    Sam sam;
    int built; /* build_sam succeeded; guards free_sam and every method */
} SamObject;

typedef struct {
    PyObject_HEAD
    SamObject *owner; /* the frozen automaton the cursor walks (strong reference) */
    SamCursor cur;
} CursorObject;

static PyTypeObject SamType;
static PyTypeObject CursorType;

/* A 1-D token array argument, validated to ids in [0, INT32_MAX]. Contiguous native int32 buffers are
 * used in place (the hot path: one buffer request, one validation pass); anything else is copied. */
typedef struct {
    Py_buffer view;      /* held while data points into it */
    int has_view;
    const int32_t *data; /* [n] token ids */
    Py_ssize_t n;
    int32_t *owned;      /* malloc'd copy when the input was not a native int32 buffer */
} TokenArg;

static void token_arg_release(TokenArg *t) {
    if (t->has_view) PyBuffer_Release(&t->view);
    free(t->owned);
    t->has_view = 0;
    t->owned = NULL;
}

static int bad_token(Py_ssize_t k, long long value) {
    PyErr_Format(DraftIndexError, "token ids must be in [0, %d]; got %lld at position %zd", INT32_MAX, value, k);
    return -1;
}

/* Integer element kind of a buffer format string: size in bytes, negative for signed; 0 if unsupported. */
static int int_format(const char *fmt, Py_ssize_t itemsize) {
    if (!fmt) return 0;
    const int little = (*(const uint16_t *)"\x01\x00") == 1;
    if (*fmt == '@' || *fmt == '=') fmt++;
    else if (*fmt == '<') {
        if (!little) return 0;
        fmt++;
    } else if (*fmt == '>' || *fmt == '!') {
        if (little) return 0;
        fmt++;
    }
    if (fmt[0] == '\0' || fmt[1] != '\0' || !strchr("bBhHiIlLqQnN", fmt[0])) return 0;
    int size = (int)itemsize;
    if (size != 1 && size != 2 && size != 4 && size != 8) return 0;
    return strchr("bhilqn", fmt[0]) ? -size : size;
}

static int token_arg_read(PyObject *obj, TokenArg *t) {
    memset(t, 0, sizeof(*t));
    /* non-contiguous buffers (strided slices) fall through to the slower sequence path */
    int have_view = 0;
    if (PyObject_CheckBuffer(obj)) {
        if (PyObject_GetBuffer(obj, &t->view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) == 0) have_view = 1;
        else PyErr_Clear();
    }
    if (have_view) {
        t->has_view = 1;
        int kind = int_format(t->view.format, t->view.itemsize);
        if (t->view.ndim != 1 || kind == 0) {
            PyErr_Format(DraftIndexError,
                         "token arrays must be 1-D integer arrays (int32 preferred); got ndim=%d format '%s'",
                         t->view.ndim, t->view.format ? t->view.format : "B");
            token_arg_release(t);
            return -1;
        }
        Py_ssize_t n = t->view.shape[0];
        t->n = n;
        if (kind == -4) { /* native int32: validate in place */
            const int32_t *a = t->view.buf;
            for (Py_ssize_t k = 0; k < n; k++)
                if (a[k] < 0) {
                    bad_token(k, a[k]);
                    token_arg_release(t);
                    return -1;
                }
            t->data = a;
            return 0;
        }
        t->owned = malloc((size_t)(n > 0 ? n : 1) * sizeof(int32_t));
        if (!t->owned) {
            token_arg_release(t);
            PyErr_NoMemory();
            return -1;
        }
        const char *p = t->view.buf;
        for (Py_ssize_t k = 0; k < n; k++) {
            long long v;
            unsigned long long u = 0;
            int is_unsigned = kind > 0;
            switch (kind) {
            case -1: v = ((const int8_t *)p)[k]; break;
            case -2: v = ((const int16_t *)p)[k]; break;
            case -4: v = ((const int32_t *)p)[k]; break;
            case -8: v = ((const int64_t *)p)[k]; break;
            case 1: u = ((const uint8_t *)p)[k]; v = (long long)u; break;
            case 2: u = ((const uint16_t *)p)[k]; v = (long long)u; break;
            case 4: u = ((const uint32_t *)p)[k]; v = (long long)u; break;
            default: u = ((const uint64_t *)p)[k]; v = (long long)u; break;
            }
            if ((is_unsigned && u > INT32_MAX) || (!is_unsigned && (v < 0 || v > INT32_MAX))) {
                bad_token(k, v);
                token_arg_release(t);
                return -1;
            }
            t->owned[k] = (int32_t)v;
        }
        t->data = t->owned;
        return 0;
    }
    PyObject *seq = PySequence_Fast(obj, "tokens must be a 1-D integer array or a sequence of ints");
    if (!seq) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    t->n = n;
    t->owned = malloc((size_t)(n > 0 ? n : 1) * sizeof(int32_t));
    if (!t->owned) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t k = 0; k < n; k++) {
        int overflow = 0;
        long long v = PyLong_AsLongLongAndOverflow(items[k], &overflow);
        if (v == -1 && PyErr_Occurred()) {
            Py_DECREF(seq);
            token_arg_release(t);
            PyErr_Format(DraftIndexError, "token ids must be ints; got %R at position %zd", items[k], k);
            return -1;
        }
        if (overflow || v < 0 || v > INT32_MAX) {
            Py_DECREF(seq);
            token_arg_release(t);
            return bad_token(k, overflow ? -1 : v);
        }
        t->owned[k] = (int32_t)v;
    }
    Py_DECREF(seq);
    t->data = t->owned;
    return 0;
}

/* A writable 1-D native int32 buffer to draft into; *limit is clipped to its length. */
static int draft_buf_read(PyObject *obj, PyObject *limit_obj, Py_buffer *view, int64_t *limit) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE) < 0) {
        PyErr_Clear();
        PyErr_SetString(DraftIndexError, "the draft buffer must be a writable, contiguous 1-D int32 array");
        return -1;
    }
    if (view->ndim != 1 || int_format(view->format, view->itemsize) != -4) {
        PyBuffer_Release(view);
        PyErr_SetString(DraftIndexError, "the draft buffer must be a writable, contiguous 1-D int32 array");
        return -1;
    }
    int64_t n = view->shape[0];
    *limit = n;
    if (limit_obj && limit_obj != Py_None) {
        long long l = PyLong_AsLongLong(limit_obj);
        if (l == -1 && PyErr_Occurred()) {
            PyBuffer_Release(view);
            return -1;
        }
        if (l < 0) l = 0;
        if (l < n) *limit = l;
    }
    return 0;
}

static int check_built(SamObject *self) {
    if (!self->built) {
        PyErr_SetString(PyExc_RuntimeError, "SuffixAutomaton.__init__ was not called");
        return -1;
    }
    return 0;
}

static const char *sam_error_reason(int rc) {
    switch (rc) {
    case SAM_ERR_TOKEN: return "token id out of range";
    case SAM_ERR_FULL: return "max_tokens reached";
    case SAM_ERR_NOMEM: return "out of memory";
    case SAM_ERR_BOUND: return "state/transition bound violated (a bug; please report it)";
    default: return "unknown error";
    }
}

/* Maps an append result to a Python exception; returns 0 when the caller should return None. */
static int raise_append_error(SamObject *self, int rc) {
    if (rc == SAM_OK || rc == SAM_ERR_POISONED) return 0; /* appends to a poisoned index are ignored */
    if (rc == SAM_ERR_FROZEN) {
        PyErr_SetString(IndexFrozenError, "this suffix automaton is frozen (it serves external cursors); "
                                          "index more tokens in a new SuffixAutomaton");
        return -1;
    }
    PyErr_Format(IndexPoisonedError,
                 "append failed (%s) after %lld tokens; the index is poisoned and drafts nothing from now "
                 "on: build a new one",
                 sam_error_reason(rc), (long long)self->sam.n_tokens);
    return -1;
}

static PyObject *Sam_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    SamObject *self = (SamObject *)type->tp_alloc(type, 0);
    if (self) self->built = 0;
    return (PyObject *)self;
}

static int Sam_init(SamObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"max_tokens", "reserve", NULL};
    PyObject *max_obj = Py_None;
    long long reserve = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|$OL", kwlist, &max_obj, &reserve)) return -1;
    long long max_tokens = SAM_MAX_TOKENS;
    if (max_obj != Py_None) {
        max_tokens = PyLong_AsLongLong(max_obj);
        if (max_tokens == -1 && PyErr_Occurred()) return -1;
        if (max_tokens < 0 || max_tokens > SAM_MAX_TOKENS) {
            PyErr_Format(DraftIndexError, "max_tokens must be in [0, %lld]; got %lld", (long long)SAM_MAX_TOKENS,
                         max_tokens);
            return -1;
        }
    }
    if (reserve < 0) {
        PyErr_Format(DraftIndexError, "reserve must be >= 0; got %lld", reserve);
        return -1;
    }
    if (self->built) { /* re-initializing would pull the automaton out from under its cursors */
        PyErr_SetString(PyExc_RuntimeError, "SuffixAutomaton.__init__ may run only once");
        return -1;
    }
    if (build_sam(&self->sam, reserve, max_tokens) != SAM_OK) {
        free_sam(&self->sam);
        PyErr_NoMemory();
        return -1;
    }
    self->built = 1;
    return 0;
}

static void Sam_dealloc(SamObject *self) {
    if (self->built) free_sam(&self->sam);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Sam_append(SamObject *self, PyObject *arg) {
    if (check_built(self) < 0) return NULL;
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(arg, &overflow);
    if (v == -1 && PyErr_Occurred()) return NULL;
    if (overflow || v < 0 || v > INT32_MAX) {
        bad_token(0, overflow ? -1 : v);
        return NULL;
    }
    if (raise_append_error(self, sam_append_one(&self->sam, v)) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *Sam_extend(SamObject *self, PyObject *arg) {
    if (check_built(self) < 0) return NULL;
    if (self->sam.frozen && !self->sam.poisoned) return raise_append_error(self, SAM_ERR_FROZEN), NULL;
    TokenArg t;
    if (token_arg_read(arg, &t) < 0) return NULL; /* bad input: nothing appended, nothing poisoned */
    int64_t done = 0;
    int rc = sam_extend(&self->sam, t.data, t.n, &done);
    token_arg_release(&t);
    if (raise_append_error(self, rc) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *Sam_freeze(SamObject *self, PyObject *Py_UNUSED(ignored)) {
    if (check_built(self) < 0) return NULL;
    sam_freeze(&self->sam);
    Py_RETURN_NONE;
}

static PyObject *Sam_freeze_counted(SamObject *self, PyObject *arg) {
    if (check_built(self) < 0) return NULL;
    long long bound = PyLong_AsLongLong(arg);
    if (bound == -1 && PyErr_Occurred()) return NULL;
    if (bound < 0 || bound > INT32_MAX) {
        PyErr_Format(DraftIndexError, "label_bound must be in [0, %d]; got %lld", INT32_MAX, bound);
        return NULL;
    }
    Sam *s = &self->sam;
    if (s->frozen) {
        PyErr_SetString(DraftIndexError, "freeze_counted() needs an automaton that is not frozen yet (counting "
                                         "reads the edge pool freeze() releases)");
        return NULL;
    }
    if (!s->poisoned) {
        /* the deferred recency refresh is irrelevant here: the counts never read pos */
        int rc = sam_count(s, (int32_t)bound);
        if (rc == SAM_ERR_NOMEM) return PyErr_NoMemory();
        if (rc != SAM_OK) {
            s->poisoned = 1;
            return raise_append_error(self, rc), NULL;
        }
    }
    sam_freeze(s);
    Py_RETURN_NONE;
}

static PyObject *Sam_draft(SamObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (check_built(self) < 0) return NULL;
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "draft(buf, limit=None) takes 1 or 2 arguments");
        return NULL;
    }
    Py_buffer view;
    int64_t limit;
    if (draft_buf_read(args[0], nargs > 1 ? args[1] : NULL, &view, &limit) < 0) return NULL;
    int64_t n = sam_draft(&self->sam, view.buf, limit);
    PyBuffer_Release(&view);
    return PyLong_FromLongLong(n);
}

static PyObject *Sam_cursor(SamObject *self, PyObject *Py_UNUSED(ignored)) {
    if (check_built(self) < 0) return NULL;
    if (!self->sam.frozen) {
        PyErr_SetString(DraftIndexError, "external cursors need a frozen automaton (appends would split the "
                                         "states they sit on): call freeze() first");
        return NULL;
    }
    CursorObject *c = PyObject_New(CursorObject, &CursorType);
    if (!c) return NULL;
    Py_INCREF(self);
    c->owner = self;
    sam_cursor_reset(&c->cur);
    return (PyObject *)c;
}

static PyObject *Sam_tokens(SamObject *self, PyObject *Py_UNUSED(ignored)) {
    if (check_built(self) < 0) return NULL;
    return PyBytes_FromStringAndSize((const char *)self->sam.tokens, (Py_ssize_t)(self->sam.n_tokens * 4));
}

static PyObject *Sam_check_cursor_invariant(SamObject *self, PyObject *Py_UNUSED(ignored)) {
    /* the internal cursor equals (link(last), len(link(last))); exposed for the tests */
    if (check_built(self) < 0) return NULL;
    const Sam *s = &self->sam;
    if (s->poisoned) Py_RETURN_TRUE;
    int32_t l = s->link[s->last];
    int ok = s->n_tokens == 0 ? (s->cur_state == 0 && s->cur_len == 0)
                              : (s->cur_state == l && s->cur_len == s->len[l]);
    return PyBool_FromLong(ok);
}

static Py_ssize_t Sam_length(SamObject *self) { return self->built ? (Py_ssize_t)self->sam.n_tokens : 0; }

#define SAM_GETTER(name, expr)                                                                                 \
    static PyObject *Sam_get_##name(SamObject *self, void *Py_UNUSED(closure)) {                               \
        if (check_built(self) < 0) return NULL;                                                                \
        const Sam *s = &self->sam;                                                                             \
        return (expr);                                                                                         \
    }
SAM_GETTER(frozen, PyBool_FromLong(s->frozen))
SAM_GETTER(poisoned, PyBool_FromLong(s->poisoned))
SAM_GETTER(match_len, PyLong_FromLong(sam_match_len(s)))
SAM_GETTER(match_pos, PyLong_FromLongLong(sam_match_pos(s)))
SAM_GETTER(n_states, PyLong_FromLongLong(s->n_states))
SAM_GETTER(n_transitions, PyLong_FromLongLong(s->n_edges))
SAM_GETTER(nbytes, PyLong_FromLongLong(sam_nbytes(s)))
SAM_GETTER(max_tokens, PyLong_FromLongLong(s->max_tokens))
SAM_GETTER(counted, PyBool_FromLong(s->occ != NULL))

static PyMethodDef Sam_methods[] = {
    {"append", (PyCFunction)Sam_append, METH_O,
     "append(token): index one more token. Raises IndexFrozenError on a frozen index and IndexPoisonedError "
     "when the append fails (the index then drafts nothing; later appends are ignored)."},
    {"extend", (PyCFunction)Sam_extend, METH_O,
     "extend(tokens): append a 1-D integer array (int32 is used in place) or a sequence of ints. Invalid ids "
     "raise DraftIndexError before anything is appended."},
    {"freeze", (PyCFunction)Sam_freeze, METH_NOARGS,
     "freeze(): stop growing and allow external cursors; releases the edge pool. Idempotent."},
    {"freeze_counted", (PyCFunction)Sam_freeze_counted, METH_O,
     "freeze_counted(label_bound): count every state's occurrences and its most frequent continuation "
     "(labels >= label_bound are separators, never drafted), then freeze(). For Cursor.draft_frequent."},
    {"draft", (PyCFunction)(void (*)(void))Sam_draft, METH_FASTCALL,
     "draft(buf, limit=None) -> n: write the continuation of the sampled earlier occurrence of the matched "
     "suffix into buf[:n] (n = min(limit, len(buf)) with a match, 0 without). A continuation that reaches "
     "the end of the stream continues periodically (overlapping copy)."},
    {"cursor", (PyCFunction)Sam_cursor, METH_NOARGS,
     "cursor() -> Cursor: a new external cursor at the root (the index must be frozen)."},
    {"tokens", (PyCFunction)Sam_tokens, METH_NOARGS, "tokens() -> bytes: the indexed stream as native int32."},
    {"_check_cursor_invariant", (PyCFunction)Sam_check_cursor_invariant, METH_NOARGS,
     "True iff the internal cursor equals (link(last), len(link(last))) (a test hook)."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Sam_getset[] = {
    {"frozen", (getter)Sam_get_frozen, NULL, "True after freeze().", NULL},
    {"poisoned", (getter)Sam_get_poisoned, NULL, "True after a failed append: queries answer 'no match'.", NULL},
    {"match_len", (getter)Sam_get_match_len, NULL,
     "Length of the longest suffix of the stream with an occurrence ending before its end (tokens).", NULL},
    {"match_pos", (getter)Sam_get_match_pos, NULL,
     "End index of the sampled earlier occurrence the draft copies from; -1 without a match.", NULL},
    {"n_states", (getter)Sam_get_n_states, NULL, "States, root included (<= 2n+1).", NULL},
    {"n_transitions", (getter)Sam_get_n_transitions, NULL, "Transitions (<= 3n).", NULL},
    {"nbytes", (getter)Sam_get_nbytes, NULL, "Heap bytes held (allocated capacity).", NULL},
    {"max_tokens", (getter)Sam_get_max_tokens, NULL, "Appends beyond this many tokens fail (and poison).", NULL},
    {"counted", (getter)Sam_get_counted, NULL, "True after freeze_counted(): occurrence counts are available.",
     NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PySequenceMethods Sam_as_sequence = {.sq_length = (lenfunc)Sam_length};

static PyTypeObject SamType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "fucina_jax.index._sam.SuffixAutomaton",
    .tp_doc = "SuffixAutomaton(*, max_tokens=None, reserve=0): online suffix automaton over token ids "
              "(C core).",
    .tp_basicsize = sizeof(SamObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_new = Sam_new,
    .tp_init = (initproc)Sam_init,
    .tp_dealloc = (destructor)Sam_dealloc,
    .tp_methods = Sam_methods,
    .tp_getset = Sam_getset,
    .tp_as_sequence = &Sam_as_sequence,
};

static void Cursor_dealloc(CursorObject *self) {
    Py_XDECREF(self->owner);
    PyObject_Free(self);
}

static PyObject *Cursor_advance(CursorObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "advance(tokens, max_len=None) takes 1 or 2 arguments");
        return NULL;
    }
    long long max_len = -1;
    if (nargs > 1 && args[1] != Py_None) {
        max_len = PyLong_AsLongLong(args[1]);
        if (max_len == -1 && PyErr_Occurred()) return NULL;
        if (max_len < 0) {
            PyErr_Format(DraftIndexError, "max_len must be >= 0; got %lld", max_len);
            return NULL;
        }
    }
    TokenArg t;
    if (token_arg_read(args[0], &t) < 0) return NULL;
    sam_cursor_advance(&self->owner->sam, &self->cur, t.data, t.n);
    token_arg_release(&t);
    if (max_len >= 0) sam_cursor_cap(&self->owner->sam, &self->cur, max_len);
    Py_RETURN_NONE;
}

/* An optional int32 output array for draft counts: NULL view->buf for None; its length must cover limit. */
static int counts_buf_read(PyObject *obj, Py_buffer *view, int64_t limit) {
    view->buf = NULL;
    if (obj == NULL || obj == Py_None) return 0;
    int ok = PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE) == 0;
    if (!ok) PyErr_Clear();
    else if (view->ndim != 1 || int_format(view->format, view->itemsize) != -4 || view->shape[0] < limit) {
        PyBuffer_Release(view);
        ok = 0;
    }
    if (ok) return 0;
    view->buf = NULL;
    PyErr_SetString(DraftIndexError, "counts must be a writable, contiguous 1-D int32 array at least as long as "
                                     "the draft (min(limit, len(buf)))");
    return -1;
}

static PyObject *Cursor_draft_frequent(CursorObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 5) {
        PyErr_SetString(PyExc_TypeError, "draft_frequent(buf, limit=None, counts=None, min_count=1, min_prob=0.0) "
                                         "takes 1 to 5 arguments");
        return NULL;
    }
    long long min_count = 1;
    double min_prob = 0.0;
    if (nargs > 3) {
        min_count = PyLong_AsLongLong(args[3]);
        if (min_count == -1 && PyErr_Occurred()) return NULL;
    }
    if (nargs > 4) {
        min_prob = PyFloat_AsDouble(args[4]);
        if (min_prob == -1.0 && PyErr_Occurred()) return NULL;
    }
    Py_buffer view, cview;
    int64_t limit;
    if (draft_buf_read(args[0], nargs > 1 ? args[1] : NULL, &view, &limit) < 0) return NULL;
    if (counts_buf_read(nargs > 2 ? args[2] : NULL, &cview, limit) < 0) {
        PyBuffer_Release(&view);
        return NULL;
    }
    int64_t n = sam_cursor_draft_frequent(&self->owner->sam, &self->cur, view.buf, cview.buf, limit, min_count,
                                          min_prob);
    if (cview.buf) PyBuffer_Release(&cview);
    PyBuffer_Release(&view);
    return PyLong_FromLongLong(n);
}

static PyObject *Cursor_reset(CursorObject *self, PyObject *Py_UNUSED(ignored)) {
    sam_cursor_reset(&self->cur);
    Py_RETURN_NONE;
}

static PyObject *Cursor_draft(CursorObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "draft(buf, limit=None) takes 1 or 2 arguments");
        return NULL;
    }
    Py_buffer view;
    int64_t limit;
    if (draft_buf_read(args[0], nargs > 1 ? args[1] : NULL, &view, &limit) < 0) return NULL;
    int64_t n = sam_cursor_draft(&self->owner->sam, &self->cur, view.buf, limit);
    PyBuffer_Release(&view);
    return PyLong_FromLongLong(n);
}

static PyObject *Cursor_get_match_len(CursorObject *self, void *Py_UNUSED(closure)) {
    return PyLong_FromLong(sam_cursor_match_len(&self->owner->sam, &self->cur));
}

static PyObject *Cursor_get_match_pos(CursorObject *self, void *Py_UNUSED(closure)) {
    return PyLong_FromLongLong(sam_cursor_match_pos(&self->owner->sam, &self->cur));
}

static PyObject *Cursor_get_match_count(CursorObject *self, void *Py_UNUSED(closure)) {
    return PyLong_FromLongLong(sam_cursor_match_count(&self->owner->sam, &self->cur));
}

static PyObject *Cursor_get_index(CursorObject *self, void *Py_UNUSED(closure)) {
    Py_INCREF(self->owner);
    return (PyObject *)self->owner;
}

static PyMethodDef Cursor_methods[] = {
    {"advance", (PyCFunction)(void (*)(void))Cursor_advance, METH_FASTCALL,
     "advance(tokens, max_len=None): feed the cursor's own stream (1-D integer array or sequence of ints); "
     "max_len keeps the match to at most that many trailing tokens (the same as capping after every token)."},
    {"draft_frequent", (PyCFunction)(void (*)(void))Cursor_draft_frequent, METH_FASTCALL,
     "draft_frequent(buf, limit=None, counts=None, min_count=1, min_prob=0.0) -> n: over a freeze_counted() "
     "automaton, the most frequent continuation of the match (ties: the most recent), into buf[:n], n <= limit; "
     "counts[j] = occurrences of the match extended through buf[j]. Stops below min_count occurrences or "
     "below min_prob of the previous token's occurrences; 0 without a match or without counts."},
    {"reset", (PyCFunction)Cursor_reset, METH_NOARGS, "reset(): back to the root (no match)."},
    {"draft", (PyCFunction)(void (*)(void))Cursor_draft, METH_FASTCALL,
     "draft(buf, limit=None) -> n: the indexed stream after the sampled occurrence of the match, cut at the "
     "end of the indexed stream; 0 without a match."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Cursor_getset[] = {
    {"match_len", (getter)Cursor_get_match_len, NULL,
     "Length of the longest suffix of the cursor's stream that occurs in the index (tokens).", NULL},
    {"match_pos", (getter)Cursor_get_match_pos, NULL,
     "End index (in the indexed stream) of the sampled occurrence; -1 without a match.", NULL},
    {"match_count", (getter)Cursor_get_match_count, NULL,
     "Occurrences of the matched string in a freeze_counted() automaton; 0 without a match or counts.", NULL},
    {"index", (getter)Cursor_get_index, NULL, "The frozen SuffixAutomaton the cursor walks.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject CursorType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "fucina_jax.index._sam.Cursor",
    .tp_doc = "An external match cursor over a frozen SuffixAutomaton (create with SuffixAutomaton.cursor()).",
    .tp_basicsize = sizeof(CursorObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_dealloc = (destructor)Cursor_dealloc,
    .tp_methods = Cursor_methods,
    .tp_getset = Cursor_getset,
};

static struct PyModuleDef sam_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "fucina_jax.index._sam",
    .m_doc = "C core of the suffix automaton draft index (see sam.c).",
    .m_size = -1,
};

PyMODINIT_FUNC PyInit__sam(void) {
    PyObject *errors = PyImport_ImportModule("fucina_jax.errors");
    if (!errors) return NULL;
    DraftIndexError = PyObject_GetAttrString(errors, "DraftIndexError");
    IndexFrozenError = PyObject_GetAttrString(errors, "IndexFrozenError");
    IndexPoisonedError = PyObject_GetAttrString(errors, "IndexPoisonedError");
    Py_DECREF(errors);
    if (!DraftIndexError || !IndexFrozenError || !IndexPoisonedError) return NULL;
    if (PyType_Ready(&SamType) < 0 || PyType_Ready(&CursorType) < 0) return NULL;
    PyObject *m = PyModule_Create(&sam_module);
    if (!m) return NULL;
    Py_INCREF(&SamType);
    Py_INCREF(&CursorType);
    if (PyModule_AddObject(m, "SuffixAutomaton", (PyObject *)&SamType) < 0 ||
        PyModule_AddObject(m, "Cursor", (PyObject *)&CursorType) < 0 ||
        PyModule_AddIntConstant(m, "MAX_TOKENS", (long)SAM_MAX_TOKENS) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
