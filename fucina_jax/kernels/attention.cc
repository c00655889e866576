// Attention of query rows over the KV cache on the CPU, called from jax.jit through the XLA FFI.
//
//   out[b, t, h] = sum_j softmax_j(scale * q[b, t, h] . k[b, j, h / G]) * v[b, j, h / G]
//   over the visible slots j: j <= pos[b, t], and pos[b, t] - j < window on sliding layers (window > 0).
//
// A row map rows[n] (optional: an empty buffer is the identity, q's batch = the caches') lets a step compute n of
// the caches' B rows: step row b reads (and fucina_attention_write writes) cache row rows[b]. The other cache rows
// are neither read nor written, and a step row's arithmetic is the same whichever cache row it maps to.
//
// A tree mask tree[B, T] (optional: an empty buffer is a chain) makes the step's T rows a tree verify: pos is then
// each row's RoPE position (its stream position, root + depth), step row t lives in slot pos[b, 0] + t (the root's
// slot plus its index), and it sees the slots before the root's plus the step slots whose bit is set in tree[b, t]
// (its ancestors and itself), window permitting. Its visible slots are its prefix's in the same order (ancestors
// come before descendants), so a tree row is computed exactly as plain decoding computes its prefix's last row.
//
// Each (b, t, h) row is computed on its own, in one fixed order (dot products in 16 lanes folded by a fixed tree,
// the softmax sum and the weighted V sum in slot order), so a row is bitwise the same whatever the other rows of
// the step: decode and verify rows agree exactly. Only visible slots are read, so a step costs O(position) (O(window)
// on sliding layers), not O(cache capacity). The cache may be f32 or fp16 (each value widened exactly, then the same
// arithmetic). Compiled with -ffp-contract=off: the AVX-512 / AVX2 clones GCC makes of
// the row function do the same IEEE operations in the same order as the generic one.

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "parallel.h"

namespace ffi = xla::ffi;

namespace fucina {
int kernel_isa();       // qmatmul.cc: 0 AVX-512, 1 AVX2, 2 scalar (set_isa, FUCINA_KERNEL_ISA)
int kernel_best_isa();  // qmatmul.cc: the best this CPU has
}  // namespace fucina

namespace {

constexpr int kLanes = 16;

#define FUCINA_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))

// 16 floats as one GCC vector: elementwise IEEE operations, one zmm on AVX-512. GCC keeps a vector wider than the
// registers in memory, so the AVX2 and generic code use V16, the same 16 lanes as two 8-float halves: the same
// operation on every lane, so the same bits.
typedef float v16 __attribute__((vector_size(64), aligned(4), may_alias));
typedef float v8u __attribute__((vector_size(32), aligned(4), may_alias));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

struct V16 {
  v8 lo, hi;
  static V16 load(const float* p) {
    return {*reinterpret_cast<const v8u*>(p), *reinterpret_cast<const v8u*>(p + 8)};
  }
  static V16 splat(float x) { return {v8{} + x, v8{} + x}; }
  void store(float* p) const {
    *reinterpret_cast<v8u*>(p) = lo;
    *reinterpret_cast<v8u*>(p + 8) = hi;
  }
  V16 operator*(const V16& o) const { return {lo * o.lo, hi * o.hi}; }
  V16& operator+=(const V16& o) {
    lo += o.lo;
    hi += o.hi;
    return *this;
  }
};

// The native 16-lane vector with V16's interface (AVX-512 code).
struct W16 {
  v16 v;
  static W16 load(const float* p) { return {*reinterpret_cast<const v16*>(p)}; }
  static W16 splat(float x) { return {v16{} + x}; }
  void store(float* p) const { *reinterpret_cast<v16*>(p) = v; }
  W16 operator*(const W16& o) const { return {v * o.v}; }
  W16& operator+=(const W16& o) {
    v += o.v;
    return *this;
  }
};

// a . b[s] over n values for N vectors b[s] at once: per vector 16 partial sums, then a fixed halving tree. The N
// dot products are independent chains (4 keep the adder busy); each is computed exactly as with N = 1.
template <int N>
inline void dots_fixed(const float* a, const float* const* b, int64_t n, float* out) {
  V16 acc[N];
  for (int s = 0; s < N; ++s) acc[s] = V16::splat(0.0f);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const V16 av = V16::load(a + i);
    for (int s = 0; s < N; ++s) acc[s] += av * V16::load(b[s] + i);
  }
  for (int s = 0; s < N; ++s) {
    float t[kLanes];
    acc[s].store(t);
    for (int l = 0; i + l < n; ++l) t[l] += a[i + l] * b[s][i + l];
    for (int w = kLanes / 2; w >= 1; w /= 2)
      for (int l = 0; l < w; ++l) t[l] += t[l + w];
    out[s] = t[0];
  }
}

// The fixed halving tree of 16 partial sums (lane l += lane l + w for w = 8, 4, 2, 1) on vector halves.
inline float fold8(const v8& lo, const v8& hi) {
  const v8 s8 = lo + hi;
  v4 a, b;
  std::memcpy(&a, &s8, 16);
  std::memcpy(&b, reinterpret_cast<const char*>(&s8) + 16, 16);
  const v4 s4 = a + b;
  const float s2a = s4[0] + s4[2], s2b = s4[1] + s4[3];
  return s2a + s2b;
}
inline float fold16(const V16& x) { return fold8(x.lo, x.hi); }
inline float fold16(const W16& x) {
  v8 lo, hi;
  std::memcpy(&lo, &x.v, 32);
  std::memcpy(&hi, reinterpret_cast<const char*>(&x.v) + 32, 32);
  return fold8(lo, hi);
}

inline float dot_fixed(const float* a, const float* b, int64_t n) {
  float out;
  dots_fixed<1>(a, &b, n, &out);
  return out;
}

// exp(x) for x <= 0 (softmax after subtracting the max): Cody-Waite reduction x = n ln2 + r, a degree-6
// polynomial, scaling by 2^n through the exponent bits. ~1 ulp; a plain function of x, the same on every path.
inline float exp_neg(float x) {
  if (!(x > -87.0f)) return 0.0f;  // also NaN -> 0 is never reached: x is finite or -inf here
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187045e-06f;
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

struct Shape {
  int64_t B, T, H, Dh, S, K, Dv, G;
  int64_t Bc;                     // the caches' rows (B with no row map)
  const int32_t* rows = nullptr;  // step row b -> cache row rows[b] (nullptr: b)
  const int32_t* tree = nullptr;  // [B, T] ancestor masks of a tree verify (nullptr: a chain)

  int64_t cache_row(int64_t b) const { return rows ? rows[b] : b; }
};

// Query rows sharing one kv head computed together (a block): each K and V slot is read once for them. Up to
// kRows on AVX-512 (its 32 registers hold 8 rows' V sums 32 dims at a time), kRowsNarrow on the other code (16
// registers); rows_per_block says which.
constexpr int kRows = 8;
constexpr int kRowsNarrow = 4;

// Query rows q[r] (r < n_rows, Dh floats each) over the slots [lo[r], hi[r]] of one kv head (k and v point
// at slot 0; slots are kstride / vstride apart). Every row's arithmetic is the one-row algorithm, in its order:
// dot (16 partial sums over Dh, fixed tree) * scale per visible slot, max, exp and their sum in slot order, the
// weighted V sum in slot order from 0, times 1 / sum. Sharing the slot loads changes no row's result.
// The work comes in three phases, each a function of its own range: the scores of a range of slots, the softmax of
// a row, the V sums of a range of output dims. Every value is computed by one phase call, in the same order
// whichever ranges the calls get, so a block split across threads gives the bits of a block run on one.
struct Block {
  const float* const* q;
  float* const* out;
  int n_rows;
  const int64_t* lo;
  const int64_t* hi;
  const float* k;
  int64_t kstride;
  const float* v;
  int64_t vstride;
  int64_t Dh, Dv;
  float scale;
  float* scores;  // row r's score of slot j at scores[r * sstride + j - ulo]
  int64_t sstride;
  // A tree verify: slots from tbase on are the step's, and row r sees slot tbase + m iff bit m of tmask[r] is set
  // (tbase = INT64_MAX: a chain, every slot in [lo[r], hi[r]] is visible).
  int64_t tbase = INT64_MAX;
  uint32_t tmask[kRows] = {};
  int64_t ulo = INT64_MAX, uhi = -1;  // the union of the rows' visible ranges (empty: uhi < ulo)
  float inv[kRows];
  int level = 0;  // the code the block runs (cpu_level at the call's start: one level for all of its phases)

  bool visible(int r, int64_t j) const { return j < tbase || ((tmask[r] >> (j - tbase)) & 1u); }

  void init() {
    for (int r = 0; r < n_rows; ++r)
      if (hi[r] >= lo[r]) ulo = std::min(ulo, lo[r]), uhi = std::max(uhi, hi[r]);
  }
};

// Scores of every row over the slots [j0, j1) of the union (a slot a row cannot see is computed and ignored).
template <typename V, int R>
__attribute__((always_inline)) inline void block_scores_t(const Block& b, int64_t j0, int64_t j1) {
  // the fields as locals: stores to the scores then cannot make the compiler reload them
  const int64_t Dh = b.Dh, nv = Dh / kLanes * kLanes, kstride = b.kstride, sstride = b.sstride, ulo = b.ulo;
  const int n_rows = b.n_rows;
  const float scale = b.scale;
  const float* const kp = b.k;
  const float* q[R];
  for (int r = 0; r < R; ++r) q[r] = b.q[r < n_rows ? r : 0];
  float* const scores = b.scores;
  for (int64_t j = j0; j < j1; ++j) {
    const float* kj = kp + j * kstride;
    V acc[R];
    for (int r = 0; r < R; ++r) acc[r] = V::splat(0.0f);
    for (int64_t i = 0; i < nv; i += kLanes) {
      const V kv = V::load(kj + i);
      for (int r = 0; r < R; ++r)
        if (r < n_rows) acc[r] += V::load(q[r] + i) * kv;
    }
    for (int r = 0; r < n_rows; ++r) {
      if (nv < Dh) {
        float t[kLanes];
        acc[r].store(t);
        for (int l = 0; nv + l < Dh; ++l) t[l] += q[r][nv + l] * kj[nv + l];
        acc[r] = V::load(t);
      }
      scores[r * sstride + j - ulo] = fold16(acc[r]) * scale;
    }
  }
}

// Row r's softmax weights in place over its visible slots (max, then exp and their sum in slot order); 1 / sum.
// Cloned so that nearbyint is one instruction where the CPU has it (the same result as libm's call).
FUCINA_CLONES void block_softmax(Block& b, int r) {
  if (b.hi[r] < b.lo[r]) return;
  float* sc = b.scores + r * b.sstride - b.ulo;
  float m = -INFINITY;
  for (int64_t j = b.lo[r]; j <= b.hi[r]; ++j)
    if (b.visible(r, j)) m = std::max(m, sc[j]);
  float l = 0.0f;
  for (int64_t j = b.lo[r]; j <= b.hi[r]; ++j) {
    if (!b.visible(r, j)) continue;
    sc[j] = exp_neg(sc[j] - m);
    l += sc[j];
  }
  b.inv[r] = 1.0f / l;
}

// out[r][d] for the output dims of chunks [c0, c1): chunk c < Dv / kDb is dims [c kDb, (c + 1) kDb), summed over
// the row's slots in slot order with the dims x the rows in registers; chunk Dv / kDb is the tail past the last
// whole chunk, if any. Then times 1 / sum. A row that sees no slot gets zeros.
template <typename V, int kDb, int R>
__attribute__((always_inline)) inline void block_vsum_t(const Block& b, int64_t c0, int64_t c1) {
  constexpr int kC = kDb / kLanes;
  const int n_rows = b.n_rows;
  const int64_t ndv = b.Dv / kDb * kDb, full = b.Dv / kDb, ulo = b.ulo, uhi = b.uhi, vstride = b.vstride,
                sstride = b.sstride;
  const float* const vp = b.v;
  const float* const scores = b.scores;
  int64_t lo[R], hi[R];
  for (int r = 0; r < R; ++r) lo[r] = r < n_rows ? b.lo[r] : 0, hi[r] = r < n_rows ? b.hi[r] : -1;
  // slots every row sees (a chain's common range): summed without the tests
  int64_t clo = ulo, chi = b.tbase == INT64_MAX ? uhi : ulo - 1;
  for (int r = 0; r < n_rows; ++r) clo = std::max(clo, lo[r]), chi = std::min(chi, hi[r]);
  for (int64_t c = c0; c < c1; ++c) {
    const int64_t d0 = c * kDb, d1 = c < full ? d0 + kDb : b.Dv;
    if (c < full) {
      V acc[R][kC];
      for (int r = 0; r < R; ++r)
        for (int cc = 0; cc < kC; ++cc) acc[r][cc] = V::splat(0.0f);
      for (int64_t j = ulo; j <= uhi; ++j) {
        const float* vj = vp + j * vstride + d0;
        V vv[kC];
        for (int cc = 0; cc < kC; ++cc) vv[cc] = V::load(vj + cc * kLanes);
        if (j >= clo && j <= chi) {
          for (int r = 0; r < R; ++r) {
            if (r >= n_rows) continue;
            const V e = V::splat(scores[r * sstride + j - ulo]);
            for (int cc = 0; cc < kC; ++cc) acc[r][cc] += e * vv[cc];
          }
          continue;
        }
        for (int r = 0; r < R; ++r) {
          if (r >= n_rows || j < lo[r] || j > hi[r] || !b.visible(r, j)) continue;
          const V e = V::splat(scores[r * sstride + j - ulo]);
          for (int cc = 0; cc < kC; ++cc) acc[r][cc] += e * vv[cc];
        }
      }
      for (int r = 0; r < n_rows; ++r)
        for (int cc = 0; cc < kC; ++cc) acc[r][cc].store(b.out[r] + d0 + cc * kLanes);
    } else {
      for (int r = 0; r < n_rows; ++r) {
        float* o = b.out[r];
        for (int64_t d = ndv; d < d1; ++d) o[d] = 0.0f;
        for (int64_t j = lo[r]; j <= hi[r]; ++j) {
          if (!b.visible(r, j)) continue;
          const float e = scores[r * sstride + j - ulo];
          const float* vj = vp + j * vstride;
          for (int64_t d = ndv; d < d1; ++d) o[d] += e * vj[d];
        }
      }
    }
    for (int r = 0; r < n_rows; ++r) {
      float* o = b.out[r];
      if (hi[r] < lo[r]) {
        for (int64_t d = d0; d < d1; ++d) o[d] = 0.0f;
      } else {
        for (int64_t d = d0; d < d1; ++d) o[d] *= b.inv[r];
      }
    }
  }
}

// fold16 of 16 vectors at once: out[s] = fold16(a[s]). The halving tree's levels are done on vectors holding two,
// four, eight, then sixteen slots' lanes (each add pairs the lanes fold16 pairs), so every result has fold16's bits;
// the slots end in lane 4 (s % 4) + s / 4 and are put back in order by one permutation.
__attribute__((target("arch=x86-64-v4"))) inline __m512 fold16x16(const W16* a) {
  __m512 p[8], q[4], r[2];
  for (int i = 0; i < 8; ++i) {  // lane l + lane l + 8: [slot 2i's 8 sums, slot 2i + 1's]
    const __m512 x = (__m512)a[2 * i].v, y = (__m512)a[2 * i + 1].v;
    p[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x44), _mm512_shuffle_f32x4(x, y, 0xEE));
  }
  for (int k = 0; k < 4; ++k)  // l + l + 4: 128-bit lane m holds slot 4k + m's 4 sums
    q[k] = _mm512_add_ps(_mm512_shuffle_f32x4(p[2 * k], p[2 * k + 1], 0x88),
                         _mm512_shuffle_f32x4(p[2 * k], p[2 * k + 1], 0xDD));
  for (int m = 0; m < 2; ++m)  // l + l + 2: lane L holds slot 8m + L's 2 sums, then slot 8m + 4 + L's
    r[m] = _mm512_add_ps(_mm512_shuffle_ps(q[2 * m], q[2 * m + 1], 0x44),
                         _mm512_shuffle_ps(q[2 * m], q[2 * m + 1], 0xEE));
  // l + l + 1: element 4L + i holds slot L + 4i
  const __m512 t = _mm512_add_ps(_mm512_shuffle_ps(r[0], r[1], 0x88), _mm512_shuffle_ps(r[0], r[1], 0xDD));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), t);
}

// block_scores_t on AVX-512: where the head dim is whole vectors, 16 slots of a row at a time (their partial sums as
// block_scores_t forms them, folded together: fold16x16), the rest slot by slot. The same bits as block_scores_t.
__attribute__((target("arch=x86-64-v4"))) void block_scores_v4(const Block& b, int64_t j0, int64_t j1) {
  const int64_t Dh = b.Dh, kstride = b.kstride, sstride = b.sstride, ulo = b.ulo;
  if (Dh % kLanes == 0) {
    const __m512 scale = _mm512_set1_ps(b.scale);
    for (; j0 + kLanes <= j1; j0 += kLanes) {
      const float* k0 = b.k + j0 * kstride;
      for (int r = 0; r < b.n_rows; ++r) {
        const float* q = b.q[r];
        W16 acc[kLanes];
        for (int s = 0; s < kLanes; ++s) acc[s] = W16::splat(0.0f);
        for (int64_t i = 0; i < Dh; i += kLanes) {  // each slot's sums in block_scores_t's order: i ascending
          const W16 qi = W16::load(q + i);
          for (int s = 0; s < kLanes; ++s) acc[s] += qi * W16::load(k0 + s * kstride + i);
        }
        _mm512_storeu_ps(b.scores + r * sstride + j0 - ulo, _mm512_mul_ps(fold16x16(acc), scale));
      }
    }
  }
  block_scores_t<W16, kRows>(b, j0, j1);
}
// The output dims a V-sum pass of the block's code takes (its kDb): block_vsum and vsum_chunks both follow it.
inline int64_t vsum_dims(const Block& b) { return b.level == 4 ? (b.n_rows > kRowsNarrow ? 32 : 64) : 16; }

// V is W16 (AVX-512) or V16; kDb output dims of the V sum are accumulated per pass for up to R rows (the registers
// they take: 64 dims x 4 rows or 32 x 8 of AVX-512's 32 zmm, 16 x 4 of AVX2's 16 ymm); none changes any row's
// arithmetic.
__attribute__((target("arch=x86-64-v3"))) void block_scores_v3(const Block& b, int64_t j0, int64_t j1) {
  block_scores_t<V16, kRowsNarrow>(b, j0, j1);
}
void block_scores_generic(const Block& b, int64_t j0, int64_t j1) { block_scores_t<V16, kRowsNarrow>(b, j0, j1); }
__attribute__((target("arch=x86-64-v4"))) void block_vsum_v4(const Block& b, int64_t c0, int64_t c1) {
  if (vsum_dims(b) == 32) return block_vsum_t<W16, 32, kRows>(b, c0, c1);
  block_vsum_t<W16, 64, kRowsNarrow>(b, c0, c1);
}
__attribute__((target("arch=x86-64-v3"))) void block_vsum_v3(const Block& b, int64_t c0, int64_t c1) {
  block_vsum_t<V16, 16, kRowsNarrow>(b, c0, c1);
}
void block_vsum_generic(const Block& b, int64_t c0, int64_t c1) { block_vsum_t<V16, 16, kRowsNarrow>(b, c0, c1); }

// 4 (AVX-512), 3 (AVX2) or 0 (generic): the best this CPU has, lowered where set_isa / FUCINA_KERNEL_ISA ask the
// kernels for lower code (all give the same bits).
int cpu_level() {
  static const int native = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("x86-64-v4") ? 4 : __builtin_cpu_supports("x86-64-v3") ? 3 : 0;
  }();
  const int isa = fucina::kernel_isa();
  if (isa == 2) return 0;
  if (isa == 1 && fucina::kernel_best_isa() == 0) return std::min(native, 3);
  return native;
}

void block_scores(const Block& b, int64_t j0, int64_t j1) {
  const int level = b.level;
  if (level == 4) return block_scores_v4(b, j0, j1);
  if (level == 3) return block_scores_v3(b, j0, j1);
  block_scores_generic(b, j0, j1);
}

// The V-sum chunks of a block: Dv / kDb whole ones (kDb = vsum_dims), plus one for a tail.
int64_t vsum_chunks(const Block& b) {
  const int64_t kDb = vsum_dims(b);
  return b.Dv / kDb + (b.Dv % kDb != 0);
}

// Query rows a block takes with the code of `level`. AVX-512 reads a kv head's K and V once for up to 8 rows: a
// verify of SmolLM2 (3 query heads a kv head) at width 2 is one block a kv head, not two (2-5% off a width-2 or
// width-4 step of SmolLM2 and Gemma 3 at 128-400 cached tokens, docs/performance.md).
int64_t rows_per_block(int level) { return level == 4 ? kRows : kRowsNarrow; }

// exp_neg on 16 lanes: the same IEEE operations in the same order, lane by lane (nearbyint is a round to nearest
// even, the integer conversion exact), so every lane is exp_neg of its input bitwise.
__attribute__((target("arch=x86-64-v4"))) inline __m512 exp_neg16(__m512 x) {
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GT_OQ);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_sub_ps(_mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693145751953125f))),
                                 _mm512_mul_ps(n, _mm512_set1_ps(1.428606765330187045e-06f)));
  __m512 p = _mm512_set1_ps(1.0f / 720.0f);
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(0.5f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.0f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mov_ps(live, _mm512_mul_ps(p, _mm512_castsi512_ps(bits)));
}

// block_softmax of rows [r0, r1) on AVX-512, with its bits: a chain row's max 16 slots at a time (a max is exact,
// and the sign of a zero max changes no exp), every slot of a row's range through exp_neg16 (slots a tree row cannot
// see too: they are never read), then the rows' sums in slot order, the rows' chains interleaved.
__attribute__((target("arch=x86-64-v4"))) void softmax_rows_v4(Block& b, int r0, int r1) {
  const int64_t sstride = b.sstride, ulo = b.ulo;
  int64_t jlo = INT64_MAX, jhi = -1;
  for (int r = r0; r < r1; ++r) {
    const int64_t lo = b.lo[r], hi = b.hi[r];
    if (hi < lo) continue;
    jlo = std::min(jlo, lo), jhi = std::max(jhi, hi);
    float* sc = b.scores + r * sstride - ulo;
    float m = -INFINITY;
    int64_t j = lo;
    if (b.tbase == INT64_MAX) {
      __m512 mv = _mm512_set1_ps(-INFINITY);
      for (; j + kLanes <= hi + 1; j += kLanes) {
        const __m512 x = _mm512_loadu_ps(sc + j);
        mv = _mm512_mask_mov_ps(mv, _mm512_cmp_ps_mask(mv, x, _CMP_LT_OQ), x);
      }
      float lanes[kLanes];
      _mm512_storeu_ps(lanes, mv);
      for (int l = 0; l < kLanes; ++l) m = std::max(m, lanes[l]);
    }
    for (; j <= hi; ++j)
      if (b.visible(r, j)) m = std::max(m, sc[j]);
    const __m512 mv = _mm512_set1_ps(m);
    for (j = lo; j <= hi; j += kLanes) {
      const __mmask16 k = hi + 1 - j >= kLanes ? __mmask16(0xFFFF) : __mmask16((1u << (hi + 1 - j)) - 1);
      _mm512_mask_storeu_ps(sc + j, k, exp_neg16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, sc + j), mv)));
    }
  }
  // the sums: slots every row sees (a chain's common range) without tests, the others with them
  float l[kRows] = {};
  int64_t clo = jlo, chi = b.tbase == INT64_MAX ? jhi : jlo - 1;
  for (int r = r0; r < r1; ++r)
    if (b.hi[r] >= b.lo[r]) clo = std::max(clo, b.lo[r]), chi = std::min(chi, b.hi[r]);
    else chi = -1;  // a row that sees nothing: no common range
  auto edge = [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j)
      for (int r = r0; r < r1; ++r)
        if (j >= b.lo[r] && j <= b.hi[r] && b.visible(r, j)) l[r] += b.scores[r * sstride + j - ulo];
  };
  if (chi < clo) {
    edge(jlo, jhi + 1);
  } else {
    edge(jlo, clo);
    const float* sr[kRows];
    for (int r = 0; r < kRows; ++r) sr[r] = b.scores + (r0 + r < r1 ? r0 + r : r0) * sstride - ulo;
    float a[kRows] = {};
    for (int r = 0; r < kRows; ++r) a[r] = l[r0 + r < r1 ? r0 + r : 0];
    const int n = r1 - r0;
    for (int64_t j = clo; j <= chi; ++j)
      for (int r = 0; r < kRows; ++r)
        if (r < n) a[r] += sr[r][j];
    for (int r = 0; r < n; ++r) l[r0 + r] = a[r];
    edge(chi + 1, jhi + 1);
  }
  for (int r = r0; r < r1; ++r)
    if (b.hi[r] >= b.lo[r]) b.inv[r] = 1.0f / l[r];
}

// block_softmax of the rows [r0, r1).
void block_softmax_rows(Block& b, int r0, int r1) {
  if (b.level == 4) return softmax_rows_v4(b, r0, r1);
  for (int r = r0; r < r1; ++r) block_softmax(b, r);
}

void block_vsum(const Block& b, int64_t c0, int64_t c1) {
  const int level = b.level;
  if (level == 4) return block_vsum_v4(b, c0, c1);
  if (level == 3) return block_vsum_v3(b, c0, c1);
  block_vsum_generic(b, c0, c1);
}

// A block on this thread, or its phases split across the pool (the same bits: see Block).
void attend(Block& b, xla::ffi::ThreadPool* pool) {
  b.init();
  if (pool == nullptr || b.uhi < b.ulo) {
    if (b.uhi >= b.ulo) block_scores(b, b.ulo, b.uhi + 1);
    block_softmax_rows(b, 0, b.n_rows);
    block_vsum(b, 0, vsum_chunks(b));
    return;
  }
  fucina::parallel_for(*pool, b.uhi + 1 - b.ulo,
                       [&](int64_t j0, int64_t j1) { block_scores(b, b.ulo + j0, b.ulo + j1); }, 2);
  fucina::parallel_for(*pool, b.n_rows, [&](int64_t r0, int64_t r1) {
    block_softmax_rows(b, static_cast<int>(r0), static_cast<int>(r1));
  }, 1);
  fucina::parallel_for(*pool, vsum_chunks(b), [&](int64_t c0, int64_t c1) { block_vsum(b, c0, c1); }, 1);
}

// An fp16 KV cache: the slots a block reads are widened to f32 first (exactly: every fp16 value is an f32 value),
// with F16C where the CPU has it, then attend runs on them as on an f32 cache, slot indices made relative.
// widen: n rows of d values, src rows `stride` apart, into dst rows d apart.
__attribute__((target("avx2,f16c"))) void widen_f16c(const uint16_t* src, int64_t stride, float* dst, int64_t n,
                                                      int64_t d) {
  for (int64_t j = 0; j < n; ++j, src += stride, dst += d) {
    int64_t i = 0;
    for (; i + 8 <= d; i += 8)
      _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
    for (; i < d; ++i) dst[i] = static_cast<float>(reinterpret_cast<const _Float16*>(src)[i]);
  }
}

void widen_plain(const uint16_t* src, int64_t stride, float* dst, int64_t n, int64_t d) {
  for (int64_t j = 0; j < n; ++j, src += stride, dst += d)
    for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<float>(reinterpret_cast<const _Float16*>(src)[i]);
}

// f32 -> fp16, rounded to nearest even (XLA's convert does the same), with F16C where the CPU has it.
__attribute__((target("avx2,f16c"))) void narrow_f16c(const float* src, uint16_t* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  for (; i < n; ++i) reinterpret_cast<_Float16*>(dst)[i] = static_cast<_Float16>(src[i]);
}

void narrow_plain(const float* src, uint16_t* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) reinterpret_cast<_Float16*>(dst)[i] = static_cast<_Float16>(src[i]);
}

bool has_f16c() {
  static const bool f16c = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  }();
  return f16c;
}

void widen(const uint16_t* src, int64_t stride, float* dst, int64_t n, int64_t d) {
  has_f16c() ? widen_f16c(src, stride, dst, n, d) : widen_plain(src, stride, dst, n, d);
}

void narrow(const float* src, uint16_t* dst, int64_t n) {
  has_f16c() ? narrow_f16c(src, dst, n) : narrow_plain(src, dst, n);
}

// A thread's scratch floats (the scores, an fp16 cache's widened slots), kept from call to call and uninitialised:
// every value is written before it is read. A decode step makes hundreds of attention calls, and allocating and
// zero-filling their buffers each time cost more than a short call's work. A buffer over kKeepFloats (a long
// context's) is let go after the call that needed it.
class Scratch {
 public:
  static constexpr size_t kKeepFloats = size_t{1} << 20;
  float* get(int64_t n) {
    const size_t want = static_cast<size_t>(std::max<int64_t>(n, 1));
    if (want > size_) data_.reset(new float[want]), size_ = want;
    return data_.get();
  }
  void trim() {
    if (size_ > kKeepFloats) data_.reset(), size_ = 0;
  }

 private:
  std::unique_ptr<float[]> data_;
  size_t size_ = 0;
};

// A block of an fp16 cache over its kv head's slots widened from slot `base` on (widen, covering every slot
// the block's rows see): attend on them as on an f32 cache, slot indices made relative to base.
void attend_widened(Block& b, int64_t base, const float* kbuf, const float* vbuf, xla::ffi::ThreadPool* pool) {
  int64_t rlo[kRows], rhi[kRows];
  for (int r = 0; r < b.n_rows; ++r) {
    rlo[r] = b.hi[r] >= b.lo[r] ? b.lo[r] - base : 0;
    rhi[r] = b.hi[r] >= b.lo[r] ? b.hi[r] - base : -1;
  }
  Block w{b.q, b.out, b.n_rows, rlo, rhi, kbuf, b.Dh, vbuf, b.Dv, b.Dh, b.Dv, b.scale, b.scores, b.sstride};
  w.level = b.level;
  if (b.tbase != INT64_MAX) {  // slot indices made relative, the tree's too
    w.tbase = b.tbase - base;
    std::memcpy(w.tmask, b.tmask, sizeof(w.tmask));
  }
  attend(w, pool);
}

// Shapes of q [B, T, H, Dh], the caches [Bc, S, K, D], pos [B, T], the row map rows [B] (or [0]: the identity,
// Bc = B) and the tree masks tree [B, T] (or [0]: a chain; T <= 32), or the error that they do not fit together.
// The map's entries must be distinct cache rows; a tree row must see itself and only rows up to its own.
ffi::Error check_shapes(const ffi::Buffer<ffi::F32>& q, const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                        const ffi::Buffer<ffi::S32>& pos, const ffi::Buffer<ffi::S32>& rows,
                        const ffi::Buffer<ffi::S32>& tree, const char* name, Shape* out) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(), pd = pos.dimensions(), rd = rows.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4 || pd.size() != 2 || rd.size() != 1)
    return ffi::Error::InvalidArgument(std::string(name) + ": q, k, v must be 4-D, pos 2-D and rows 1-D");
  Shape s{qd[0], qd[1], qd[2], qd[3], kd[1], kd[2], vd[3], 0, kd[0]};
  const bool mapped = rd[0] != 0;
  if ((mapped ? rd[0] != s.B : s.Bc != s.B) || vd[0] != s.Bc || vd[1] != s.S || vd[2] != s.K || kd[3] != s.Dh ||
      pd[0] != s.B || pd[1] != s.T || s.K == 0 || s.H % s.K)
    return ffi::Error::InvalidArgument(std::string(name) + ": inconsistent q/k/v/pos/rows shapes");
  if (mapped) {
    s.rows = rows.typed_data();
    std::vector<char> seen(static_cast<size_t>(s.Bc), 0);
    for (int64_t b = 0; b < s.B; ++b) {
      const int64_t r = s.rows[b];
      if (r < 0 || r >= s.Bc || seen[r])
        return ffi::Error::InvalidArgument(std::string(name) + ": the row map must hold distinct rows of the caches");
      seen[r] = 1;
    }
  }
  auto td = tree.dimensions();
  if (!(td.size() == 1 && td[0] == 0)) {
    if (td.size() != 2 || td[0] != s.B || td[1] != s.T || s.T > 32)
      return ffi::Error::InvalidArgument(std::string(name) + ": the tree masks must be [B, T] with T <= 32");
    s.tree = tree.typed_data();
    for (int64_t b = 0; b < s.B; ++b)
      for (int64_t t = 0; t < s.T; ++t) {
        const uint32_t m = static_cast<uint32_t>(s.tree[b * s.T + t]);
        if (!((m >> t) & 1u) || (t < 31 && (m >> (t + 1)) != 0))
          return ffi::Error::InvalidArgument(std::string(name) +
                                             ": a tree row must see itself and no row after it");
      }
  }
  s.G = s.H / s.K;
  const bool half = k.element_type() == ffi::DataType::F16;
  if ((!half && k.element_type() != ffi::DataType::F32) || v.element_type() != k.element_type())
    return ffi::Error::InvalidArgument(std::string(name) + ": the K and V caches must both be f32 or both f16");
  *out = s;
  return ffi::Error::Success();
}

// A block is split across the pool (its phases, see attend) when there are fewer blocks than threads and it has
// at least this much work (rows x visible slots x (Dh + Dv)): a single-block decode step over a long context.
constexpr int64_t kSplitWork = int64_t{1} << 19;

// Below this much work (rows x visible slots x (Dh + Dv)) a call runs on the calling thread alone.
constexpr int64_t kParallelWork = int64_t{1} << 16;

// Every query row of q over the caches k and v (f32, or fp16 when half), into out.
void attend_all(ffi::ThreadPool& pool, const Shape& s, const float* qp, const void* k, const void* v, bool half,
                const int32_t* pp, float* op, float scale, int64_t window) {
  const float* kp = static_cast<const float*>(k);
  const float* vp = static_cast<const float*>(v);
  const uint16_t* kh16 = static_cast<const uint16_t*>(k);
  const uint16_t* vh16 = static_cast<const uint16_t*>(v);
  // Work items: (batch row, kv head, block of rows_per_block of its T * G query rows).
  const int level = cpu_level();
  const int64_t rpb = rows_per_block(level);
  const int64_t per_head = s.T * s.G, blocks = (per_head + rpb - 1) / rpb, items = s.B * s.K * blocks;
  // Handing work to the kernels' spinning workers costs ~1 us, so only calls under kParallelWork stay on this
  // thread (at 2^18 a SmolLM2 decode step, 9 heads over 3 kv heads, ran its kv heads one after another up to ~230
  // cached tokens).
  int64_t span = 0;
  for (int64_t i = 0; i < s.B * s.T; ++i) span = std::max<int64_t>(span, std::min<int64_t>(pp[i] + 1, s.S));
  if (window > 0) span = std::min(span, window);
  const int64_t work = s.B * s.T * s.H * span * (s.Dh + s.Dv);
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  // fewer blocks than threads: each block's phases split across the pool
  xla::ffi::ThreadPool* split = items < threads && work / items >= kSplitWork ? &pool : nullptr;
  // The visible slots [lo, hi] of step row t of batch row b, and a tree row's mask of the step slots it sees.
  auto row_range = [&](int64_t b, int64_t t, int64_t* lo, int64_t* hi, uint32_t* mask) {
    const int64_t p = pp[b * s.T + t];
    *lo = window > 0 ? std::max<int64_t>(0, p - window + 1) : 0;
    if (s.tree) {  // the slots before the root's (window permitting), then the step rows of its mask
      const int64_t tbase = pp[b * s.T];  // the root's slot
      uint32_t m = 0;
      for (int64_t a = 0; a <= t; ++a)
        if (((static_cast<uint32_t>(s.tree[b * s.T + t]) >> a) & 1u) && (window <= 0 || p - pp[b * s.T + a] < window))
          m |= 1u << a;
      *mask = m;
      *lo = std::min(*lo, tbase);
      *hi = std::min<int64_t>(m ? tbase + 31 - __builtin_clz(m) : tbase - 1, s.S - 1);
    } else {
      *hi = std::min<int64_t>(p, s.S - 1);
    }
  };
  auto run = [&](int64_t i0, int64_t i1) {
    thread_local Scratch score_buf, kbuf, vbuf;
    float* const scores = score_buf.get(rpb * s.S);
    // fp16: the slots of one kv head that any of its rows sees, widened once for all of the head's blocks
    int64_t wide_b = -1, wide_kh = -1, wide_lo = 0;
    float *kw = nullptr, *vw = nullptr;
    for (int64_t it = i0; it < i1; ++it) {
      const int64_t blk = it % blocks, kh = (it / blocks) % s.K, b = it / (blocks * s.K);
      const int64_t first = blk * rpb;
      const int n_rows = static_cast<int>(std::min<int64_t>(rpb, per_head - first));
      int64_t lo[kRows], hi[kRows];
      // Query row (t, g) of kv head kh is head h = kh * G + g.
      const float* qrow[kRows];
      float* orow[kRows];
      uint32_t tmask[kRows] = {};
      const int64_t tbase = s.tree ? pp[b * s.T] : INT64_MAX;  // a tree: the root's slot
      for (int r = 0; r < n_rows; ++r) {
        const int64_t tg = first + r, t = tg / s.G, g = tg % s.G, h = kh * s.G + g;
        row_range(b, t, &lo[r], &hi[r], &tmask[r]);
        qrow[r] = qp + ((b * s.T + t) * s.H + h) * s.Dh;
        orow[r] = op + ((b * s.T + t) * s.H + h) * s.Dv;
      }
      const int64_t cb = s.cache_row(b);
      const int64_t koff = (cb * s.S * s.K + kh) * s.Dh, voff = (cb * s.S * s.K + kh) * s.Dv;
      Block blk_{qrow, orow, n_rows, lo, hi, kp + koff, s.K * s.Dh, vp + voff, s.K * s.Dv, s.Dh, s.Dv, scale,
                 scores, s.S};
      blk_.level = level;
      if (s.tree) {
        blk_.tbase = tbase;
        std::memcpy(blk_.tmask, tmask, sizeof(tmask));
      }
      if (half) {
        if (b != wide_b || kh != wide_kh) {
          int64_t hlo = INT64_MAX, hhi = -1;
          for (int64_t t = 0; t < s.T; ++t) {
            int64_t l, h;
            uint32_t m;
            row_range(b, t, &l, &h, &m);
            if (h >= l) hlo = std::min(hlo, l), hhi = std::max(hhi, h);
          }
          if (hhi < hlo) hlo = 0, hhi = -1;
          const int64_t n = hhi - hlo + 1;
          kw = kbuf.get(n * s.Dh), vw = vbuf.get(n * s.Dv);
          widen(kh16 + koff + hlo * s.K * s.Dh, s.K * s.Dh, kw, n, s.Dh);
          widen(vh16 + voff + hlo * s.K * s.Dv, s.K * s.Dv, vw, n, s.Dv);
          wide_b = b, wide_kh = kh, wide_lo = hlo;
        }
        attend_widened(blk_, wide_lo, kw, vw, split);
      } else {
        attend(blk_, split);
      }
    }
    score_buf.trim(), kbuf.trim(), vbuf.trim();
  };
  if (work < kParallelWork || items == 1 || split != nullptr) {
    run(0, items);
  } else {
    fucina::parallel_for(pool, items, run, 2);
  }
}

ffi::Error AttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                         ffi::Buffer<ffi::S32> pos, ffi::Buffer<ffi::S32> rows, ffi::Buffer<ffi::S32> tree,
                         ffi::ResultBuffer<ffi::F32> out, float scale, int64_t window) {
  Shape s;
  if (ffi::Error e = check_shapes(q, k, v, pos, rows, tree, "fucina_attention", &s); e.failure()) return e;
  attend_all(pool, s, q.typed_data(), k.untyped_data(), v.untyped_data(), k.element_type() == ffi::DataType::F16,
             pos.typed_data(), out->typed_data(), scale, window);
  return ffi::Error::Success();
}

// Stores this step's K and V rows [B, T, K, D] at slot = position in the caches (a tree verify: slot = the root's
// position + row index) (the results, which XLA aliases to the cache arguments), step row b into cache row rows[b]
// (no map: b), dropping rows whose slot is outside [0, S); then attends as fucina_attention. An fp16 cache gets
// each value rounded to nearest even (as XLA's convert). One call where XLA needs two scatters.
ffi::Error AttentionWriteImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_new,
                              ffi::Buffer<ffi::F32> v_new, ffi::AnyBuffer k, ffi::AnyBuffer v,
                              ffi::Buffer<ffi::S32> pos, ffi::Buffer<ffi::S32> rows, ffi::Buffer<ffi::S32> tree,
                              ffi::ResultBuffer<ffi::F32> out, ffi::Result<ffi::AnyBuffer> k_out,
                              ffi::Result<ffi::AnyBuffer> v_out, float scale, int64_t window) {
  Shape s;
  if (ffi::Error e = check_shapes(q, k, v, pos, rows, tree, "fucina_attention_write", &s); e.failure()) return e;
  auto knd = k_new.dimensions(), vnd = v_new.dimensions();
  if (knd.size() != 4 || vnd.size() != 4 || knd[0] != s.B || knd[1] != s.T || knd[2] != s.K || knd[3] != s.Dh ||
      vnd[0] != s.B || vnd[1] != s.T || vnd[2] != s.K || vnd[3] != s.Dv ||
      k_out->element_count() != k.element_count() || v_out->element_count() != v.element_count() ||
      k_out->element_type() != k.element_type() || v_out->element_type() != v.element_type())
    return ffi::Error::InvalidArgument("fucina_attention_write: new rows or cache results do not fit the caches");
  const bool half = k.element_type() == ffi::DataType::F16;
  void* kc = k_out->untyped_data();
  void* vc = v_out->untyped_data();
  // XLA passes the argument's buffer as the result (aliased); if it ever made them two, carry the cache over first.
  if (kc != k.untyped_data()) std::memcpy(kc, k.untyped_data(), k.size_bytes());
  if (vc != v.untyped_data()) std::memcpy(vc, v.untyped_data(), v.size_bytes());
  const int32_t* pp = pos.typed_data();
  for (int64_t b = 0; b < s.B; ++b)
    for (int64_t t = 0; t < s.T; ++t) {
      const int64_t p = s.tree ? pp[b * s.T] + t : pp[b * s.T + t];  // the slot
      if (p < 0 || p >= s.S) continue;
      const int64_t nk = s.K * s.Dh, nv = s.K * s.Dv;
      const float* ks = k_new.typed_data() + (b * s.T + t) * nk;
      const float* vs = v_new.typed_data() + (b * s.T + t) * nv;
      const int64_t cb = s.cache_row(b);
      const int64_t kd = (cb * s.S + p) * nk, vd = (cb * s.S + p) * nv;
      if (half) {
        narrow(ks, static_cast<uint16_t*>(kc) + kd, nk);
        narrow(vs, static_cast<uint16_t*>(vc) + vd, nv);
      } else {
        std::memcpy(static_cast<float*>(kc) + kd, ks, nk * sizeof(float));
        std::memcpy(static_cast<float*>(vc) + vd, vs, nv * sizeof(float));
      }
    }
  attend_all(pool, s, q.typed_data(), kc, vc, half, pp, out->typed_data(), scale, window);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(FucinaAttentionWrite, AttentionWriteImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("window"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(FucinaAttention, AttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("window"));

// ------------------------------------------------------------------------------------------------------------------
// RMSNorm over the last axis: y = x / sqrt(mean(x^2) + eps) * w (no w: weightless), each row in one fixed order
// (16-lane partial sums, fixed tree), so a row's result does not depend on the other rows. Also the XLA op count:
// one call where XLA's version of a row-exact norm takes four or five fusions.
// ------------------------------------------------------------------------------------------------------------------

namespace {

FUCINA_CLONES
void norm_row(const float* x, const float* w, int64_t D, float eps, float* y) {
  const float ms = dot_fixed(x, x, D) * (1.0f / static_cast<float>(D));
  const float inv = 1.0f / std::sqrt(ms + eps);
  if (w) {
    for (int64_t d = 0; d < D; ++d) y[d] = x[d] * inv * w[d];
  } else {
    for (int64_t d = 0; d < D; ++d) y[d] = x[d] * inv;
  }
}

ffi::Error RmsNormImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                       ffi::ResultBuffer<ffi::F32> y, float eps) {
  auto xd = x.dimensions();
  if (xd.size() == 0) return ffi::Error::InvalidArgument("fucina_rms_norm: x must have at least one axis");
  const int64_t D = xd[xd.size() - 1];
  if (w.element_count() != 0 && static_cast<int64_t>(w.element_count()) != D)
    return ffi::Error::InvalidArgument("fucina_rms_norm: the weight must have the size of x's last axis");
  const int64_t rows = D ? static_cast<int64_t>(x.element_count()) / D : 0;
  const float* xp = x.typed_data();
  const float* wp = w.element_count() ? w.typed_data() : nullptr;
  float* yp = y->typed_data();
  // rows are short (D values): keep small calls on this thread
  if (rows * D < (1 << 16)) {
    for (int64_t r = 0; r < rows; ++r) norm_row(xp + r * D, wp, D, eps, yp + r * D);
  } else {
    fucina::parallel_for(pool, rows, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) norm_row(xp + r * D, wp, D, eps, yp + r * D);
    });
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(FucinaRmsNorm, RmsNormImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("eps"));

// ------------------------------------------------------------------------------------------------------------------
// RoPE, optionally after a per-head RMSNorm (Qwen3 / Gemma q- and k-norm), in one call: x [B, T, H, Dh] rotated on
// its first 2 * half dims by the angles whose cos/sin come precomputed in cs [B, T, half, 2] (NEOX pairs i and
// i + half; NORM pairs 2i and 2i + 1). The caller computes cs in XLA, once per step for every layer sharing the
// angles (XLA merges the identical computations), with the same cos/sin as layers.apply_rope.
// ------------------------------------------------------------------------------------------------------------------

namespace {

// The rotation rounds as ggml's rope compiled by GCC (and XLA's fused rope) do: y0 = fma(x0, c, -(x1 s)),
// y1 = fma(x0, s, x1 c). Spelled with explicit fmaf and not vectorised (GCC 12's SLP vectoriser otherwise makes its
// own vfmaddsub choices, even under -ffp-contract=off). Cloned so that fmaf is the FMA instruction where the CPU has
// one (the baseline build calls libm's fmaf: 3-4x slower here; both are the exact fused operation). Pairs from
// `from` on: the vector code below leaves it the pairs past its last whole vector.
FUCINA_CLONES __attribute__((optimize("no-tree-vectorize"))) void rotate_pairs(float* y, const float* cs,
                                                                               int64_t from, int64_t half, bool neox) {
  for (int64_t i = from; i < half; ++i) {
    const int64_t a = neox ? i : 2 * i, b = neox ? i + half : 2 * i + 1;
    const float c = cs[2 * i], s = cs[2 * i + 1];
    const float x0 = y[a], x1 = y[b];
    y[a] = std::fmaf(x0, c, -(x1 * s));
    y[b] = std::fmaf(x0, s, x1 * c);
  }
}

// rotate_pairs with vectors: the same two operations per pair, lane by lane (-(x1 s) is the rounded product with
// its sign flipped, as the scalar negation), so every value has rotate_pairs' bits. NEOX pairs i and i + half: c
// and s are split out of cs's (c, s) pairs; NORM pairs 2i, 2i + 1 sit in adjacent lanes: x0 and x1 are duplicated
// into both lanes of their pair, and the pair's lanes take (c, s) and (s, c), the first's product negated.
__attribute__((target("arch=x86-64-v4"))) void rotate_pairs_v4(float* y, const float* cs, int64_t half, bool neox) {
  int64_t i = 0;
  if (neox) {
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    const __m512 sign = _mm512_set1_ps(-0.0f);
    for (; i + 16 <= half; i += 16) {
      const __m512 lo = _mm512_loadu_ps(cs + 2 * i), hi = _mm512_loadu_ps(cs + 2 * i + 16);
      const __m512 c = _mm512_permutex2var_ps(lo, even, hi), s = _mm512_permutex2var_ps(lo, odd, hi);
      const __m512 x0 = _mm512_loadu_ps(y + i), x1 = _mm512_loadu_ps(y + i + half);
      _mm512_storeu_ps(y + i, _mm512_fmadd_ps(x0, c, _mm512_xor_ps(_mm512_mul_ps(x1, s), sign)));
      _mm512_storeu_ps(y + i + half, _mm512_fmadd_ps(x0, s, _mm512_mul_ps(x1, c)));
    }
  } else {
    const __m512 first = _mm512_castsi512_ps(_mm512_set1_epi64(0x80000000LL));  // the sign of each pair's lane 0
    for (; i + 8 <= half; i += 8) {
      const __m512 v = _mm512_loadu_ps(y + 2 * i), csv = _mm512_loadu_ps(cs + 2 * i);
      const __m512 x1s = _mm512_mul_ps(_mm512_movehdup_ps(v), _mm512_permute_ps(csv, 0xB1));  // (x1 s, x1 c)
      _mm512_storeu_ps(y + 2 * i, _mm512_fmadd_ps(_mm512_moveldup_ps(v), csv, _mm512_xor_ps(x1s, first)));
    }
  }
  rotate_pairs(y, cs, i, half, neox);
}

__attribute__((target("arch=x86-64-v3"))) void rotate_pairs_v3(float* y, const float* cs, int64_t half, bool neox) {
  int64_t i = 0;
  if (neox) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (; i + 8 <= half; i += 8) {
      const __m256 lo = _mm256_loadu_ps(cs + 2 * i), hi = _mm256_loadu_ps(cs + 2 * i + 8);
      // shuffle_ps takes the even (odd) lanes of each 128-bit half; permute4x64 puts the four halves in order
      const __m256 c = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(lo, hi, 0x88)), 0xD8));
      const __m256 s = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(lo, hi, 0xDD)), 0xD8));
      const __m256 x0 = _mm256_loadu_ps(y + i), x1 = _mm256_loadu_ps(y + i + half);
      _mm256_storeu_ps(y + i, _mm256_fmadd_ps(x0, c, _mm256_xor_ps(_mm256_mul_ps(x1, s), sign)));
      _mm256_storeu_ps(y + i + half, _mm256_fmadd_ps(x0, s, _mm256_mul_ps(x1, c)));
    }
  } else {
    const __m256 first = _mm256_castsi256_ps(_mm256_set1_epi64x(0x80000000LL));
    for (; i + 4 <= half; i += 4) {
      const __m256 v = _mm256_loadu_ps(y + 2 * i), csv = _mm256_loadu_ps(cs + 2 * i);
      const __m256 x1s = _mm256_mul_ps(_mm256_movehdup_ps(v), _mm256_permute_ps(csv, 0xB1));
      _mm256_storeu_ps(y + 2 * i, _mm256_fmadd_ps(_mm256_moveldup_ps(v), csv, _mm256_xor_ps(x1s, first)));
    }
  }
  rotate_pairs(y, cs, i, half, neox);
}

FUCINA_CLONES
void norm_rope_row(const float* x, const float* w, int64_t Dh, float eps, bool norm, const float* cs,
                   int64_t half, bool neox, float* y, int level) {
  if (norm) {
    norm_row(x, w, Dh, eps, y);
  } else {
    std::memcpy(y, x, static_cast<size_t>(Dh) * sizeof(float));
  }
  if (level == 4) return rotate_pairs_v4(y, cs, half, neox);
  if (level == 3) return rotate_pairs_v3(y, cs, half, neox);
  rotate_pairs(y, cs, 0, half, neox);
}

ffi::Error NormRopeImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::F32> cs,
                        ffi::ResultBuffer<ffi::F32> y, float eps, int64_t norm, int64_t neox) {
  auto xd = x.dimensions(), cd = cs.dimensions();
  if (xd.size() != 4 || cd.size() != 4 || cd[0] != xd[0] || cd[1] != xd[1] || cd[3] != 2)
    return ffi::Error::InvalidArgument("fucina_norm_rope: x must be [B, T, H, Dh] and cs [B, T, half, 2]");
  const int64_t B = xd[0], T = xd[1], H = xd[2], Dh = xd[3], half = cd[2];
  if (2 * half > Dh || (w.element_count() != 0 && static_cast<int64_t>(w.element_count()) != Dh))
    return ffi::Error::InvalidArgument("fucina_norm_rope: the rotation or the norm weight does not fit the head");
  const float* xp = x.typed_data();
  const float* wp = w.element_count() ? w.typed_data() : nullptr;
  float* yp = y->typed_data();
  const int level = cpu_level();
  for (int64_t bt = 0; bt < B * T; ++bt)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t r = bt * H + h;
      norm_rope_row(xp + r * Dh, wp, Dh, eps, norm != 0, cs.typed_data() + bt * 2 * half, half, neox != 0,
                    yp + r * Dh, level);
    }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(FucinaNormRope, NormRopeImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("eps")
                                  .Attr<int64_t>("norm")
                                  .Attr<int64_t>("neox"));

// ------------------------------------------------------------------------------------------------------------------
// The residual step between sublayers, fused: h' = h + (post-norm(a) or a); x = norm(h', w_next). Two outputs, one
// call (XLA: two norms and an add). Same per-row order as norm_row.
// ------------------------------------------------------------------------------------------------------------------

namespace {

FUCINA_CLONES
void residual_row(const float* h, const float* a, const float* w_post, bool post, const float* w_next, int64_t D,
                  float eps, float* tmp, float* h_out, float* x_out) {
  if (post) {
    norm_row(a, w_post, D, eps, tmp);
    for (int64_t d = 0; d < D; ++d) h_out[d] = h[d] + tmp[d];
  } else {
    for (int64_t d = 0; d < D; ++d) h_out[d] = h[d] + a[d];
  }
  norm_row(h_out, w_next, D, eps, x_out);
}

ffi::Error ResidualNormImpl(ffi::Buffer<ffi::F32> h, ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> w_post,
                            ffi::Buffer<ffi::F32> w_next, ffi::ResultBuffer<ffi::F32> h_out,
                            ffi::ResultBuffer<ffi::F32> x_out, float eps, int64_t post) {
  auto hd = h.dimensions();
  if (hd.size() == 0 || h.element_count() != a.element_count())
    return ffi::Error::InvalidArgument("fucina_residual_norm: h and a must have the same shape");
  const int64_t D = hd[hd.size() - 1];
  if ((post && static_cast<int64_t>(w_post.element_count()) != D && w_post.element_count() != 0) ||
      (w_next.element_count() != 0 && static_cast<int64_t>(w_next.element_count()) != D))
    return ffi::Error::InvalidArgument("fucina_residual_norm: a norm weight does not fit the last axis");
  const int64_t rows = D ? static_cast<int64_t>(h.element_count()) / D : 0;
  std::vector<float> tmp(static_cast<size_t>(D));
  for (int64_t r = 0; r < rows; ++r)
    residual_row(h.typed_data() + r * D, a.typed_data() + r * D,
                 w_post.element_count() ? w_post.typed_data() : nullptr, post != 0,
                 w_next.element_count() ? w_next.typed_data() : nullptr, D, eps, tmp.data(),
                 h_out->typed_data() + r * D, x_out->typed_data() + r * D);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(FucinaResidualNorm, ResidualNormImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("eps")
                                  .Attr<int64_t>("post"));
