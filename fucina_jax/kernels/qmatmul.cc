// Quantized matmul y[M, N] = x[M, K] . W[N, K]^T on the CPU, called from jax.jit through the XLA FFI.
//
// Weights (packed once at load by fucina_jax/kernels/pack.py) are codes u of 4, 5, 6 or 8 bits with one scale a per
// sub-block of `bs` (16 or 32) values along K and, for affine types, one offset c:
//     symmetric  w = a * (u - zero)       (Q8_0, Q4_0, Q5_0, Q6_K: the GGUF value exactly; zero = 2^(bits-1))
//     affine     w = a * u + c            (Q4_1, Q5_1, Q4_K, Q5_K)
// Activations are quantized per row and per 32-block exactly like ggml's q8_0: d = max|x| / 127, xq = round(x / d)
// (to nearest even), and the block keeps dx = fp16(d), so a Q8_0/Q4_0/Q5_0/Q4_1/Q5_1 product equals llama.cpp's.
// Per 32-block b of a row and sub-block j, the integer dot I = sum(u * xq) is exact (vpdpbusd: u8 x s8 -> s32), and
// the float steps are one fixed sequence per output column:
//     symmetric  acc = fma(dx * a, float(I - zero * S), acc)         S = sum(xq) over the sub-block
//     affine     acc = fma(dx * a, float(I), acc);  acc = fma(dx * c, float(S), acc)
// so every output element is bitwise the same whatever M, the row's position in the batch, the thread count or the
// instruction set (AVX-512 VNNI, AVX2, scalar): the property the speculative decoder's "same stream" rests on.
// Built with -ffp-contract=off; never with -ffast-math (it would reorder the sequence above).
//
// Layout of one weight: output columns in groups of 16 (one AVX-512 lane each, so no horizontal reductions); per
// group and per 32-block along K, 8 chunks x 16 lanes x 4 consecutive K values = 512 bytes; scales/offsets are
// [group][block * (32 / bs) + j][16 lanes], f32 or (types whose file stores fp16 scales) fp16; K-quants keep the
// file's two levels (an fp16 scale per 256 values times a small integer per sub-block, see Weights::kscale), whose
// products the kernel forms exactly as the f32 the dequantizer computes. Codes of fewer than
// 8 bits take 64 * bits bytes per group and block: 256 bytes of nibbles (chunk c in the low (c < 4) or high nibble
// of double chunk c % 4, split back into bytes with one shift and two ands per 64 bytes), then a 64-byte plane per
// higher bit (8 bytes per chunk: bit p = that bit of the chunk's byte p), added back with one masked byte add.

#ifndef FUCINA_KERNEL_HARNESS  // scripts/bench_kernel_cycles.py builds the kernels alone, without the module
#include <Python.h>
#endif

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "parallel.h"
#include "select.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kLanes = 16;       // output columns per group
constexpr int kQB = 32;          // activation quantization block

// 4 activation bytes read as one int32 for a broadcast (unaligned, may alias int8 data).
typedef int32_t i32u __attribute__((aligned(1), may_alias));

// ------------------------------------------------------------------------------------------------------------------
// Activations
// ------------------------------------------------------------------------------------------------------------------

// Block-major ([block][row]) so the rows of one block, which a column group's pass reads together, are adjacent.
struct Act {
  int64_t M = 0, K = 0, nb = 0;
  std::vector<int8_t> q;     // [nb, M, 32]
  std::vector<float> d;      // [nb, M]
  std::vector<int32_t> s16;  // [nb, M, 2]: sum of xq over each half-block of 16
  std::vector<int32_t> corr;  // [nb, M, nsub]: per sub-block, zero * S (symmetric) or the bits of float(S) (affine)

  const int8_t* xq(int64_t r, int64_t b) const { return q.data() + (b * M + r) * kQB; }
  float dx(int64_t r, int64_t b) const { return d[b * M + r]; }
  int32_t sum(int64_t r, int64_t b, int j, int nsub) const {
    const int32_t* s = s16.data() + (b * M + r) * 2;
    return nsub == 2 ? s[j] : s[0] + s[1];
  }
  void make_corr(int nsub, bool affine, int32_t zero) {
    corr.resize(M * nb * nsub);
    for (int64_t b = 0; b < nb; ++b)
      for (int64_t r = 0; r < M; ++r)
        for (int j = 0; j < nsub; ++j) {
          const int32_t S = sum(r, b, j, nsub);
          int32_t v = zero * S;
          if (affine) {
            const float f = static_cast<float>(S);
            std::memcpy(&v, &f, 4);
          }
          corr[(b * M + r) * nsub + j] = v;
        }
  }
};

// One 32-block like ggml's q8_0: d = max|x| / 127, xq = round(x / d) to nearest even (through the f32 reciprocal, as
// ggml does), clamped to +-127; the block keeps dx = fp16(d) and the sums of xq over each half. Every step is an
// exact IEEE operation (max, one division, products, round-to-nearest-even, integer sums), so the AVX-512 version
// below gives the same bits as this one. A non-finite value poisons its block (dx = NaN, xq = 0), so NaN/inf inputs
// give NaN outputs as the f32 path would, never a silent garbage integer.
void quantize_block_scalar(const float* xb, int8_t* qb, float* dx, int32_t* s) {
  float amax = 0.0f;
  bool finite = true;
  for (int i = 0; i < kQB; ++i) {
    finite &= std::isfinite(xb[i]);
    amax = std::max(amax, std::fabs(xb[i]));
  }
  int32_t s0 = 0, s1 = 0;
  float d = amax / 127.0f;
  if (!finite) {
    d = NAN;
    std::memset(qb, 0, kQB);
  } else {
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    for (int i = 0; i < kQB; ++i) {
      float v = std::nearbyint(xb[i] * id);
      v = std::min(127.0f, std::max(-127.0f, v));
      qb[i] = static_cast<int8_t>(v);
      (i < 16 ? s0 : s1) += static_cast<int32_t>(v);
    }
  }
  *dx = static_cast<float>(static_cast<_Float16>(d));  // kept as fp16, as ggml's q8_0 blocks store it
  s[0] = s0;
  s[1] = s1;
}

// d rounded to fp16 and back with F16C: the same round-to-nearest-even as the scalar cast (which GCC compiles to
// libgcc's soft-float calls, ~40% of a block's time on AVX-512 before this).
__attribute__((target("f16c"))) inline float fp16_round(float d) {
  return _cvtsh_ss(_cvtss_sh(d, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

__attribute__((target("avx512f,avx512bw,f16c"))) void quantize_block_avx512(const float* xb, int8_t* qb, float* dx,
                                                                            int32_t* s) {
  const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
  const __m512 a0 = _mm512_abs_ps(x0), a1 = _mm512_abs_ps(x1);
  const __m512 inf = _mm512_set1_ps(INFINITY);
  // a < inf is false for inf and NaN
  const bool finite = (_mm512_cmp_ps_mask(a0, inf, _CMP_LT_OQ) & _mm512_cmp_ps_mask(a1, inf, _CMP_LT_OQ)) == 0xFFFF;
  if (!finite) {
    quantize_block_scalar(xb, qb, dx, s);
    return;
  }
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(a0, a1));
  const float d = amax / 127.0f;
  const __m512 id = _mm512_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
  const __m512 lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
  constexpr int kRne = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m512 v0 = _mm512_min_ps(hi, _mm512_max_ps(lo, _mm512_roundscale_ps(_mm512_mul_ps(x0, id), kRne)));
  const __m512 v1 = _mm512_min_ps(hi, _mm512_max_ps(lo, _mm512_roundscale_ps(_mm512_mul_ps(x1, id), kRne)));
  const __m512i i0 = _mm512_cvtps_epi32(v0), i1 = _mm512_cvtps_epi32(v1);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(qb), _mm512_cvtepi32_epi8(i0));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + 16), _mm512_cvtepi32_epi8(i1));
  *dx = fp16_round(d);
  s[0] = _mm512_reduce_add_epi32(i0);
  s[1] = _mm512_reduce_add_epi32(i1);
}

// out lane k = op over the 16 lanes of a[k] (op: max or add), by a transposing tree: each level pairs the lanes of
// two vectors, so 16 reductions cost 15 ops and ~31 shuffles instead of 16 x (4 ops + 4 shuffles). Only for exact ops
// here (max of non-negative floats; sums of at most 16 small integers held as floats): their order does not matter.
__attribute__((target("avx512f"), always_inline)) inline __m512 op16(__m512 x, __m512 y, bool max) {
  return max ? _mm512_max_ps(x, y) : _mm512_add_ps(x, y);
}

template <bool kMax>
__attribute__((target("avx512f"), always_inline)) inline __m512 reduce16x16(const __m512* a) {
  __m512 p[8], q[4], r[2];
  for (int i = 0; i < 8; ++i)
    p[i] = op16(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE), kMax);
  for (int k = 0; k < 4; ++k)
    q[k] = op16(_mm512_shuffle_f32x4(p[2 * k], p[2 * k + 1], 0x88),
                _mm512_shuffle_f32x4(p[2 * k], p[2 * k + 1], 0xDD), kMax);
  for (int m = 0; m < 2; ++m)
    r[m] = op16(_mm512_shuffle_ps(q[2 * m], q[2 * m + 1], 0x44), _mm512_shuffle_ps(q[2 * m], q[2 * m + 1], 0xEE), kMax);
  const __m512 t = op16(_mm512_shuffle_ps(r[0], r[1], 0x88), _mm512_shuffle_ps(r[0], r[1], 0xDD), kMax);
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), t);
}

// 16 consecutive blocks of one row (xb: 512 floats) at once: the same bits as quantize_block_avx512 on each (every
// step is the same exact IEEE operation per block, the reductions exact in any order), with the divisions, the fp16
// rounding and the horizontal reductions done 16 blocks per instruction. Block k goes to qb + k * qstep (bytes),
// dx[k * dstep], s[k * sstep] and s[k * sstep + 1]. Returns false, writing nothing, when a value is not finite (the
// caller then quantizes block by block, whose scalar path poisons the block).
__attribute__((target("avx512f,avx512bw,f16c"))) bool quantize16_avx512(const float* xb, int8_t* qb, int64_t qstep,
                                                                        float* dx, int64_t dstep, int32_t* s,
                                                                        int64_t sstep) {
  const __m512 inf = _mm512_set1_ps(INFINITY);
  __m512 m[16];
  __mmask16 finite = 0xFFFF;
  for (int k = 0; k < 16; ++k) {
    const __m512 a0 = _mm512_abs_ps(_mm512_loadu_ps(xb + 32 * k));
    const __m512 a1 = _mm512_abs_ps(_mm512_loadu_ps(xb + 32 * k + 16));
    finite &= _mm512_cmp_ps_mask(a0, inf, _CMP_LT_OQ) & _mm512_cmp_ps_mask(a1, inf, _CMP_LT_OQ);  // false: inf, NaN
    m[k] = _mm512_max_ps(a0, a1);
  }
  if (finite != 0xFFFF) return false;
  const __m512 amax = reduce16x16<true>(m);
  const __m512 d = _mm512_div_ps(amax, _mm512_set1_ps(127.0f));
  const __mmask16 nonzero = _mm512_cmp_ps_mask(d, _mm512_setzero_ps(), _CMP_NEQ_OQ);
  const __m512 id = _mm512_maskz_div_ps(nonzero, _mm512_set1_ps(1.0f), d);  // 1 / d, 0 where d is 0
  alignas(64) float dh[16], sums[2][16];
  _mm512_store_ps(dh, _mm512_cvtph_ps(_mm512_cvtps_ph(d, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
  const __m512 lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
  constexpr int kRne = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  for (int h = 0; h < 2; ++h) {  // each half-block of 16 values: its codes, then the 16 blocks' sums of that half
    __m512 v[16];
    for (int k = 0; k < 16; ++k) {
      const __m512 idk = _mm512_permutexvar_ps(_mm512_set1_epi32(k), id);
      const __m512 scaled = _mm512_mul_ps(_mm512_loadu_ps(xb + 32 * k + 16 * h), idk);
      v[k] = _mm512_min_ps(hi, _mm512_max_ps(lo, _mm512_roundscale_ps(scaled, kRne)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + k * qstep + 16 * h),
                       _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(v[k])));
    }
    _mm512_store_ps(sums[h], reduce16x16<false>(v));
  }
  for (int k = 0; k < 16; ++k) {
    dx[k * dstep] = dh[k];
    s[k * sstep] = static_cast<int32_t>(sums[0][k]);
    s[k * sstep + 1] = static_cast<int32_t>(sums[1][k]);
  }
  return true;
}

__attribute__((target("avx2"))) inline int32_t hsum8_avx2(__m256i t) {
  __m128i u = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
  u = _mm_add_epi32(u, _mm_shuffle_epi32(u, 0x4E));
  u = _mm_add_epi32(u, _mm_shuffle_epi32(u, 0xB1));
  return _mm_cvtsi128_si32(u);
}

// The same block with AVX2 (same bits: the same exact IEEE steps; _mm256_round_ps rounds to nearest even as
// nearbyint does in the default rounding mode).
__attribute__((target("avx2,fma,f16c"))) void quantize_block_avx2(const float* xb, int8_t* qb, float* dx, int32_t* s) {
  const __m256 sign = _mm256_set1_ps(-0.0f), inf = _mm256_set1_ps(INFINITY);
  __m256 x[4], a[4];
  int finite = 0xFF;
  for (int i = 0; i < 4; ++i) {
    x[i] = _mm256_loadu_ps(xb + 8 * i);
    a[i] = _mm256_andnot_ps(sign, x[i]);
    finite &= _mm256_movemask_ps(_mm256_cmp_ps(a[i], inf, _CMP_LT_OQ));  // false for inf and NaN
  }
  if (finite != 0xFF) {
    quantize_block_scalar(xb, qb, dx, s);
    return;
  }
  __m256 m = _mm256_max_ps(_mm256_max_ps(a[0], a[1]), _mm256_max_ps(a[2], a[3]));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float d = _mm_cvtss_f32(m4) / 127.0f;
  const __m256 id = _mm256_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
  const __m256 lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
  __m256i v[4];
  for (int i = 0; i < 4; ++i)
    v[i] = _mm256_cvtps_epi32(_mm256_min_ps(
        hi, _mm256_max_ps(lo, _mm256_round_ps(_mm256_mul_ps(x[i], id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC))));
  // int32 -> int8 in order: packs interleave the 128-bit halves, the final permute puts them back
  const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb),
                      _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  *dx = fp16_round(d);
  s[0] = hsum8_avx2(_mm256_add_epi32(v[0], v[1]));
  s[1] = hsum8_avx2(_mm256_add_epi32(v[2], v[3]));
}

// isa: 0 AVX-512, 1 AVX2, else scalar (all give the same bits).
void quantize_rows(const float* x, Act& a, int isa) {
  // block b of row r: its values, codes, scale and sums (consecutive blocks of a row are M entries apart in Act)
  const auto xb = [&](int64_t r, int64_t b) { return x + r * a.K + b * kQB; };
  const auto qb = [&](int64_t r, int64_t b) { return a.q.data() + (b * a.M + r) * kQB; };
  const auto dx = [&](int64_t r, int64_t b) { return a.d.data() + b * a.M + r; };
  const auto s = [&](int64_t r, int64_t b) { return a.s16.data() + (b * a.M + r) * 2; };
  for (int64_t r = 0; r < a.M; ++r) {
    int64_t b = 0;
    if (isa == 0)  // 16 blocks per pass where 16 remain; a pass holding a non-finite value goes block by block
      for (; b + 16 <= a.nb; b += 16)
        if (!quantize16_avx512(xb(r, b), qb(r, b), a.M * kQB, dx(r, b), a.M, s(r, b), a.M * 2))
          for (int64_t k = b; k < b + 16; ++k) quantize_block_avx512(xb(r, k), qb(r, k), dx(r, k), s(r, k));
    for (; b < a.nb; ++b) {
      if (isa == 0) {
        quantize_block_avx512(xb(r, b), qb(r, b), dx(r, b), s(r, b));
      } else if (isa == 1) {
        quantize_block_avx2(xb(r, b), qb(r, b), dx(r, b), s(r, b));
      } else {
        quantize_block_scalar(xb(r, b), qb(r, b), dx(r, b), s(r, b));
      }
    }
  }
}

// How a weight's scales are stored.
enum ScaleKind : int {
  kScaleF32,  // a (and c): [G, nb * nsub, 16] f32
  kScaleF16,  // the same in fp16 (the file's own block scales)
  kScaleK,    // K-quants, per group and super-block of 8 blocks: 16 fp16 d, then (Q4_K, Q5_K) 16 fp16 dmin, 8 x 16
              // uint8 sub-block scales, 8 x 16 uint8 mins (320 bytes), or (Q6_K, Q3_K) 16 x 16 int8 scales (288 bytes);
              // a = d * scale, c = -(dmin * min): both products exact in f32 (11-bit by 8-bit mantissas)
};

struct Weights {
  const uint8_t* q;  // [G, nb, 64 * bits]
  const void* a;     // scales: see ScaleKind
  const void* c;     // offsets for f32/f16 scales of affine types (else null)
  int64_t nb;
  int nsub;          // 32 / bs
  int kind;          // ScaleKind
  bool affine;       // w = a * u + c (else a * (u - zero))
  int bits;          // bits per code: 8 (one byte each), or 4..6 (nibbles + bits - 4 planes, see code())
  int32_t zero;      // symmetric types: w = a * (u - zero), zero = 2^(bits - 1)

  int64_t block_bytes() const { return 64 * bits; }
  int planes() const { return bits == 8 ? 0 : bits - 4; }
  // Code of chunk ci (0..7), lane l, value e of a group's block: byte codes are [ci][lane][e]; narrower codes keep
  // chunk ci % 4 of [ci % 4][lane][e] in the low (ci < 4) or high (ci >= 4) nibble, and bit 4 + k in plane k:
  // bit p % 8 of byte 256 + 64 k + 8 ci + p / 8, p = lane * 4 + e.
  int32_t code(const uint8_t* wb, int ci, int l, int e) const {
    if (bits == 8) return wb[(ci * kLanes + l) * 4 + e];
    int32_t u = (wb[((ci & 3) * kLanes + l) * 4 + e] >> (4 * (ci >> 2))) & 0x0F;
    const int p = l * 4 + e;
    for (int k = 0; k < planes(); ++k) u |= ((wb[256 + 64 * k + 8 * ci + p / 8] >> (p % 8)) & 1) << (4 + k);
    return u;
  }

  // Scale (or offset) i of `p` as f32, exactly (every fp16 value is an f32 value).
  float at(const void* p, int64_t i) const {
    return kind == kScaleF16 ? static_cast<float>(static_cast<const _Float16*>(p)[i]) : static_cast<const float*>(p)[i];
  }
  // The scales of group g start at element g * ns * 16 of a (and c).
  int64_t base(int64_t g) const { return g * nb * nsub * 16; }
  // kScaleK: bytes per group and super-block, and the super-block of block b of group g.
  int64_t kbytes() const { return affine ? 320 : 288; }
  const uint8_t* kblock(int64_t g, int64_t b) const {
    return static_cast<const uint8_t*>(a) + (g * (nb / 8) + b / 8) * kbytes();
  }
  static float half(const uint8_t* p) { return static_cast<float>(*reinterpret_cast<const _Float16*>(p)); }
  // Scale and offset of sub-block j of block b, lane l, of group g (the portable statement of the layout).
  float scale(int64_t g, int64_t b, int j, int l) const {
    if (kind != kScaleK) return at(a, base(g) + (b * nsub + j) * kLanes + l);
    const uint8_t* sb = kblock(g, b);
    const int64_t bi = b % 8;
    if (affine) return half(sb + 2 * l) * static_cast<float>(sb[64 + bi * 16 + l]);
    return half(sb + 2 * l) * static_cast<float>(static_cast<int8_t>(sb[32 + (bi * 2 + j) * 16 + l]));
  }
  float offset(int64_t g, int64_t b, int j, int l) const {
    if (kind != kScaleK) return at(c, base(g) + (b * nsub + j) * kLanes + l);
    const uint8_t* sb = kblock(g, b);
    return -(half(sb + 32 + 2 * l) * static_cast<float>(sb[192 + (b % 8) * 16 + l]));
  }
};

// Computes out[r, g*16 .. g*16+15] for rows [r0, r1) of one column group.
using GroupFn = void (*)(const Weights&, int64_t g, const Act&, int64_t r0, int64_t r1, float* out, int64_t ldo);
// Computes every row of the column groups [g0, g1).
using GroupsFn = void (*)(const Weights&, int64_t g0, int64_t g1, const Act&, float* out, int64_t ldo);

// ------------------------------------------------------------------------------------------------------------------
// Scalar (portable reference of the float sequence)
// ------------------------------------------------------------------------------------------------------------------

void group_scalar(const Weights& w, int64_t g, const Act& x, int64_t r0, int64_t r1, float* out, int64_t ldo) {
  const uint8_t* wq = w.q + g * w.nb * w.block_bytes();
  const int cps = 8 / w.nsub;  // 4-value chunks per sub-block
  for (int64_t r = r0; r < r1; ++r) {
    for (int l = 0; l < kLanes; ++l) {
      float acc = 0.0f;
      for (int64_t b = 0; b < w.nb; ++b) {
        const uint8_t* wb = wq + b * w.block_bytes();
        const float dx = x.dx(r, b);
        const int8_t* xb = x.xq(r, b);
        for (int j = 0; j < w.nsub; ++j) {
          int32_t I = 0;
          for (int ci = j * cps; ci < (j + 1) * cps; ++ci)
            for (int e = 0; e < 4; ++e)
              I += w.code(wb, ci, l, e) * xb[ci * 4 + e];
          const int32_t S = x.sum(r, b, j, w.nsub);
          const float a = w.scale(g, b, j, l);
          if (w.affine) {
            acc = std::fmaf(dx * a, static_cast<float>(I), acc);
            acc = std::fmaf(dx * w.offset(g, b, j, l), static_cast<float>(S), acc);
          } else {
            acc = std::fmaf(dx * a, static_cast<float>(I - w.zero * S), acc);
          }
        }
      }
      out[r * ldo + g * kLanes + l] = acc;
    }
  }
}

// ------------------------------------------------------------------------------------------------------------------
// AVX2 + FMA: 8 lanes per register, two halves per group. No VNNI: vpmaddubsw (u8 x s8 pairs -> s16, saturating)
// and vpmaddwd (s16 pairs -> s32), arranged so that nothing saturates (see rows_avx2).
// ------------------------------------------------------------------------------------------------------------------

// 8 scales from element i of p (f16 or f32) as f32.
__attribute__((target("avx2,fma,f16c"))) inline __m256 load8(const Weights& w, const void* p, int64_t i) {
  return w.kind == kScaleF16
             ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i)))
             : _mm256_loadu_ps(static_cast<const float*>(p) + i);
}

__attribute__((target("avx2,fma,f16c"))) inline __m256 half8(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// Lanes 8h..8h+7 of Weights::scale / Weights::offset.
__attribute__((target("avx2,fma,f16c"))) inline __m256 scale8(const Weights& w, int64_t g, int64_t b, int j, int h) {
  if (w.kind != kScaleK) return load8(w, w.a, w.base(g) + (b * w.nsub + j) * kLanes + 8 * h);
  const uint8_t* sb = w.kblock(g, b);
  const int64_t bi = b % 8;
  const __m128i s8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(
      sb + (w.affine ? 64 + bi * 16 : 32 + (bi * 2 + j) * 16) + 8 * h));
  const __m256 s = _mm256_cvtepi32_ps(w.affine ? _mm256_cvtepu8_epi32(s8) : _mm256_cvtepi8_epi32(s8));
  return _mm256_mul_ps(half8(sb + 16 * h), s);
}
__attribute__((target("avx2,fma,f16c"))) inline __m256 offset8(const Weights& w, int64_t g, int64_t b, int j, int h) {
  if (w.kind != kScaleK) return load8(w, w.c, w.base(g) + (b * w.nsub + j) * kLanes + 8 * h);
  const uint8_t* sb = w.kblock(g, b);
  const __m128i m8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sb + 192 + (b % 8) * 16 + 8 * h));
  const __m256 p = _mm256_mul_ps(half8(sb + 32 + 16 * h), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(m8)));
  return _mm256_xor_ps(p, _mm256_set1_ps(-0.0f));  // -(dmin * m), exactly as negation
}

// A column group's half h (lanes 8h..8h+7) for R rows: each 32-block's codes are decoded once into 8 vectors (8 lanes
// x 4 consecutive K values) and used by every row. vpmaddubsw takes the codes unsigned and the activations signed;
// codes of 4-6 bits never saturate it, and up to SUM of its results are added in 16 bits before vpmaddwd widens
// them (SUM * 2 * max code * 127 <= 32767). Byte codes u = w + 128 would saturate: they are multiplied as |w| by
// sign(w) * xq (2 * 128 * 127 < 32767), which gives sum(w * xq) = I - 128 S directly, the same integer.
constexpr int64_t kPrefetchBytes = 32768;

template <int R, int BITS, int NSUB, bool AFFINE>
__attribute__((target("avx2,fma,f16c"))) void rows_avx2(const Weights& w, int64_t g, const Act& x, int64_t r0,
                                                         float* out, int64_t ldo) {
  constexpr int kPlanes = BITS == 8 ? 0 : BITS - 4;
  constexpr int kSum = BITS == 8 ? 1 : BITS == 6 ? 2 : 4;
  constexpr int64_t bb = 64 * BITS;
  const uint8_t* wq = w.q + g * w.nb * bb;
  constexpr int nsub = NSUB, cps = 8 / NSUB;
  const __m256i nib = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  // plane bits -> bytes: byte i of a 32-byte half takes bit i % 8 of byte i / 8 of the half's 4 plane bytes
  const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3,
                                          3, 3, 3, 3, 3, 3);
  const __m256i bitsel = _mm256_set1_epi64x(0x8040201008040201LL);
  const int64_t xstep = x.M * kQB, dstep = x.M, cstep = x.M * nsub;
  for (int h = 0; h < 2; ++h) {
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    const int8_t* xb = x.xq(r0, 0);
    const float* dxb = x.d.data() + r0;
    const int32_t* cb = x.corr.data() + r0 * nsub;
    const uint8_t* blk = wq;
    for (int64_t b = 0; b < w.nb; ++b, blk += bb, xb += xstep, dxb += dstep, cb += cstep) {
      if (h == 0)  // the stream 32 KiB ahead (groups are contiguous): 7-18% faster from memory on a Zen 3
        for (int64_t o = 0; o < bb; o += 64) _mm_prefetch(reinterpret_cast<const char*>(blk + kPrefetchBytes + o), _MM_HINT_T0);
      __m256i cv[8], av[8];
#pragma GCC unroll 8
      for (int ci = 0; ci < 8; ++ci) {
        if (BITS == 8) {
          cv[ci] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + ci * 64 + 32 * h)),
                                    _mm256_set1_epi8(static_cast<char>(0x80)));  // w = u - 128 as int8
          av[ci] = _mm256_abs_epi8(cv[ci]);  // |w|; -128 stays 0x80, which vpmaddubsw reads as 128
        } else {
          // chunk ci sits in the low (ci < 4) or high nibble of double chunk ci % 4
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + (ci & 3) * 64 + 32 * h));
          __m256i u = _mm256_and_si256(ci < 4 ? v : _mm256_srli_epi16(v, 4), nib);
#pragma GCC unroll 2
          for (int k = 0; k < kPlanes; ++k) {
            int32_t p4;
            std::memcpy(&p4, blk + 256 + 64 * k + 8 * ci + 4 * h, 4);
            const __m256i set = _mm256_cmpeq_epi8(
                _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(p4), spread), bitsel), bitsel);
            u = _mm256_or_si256(u, _mm256_and_si256(set, _mm256_set1_epi8(static_cast<char>(16 << k))));
          }
          cv[ci] = u;
        }
      }
#pragma GCC unroll 2
      for (int j = 0; j < nsub; ++j) {
        const __m256 a = scale8(w, g, b, j, h);
        const __m256 c = AFFINE ? offset8(w, g, b, j, h) : _mm256_setzero_ps();
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const int8_t* xr = xb + r * kQB;
          __m256i I = _mm256_setzero_si256();
#pragma GCC unroll 8
          for (int ci = j * cps; ci < (j + 1) * cps; ci += kSum) {
            __m256i p16 = _mm256_setzero_si256();
#pragma GCC unroll 4
            for (int t = 0; t < kSum; ++t) {
              int32_t x4;
              std::memcpy(&x4, xr + (ci + t) * 4, 4);
              const __m256i xv = _mm256_set1_epi32(x4);
              const __m256i p = BITS == 8 ? _mm256_maddubs_epi16(av[ci + t], _mm256_sign_epi8(xv, cv[ci + t]))
                                          : _mm256_maddubs_epi16(cv[ci + t], xv);
              p16 = t == 0 ? p : _mm256_add_epi16(p16, p);
            }
            I = _mm256_add_epi32(I, _mm256_madd_epi16(p16, ones));
          }
          const __m256 dx = _mm256_set1_ps(dxb[r]);
          const int32_t corr = cb[r * nsub + j];
          if (AFFINE) {
            float S;
            std::memcpy(&S, &corr, 4);
            acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(dx, a), _mm256_cvtepi32_ps(I), acc[r]);
            acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(dx, c), _mm256_set1_ps(S), acc[r]);
          } else {
            if (BITS != 8) I = _mm256_sub_epi32(I, _mm256_set1_epi32(corr));  // byte codes: I is already I - 128 S
            acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(dx, a), _mm256_cvtepi32_ps(I), acc[r]);
          }
        }
      }
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + (r0 + r) * ldo + g * kLanes + 8 * h, acc[r]);
  }
}

template <int BITS, int NSUB, bool AFFINE>
void group_avx2_t(const Weights& w, int64_t g, const Act& x, int64_t r0, int64_t r1, float* out, int64_t ldo) {
  for (int64_t r = r0; r < r1;) {
    switch (std::min<int64_t>(r1 - r, 8)) {
      case 8: rows_avx2<8, BITS, NSUB, AFFINE>(w, g, x, r, out, ldo); r += 8; break;
      case 7: rows_avx2<7, BITS, NSUB, AFFINE>(w, g, x, r, out, ldo); r += 7; break;
      case 6: rows_avx2<6, BITS, NSUB, AFFINE>(w, g, x, r, out, ldo); r += 6; break;
      case 5: rows_avx2<5, BITS, NSUB, AFFINE>(w, g, x, r, out, ldo); r += 5; break;
      case 4: rows_avx2<4, BITS, NSUB, AFFINE>(w, g, x, r, out, ldo); r += 4; break;
      case 3: rows_avx2<3, BITS, NSUB, AFFINE>(w, g, x, r, out, ldo); r += 3; break;
      case 2: rows_avx2<2, BITS, NSUB, AFFINE>(w, g, x, r, out, ldo); r += 2; break;
      default: rows_avx2<1, BITS, NSUB, AFFINE>(w, g, x, r, out, ldo); r += 1; break;
    }
  }
}

// The packed types' (bits, sub-blocks, affine) combinations; anything else (no packed type has it) stays exact on the
// scalar code.
void group_avx2(const Weights& w, int64_t g, const Act& x, int64_t r0, int64_t r1, float* out, int64_t ldo) {
  const int key = w.bits * 100 + w.nsub * 10 + w.affine;
  switch (key) {
    case 810: return group_avx2_t<8, 1, false>(w, g, x, r0, r1, out, ldo);  // Q8_0
    case 410: return group_avx2_t<4, 1, false>(w, g, x, r0, r1, out, ldo);  // Q4_0
    case 411: return group_avx2_t<4, 1, true>(w, g, x, r0, r1, out, ldo);   // Q4_1, Q4_K
    case 510: return group_avx2_t<5, 1, false>(w, g, x, r0, r1, out, ldo);  // Q5_0
    case 511: return group_avx2_t<5, 1, true>(w, g, x, r0, r1, out, ldo);   // Q5_1, Q5_K
    case 620: return group_avx2_t<6, 2, false>(w, g, x, r0, r1, out, ldo);  // Q6_K
    case 420: return group_avx2_t<4, 2, false>(w, g, x, r0, r1, out, ldo);  // Q3_K (codes q + 8 in 4 bits)
    case 421: return group_avx2_t<4, 2, true>(w, g, x, r0, r1, out, ldo);   // Q2_K (2-bit codes in 4 bits)
    default: return group_scalar(w, g, x, r0, r1, out, ldo);
  }
}

// ------------------------------------------------------------------------------------------------------------------
// AVX-512 VNNI: 16 lanes = 16 output columns per register, vpdpbusd does 4 byte products per lane per instruction.
// The 8 weight vectors of a 32-block stay in registers while up to 16 rows use them (16 accumulators + 8 = 32 zmm).
// ------------------------------------------------------------------------------------------------------------------

#define FUCINA_AVX512 __attribute__((target("avx512f,avx512bw,avx512vnni,fma")))

FUCINA_AVX512 inline __m512 half16(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// 16 scales from element i of p (f16 or f32) as f32.
FUCINA_AVX512 inline __m512 load16(const Weights& w, const void* p, int64_t i) {
  return w.kind == kScaleF16
             ? half16(reinterpret_cast<const uint8_t*>(static_cast<const uint16_t*>(p) + i))
             : _mm512_loadu_ps(static_cast<const float*>(p) + i);
}

// Weights::scale / Weights::offset for the 16 lanes.
FUCINA_AVX512 inline __m512 scale16(const Weights& w, int64_t g, int64_t b, int j) {
  if (w.kind != kScaleK) return load16(w, w.a, w.base(g) + (b * w.nsub + j) * kLanes);
  const uint8_t* sb = w.kblock(g, b);
  const int64_t bi = b % 8;
  const uint8_t* sp = sb + (w.affine ? 64 + bi * 16 : 32 + (bi * 2 + j) * 16);
  const __m128i s8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sp));
  const __m512 s = _mm512_cvtepi32_ps(w.affine ? _mm512_cvtepu8_epi32(s8) : _mm512_cvtepi8_epi32(s8));
  return _mm512_mul_ps(half16(sb), s);
}
FUCINA_AVX512 inline __m512 offset16(const Weights& w, int64_t g, int64_t b, int j) {
  if (w.kind != kScaleK) return load16(w, w.c, w.base(g) + (b * w.nsub + j) * kLanes);
  const uint8_t* sb = w.kblock(g, b);
  const __m128i m8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + 192 + (b % 8) * 16));
  const __m512 p = _mm512_mul_ps(half16(sb + 32), _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(m8)));
  return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(p), _mm512_set1_epi32(INT32_MIN)));
}

constexpr int64_t kPrefetchBlocks = 8;

template <int R, int NSUB, bool AFFINE>
__attribute__((target("avx512f,avx512bw,avx512vnni,fma"))) void rows_avx512(const Weights& w, int64_t g, const Act& x,
                                                                             int64_t r0, float* out, int64_t ldo) {
  const int64_t bb = w.block_bytes();
  const uint8_t* wb = w.q + g * w.nb * bb;
  constexpr int cps = 8 / NSUB;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512 acc[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  // The R rows of a block are adjacent (Act is block-major): constant offsets from three pointers bumped per block.
  const int8_t* xb = x.xq(r0, 0);
  const float* dxb = x.d.data() + r0;
  const int32_t* cb = x.corr.data() + r0 * NSUB;
  const int64_t xstep = x.M * kQB, dstep = x.M, cstep = x.M * NSUB;
  for (int64_t b = 0; b < w.nb; ++b, wb += bb, xb += xstep, dxb += dstep, cb += cstep) {
    __m512i wv[8];
    // The weights are one linear stream; fetching them kPrefetchBlocks ahead keeps it flowing while the rows'
    // vpdpbusd run (Zen 5: an 8-row output layer 6.1-10 ms -> 4.3-4.8 ms). Past the end it is a no-op.
    const uintptr_t ahead = reinterpret_cast<uintptr_t>(wb) + kPrefetchBlocks * bb;
    for (int64_t o = 0; o < bb; o += 64) _mm_prefetch(reinterpret_cast<const char*>(ahead + o), _MM_HINT_T0);
    if (w.bits < 8) {  // chunk i in the low nibbles of double chunk i, chunk i + 4 in its high nibbles
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {
        const __m512i v = _mm512_loadu_si512(wb + 64 * i);
        wv[i] = _mm512_and_si512(v, low4);
        wv[i + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      }
      for (int k = 0; k < w.planes(); ++k) {  // + 16 << k where the plane's bit is set
        const __m512i add = _mm512_set1_epi8(static_cast<char>(16 << k));
        const uint8_t* pl = wb + 256 + 64 * k;
#pragma GCC unroll 8
        for (int i = 0; i < 8; ++i) {
          uint64_t m;
          std::memcpy(&m, pl + 8 * i, 8);
          wv[i] = _mm512_mask_add_epi8(wv[i], _cvtu64_mask64(m), wv[i], add);
        }
      }
    } else {
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) wv[i] = _mm512_loadu_si512(wb + 64 * i);
    }
#pragma GCC unroll 2
    for (int j = 0; j < NSUB; ++j) {
      const __m512 a = scale16(w, g, b, j);
      const __m512 c = AFFINE ? offset16(w, g, b, j) : _mm512_setzero_ps();
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        // Two accumulators halve the vpdpbusd dependency chain; integer sums are exact in any order.
        __m512i I0 = _mm512_setzero_si512(), I1 = _mm512_setzero_si512();
        const i32u* x4 = reinterpret_cast<const i32u*>(xb + r * kQB + j * cps * 4);
#pragma GCC unroll 8
        for (int i = 0; i < cps; i += 2) {
          I0 = _mm512_dpbusd_epi32(I0, wv[j * cps + i], _mm512_set1_epi32(x4[i]));
          I1 = _mm512_dpbusd_epi32(I1, wv[j * cps + i + 1], _mm512_set1_epi32(x4[i + 1]));
        }
        __m512i I = _mm512_add_epi32(I0, I1);
        const __m512 dx = _mm512_set1_ps(dxb[r]);
        const int32_t corr = cb[r * NSUB + j];
        if (AFFINE) {
          float S;
          std::memcpy(&S, &corr, 4);
          acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dx, a), _mm512_cvtepi32_ps(I), acc[r]);
          acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dx, c), _mm512_set1_ps(S), acc[r]);
        } else {
          I = _mm512_sub_epi32(I, _mm512_set1_epi32(corr));
          acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dx, a), _mm512_cvtepi32_ps(I), acc[r]);
        }
      }
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + (r0 + r) * ldo + g * kLanes, acc[r]);
}

template <int NSUB, bool AFFINE>
void group_avx512_t(const Weights& w, int64_t g, const Act& x, int64_t r0, int64_t r1, float* out, int64_t ldo) {
  for (int64_t r = r0; r < r1;) {
    if (r1 - r >= 16) {  // one pass of the weight block for 16 rows: 16 accumulators + 8 weight vectors fit the 32 zmm
      rows_avx512<16, NSUB, AFFINE>(w, g, x, r, out, ldo);
      r += 16;
      continue;
    }
    switch (std::min<int64_t>(r1 - r, 8)) {
      case 8: rows_avx512<8, NSUB, AFFINE>(w, g, x, r, out, ldo); r += 8; break;
      case 7: rows_avx512<7, NSUB, AFFINE>(w, g, x, r, out, ldo); r += 7; break;
      case 6: rows_avx512<6, NSUB, AFFINE>(w, g, x, r, out, ldo); r += 6; break;
      case 5: rows_avx512<5, NSUB, AFFINE>(w, g, x, r, out, ldo); r += 5; break;
      case 4: rows_avx512<4, NSUB, AFFINE>(w, g, x, r, out, ldo); r += 4; break;
      case 3: rows_avx512<3, NSUB, AFFINE>(w, g, x, r, out, ldo); r += 3; break;
      case 2: rows_avx512<2, NSUB, AFFINE>(w, g, x, r, out, ldo); r += 2; break;
      default: rows_avx512<1, NSUB, AFFINE>(w, g, x, r, out, ldo); r += 1; break;
    }
  }
}

void group_avx512(const Weights& w, int64_t g, const Act& x, int64_t r0, int64_t r1, float* out, int64_t ldo) {
  if (w.nsub == 1) {
    w.affine ? group_avx512_t<1, true>(w, g, x, r0, r1, out, ldo)
             : group_avx512_t<1, false>(w, g, x, r0, r1, out, ldo);
  } else {
    w.affine ? group_avx512_t<2, true>(w, g, x, r0, r1, out, ldo)
             : group_avx512_t<2, false>(w, g, x, r0, r1, out, ldo);
  }
}

template <GroupFn F>
void groups_each(const Weights& w, int64_t g0, int64_t g1, const Act& x, float* out, int64_t ldo) {
  for (int64_t g = g0; g < g1; ++g) F(w, g, x, 0, x.M, out, ldo);
}

// ------------------------------------------------------------------------------------------------------------------
// Dispatch: the best instruction set this CPU has, unless FUCINA_KERNEL_ISA or set_isa() asks for a lower one.
// ------------------------------------------------------------------------------------------------------------------

struct Isa {
  const char* name;
  GroupsFn fn;
  GroupFn group;
  bool (*supported)();
};

bool has_scalar() { return true; }
bool has_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}
bool has_avx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("fma");
}

const Isa kIsas[] = {{"avx512", groups_each<group_avx512>, group_avx512, has_avx512},
                     {"avx2", groups_each<group_avx2>, group_avx2, has_avx2},
                     {"scalar", groups_each<group_scalar>, group_scalar, has_scalar}};

std::atomic<int> g_isa{-1};

int best_isa() {
  for (int i = 0; i < 3; ++i)
    if (kIsas[i].supported()) return i;
  return 2;
}

int current_isa() {
  int i = g_isa.load(std::memory_order_relaxed);
  if (i < 0) {
    i = best_isa();
    if (const char* env = std::getenv("FUCINA_KERNEL_ISA")) {
      for (int k = 0; k < 3; ++k)
        if (std::strcmp(env, kIsas[k].name) == 0 && kIsas[k].supported()) i = k;
    }
    g_isa.store(i);
  }
  return i;
}

// ------------------------------------------------------------------------------------------------------------------
// The FFI handler: quantize the rows once, then column groups in parallel on XLA's intra-op thread pool.
// ------------------------------------------------------------------------------------------------------------------

// The packed weight of an [N, K] product (N a multiple of 16) as Weights, or the error that its arrays do not fit.
ffi::Error make_weights(ffi::Buffer<ffi::U8> wq, ffi::AnyBuffer wa, ffi::AnyBuffer wc, int64_t K, int64_t N,
                        int64_t bs, Weights* out) {
  if (bs != 16 && bs != 32) return ffi::Error::InvalidArgument("fucina_qmatmul: bs must be 16 or 32");
  if (K % kQB || N % kLanes) return ffi::Error::InvalidArgument("fucina_qmatmul: K % 32 or N % 16 is not 0");
  const int64_t G = N / kLanes, nb = K / kQB, nsub = kQB / bs;
  // 64 * bits bytes per group and block: bits 8 (bytes), or 4..6 (nibbles + planes)
  const int64_t per_block = G * nb > 0 ? static_cast<int64_t>(wq.element_count()) / (G * nb) : 512;
  const int bits = static_cast<int>(per_block / 64);
  // Scales: f32 or f16 (with as many offsets for affine types), or the K-quant two-level form (ScaleKind):
  // uint8 for Q4_K/Q5_K (scales and mins, 320 bytes per group and 8 blocks), int8 for Q6_K (288 bytes).
  const ffi::DataType st = wa.element_type();
  const int kind = st == ffi::DataType::F16 ? kScaleF16 : st == ffi::DataType::F32 ? kScaleF32 : kScaleK;
  const bool kaffine = st == ffi::DataType::U8;
  if (kind == kScaleK && st != ffi::DataType::U8 && st != ffi::DataType::S8)
    return ffi::Error::InvalidArgument("fucina_qmatmul: scales must be f32, f16, u8 (Q4_K/Q5_K) or s8 (Q6_K)");
  const int64_t n_scales = kind == kScaleK ? (nb % 8 ? -1 : G * (nb / 8) * (kaffine ? 320 : 288))
                                           : G * nb * nsub * kLanes;
  if (static_cast<int64_t>(wq.element_count()) != G * nb * per_block || per_block % 64 ||
      !(bits == 8 || (bits >= 4 && bits <= 6)) || static_cast<int64_t>(wa.element_count()) != n_scales ||
      (kind == kScaleK && (wc.element_count() != 0 || bs != (kaffine ? 32 : 16))) ||
      (wc.element_count() != 0 && static_cast<int64_t>(wc.element_count()) != n_scales))
    return ffi::Error::InvalidArgument("fucina_qmatmul: packed weight sizes do not match x and y");
  if (wc.element_count() != 0 && wc.element_type() != st)
    return ffi::Error::InvalidArgument("fucina_qmatmul: scales and offsets must both be f32 or both f16");
  const bool affine = kind == kScaleK ? kaffine : wc.element_count() != 0;
  *out = Weights{wq.typed_data(), wa.untyped_data(), wc.element_count() ? wc.untyped_data() : nullptr, nb,
                 static_cast<int>(nsub), kind, affine, bits, 1 << (bits - 1)};
  return ffi::Error::Success();
}

// M rows of x [*, K] (row i at x + K * rows[i], or row i itself when rows is null) quantized for weights w.
void quantize_for(const float* x, int64_t M, int64_t K, const int64_t* rows, const Weights& w, int isa, Act& act) {
  act.M = M;
  act.K = K;
  act.nb = K / kQB;
  act.q.resize(M * K);
  act.d.resize(M * act.nb);
  act.s16.resize(M * 2 * act.nb);
  if (rows) {
    std::vector<float> gathered(M * K);
    for (int64_t i = 0; i < M; ++i) std::memcpy(gathered.data() + i * K, x + rows[i] * K, K * sizeof(float));
    quantize_rows(gathered.data(), act, isa);
  } else {
    quantize_rows(x, act, isa);
  }
  act.make_corr(w.nsub, w.affine, w.zero);
}

// Weights whose group 0 is group g0 of w (an expert of a stack: its groups are contiguous).
Weights from_group(const Weights& w, int64_t g0) {
  Weights e = w;
  e.q = w.q + g0 * w.nb * w.block_bytes();
  if (w.kind == kScaleK) {
    e.a = static_cast<const uint8_t*>(w.a) + g0 * (w.nb / 8) * w.kbytes();
  } else {
    const int64_t size = w.kind == kScaleF16 ? 2 : 4;
    e.a = static_cast<const uint8_t*>(w.a) + w.base(g0) * size;
    if (w.c) e.c = static_cast<const uint8_t*>(w.c) + w.base(g0) * size;
  }
  return e;
}

ffi::Error QMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> wq,
                       ffi::AnyBuffer wa, ffi::AnyBuffer wc, ffi::ResultBuffer<ffi::F32> y, int64_t bs) {
  auto xd = x.dimensions();
  auto yd = y->dimensions();
  if (xd.size() != 2 || yd.size() != 2) return ffi::Error::InvalidArgument("fucina_qmatmul: x and y must be 2-D");
  const int64_t M = xd[0], K = xd[1], N = yd[1];
  if (yd[0] != M) return ffi::Error::InvalidArgument("fucina_qmatmul: x and y row counts differ");
  Weights w;
  if (ffi::Error e = make_weights(wq, wa, wc, K, N, bs, &w); e.failure()) return e;
  if (M == 0) return ffi::Error::Success();
  Act act;
  const int isa = current_isa();
  quantize_for(x.typed_data(), M, K, nullptr, w, isa, act);
  const GroupsFn fn = kIsas[isa].fn;
  float* out = y->typed_data();
  // Column groups in parallel; a group is never split, so results do not depend on the split. (Two groups per pass,
  // sharing the activation broadcasts, was faster on cache-resident weights but slower on weights streamed from
  // memory, which is the case that matters: docs/performance.md.)
  fucina::parallel_for(pool, N / kLanes, [&](int64_t g0, int64_t g1) { fn(w, g0, g1, act, out, N); });
  return ffi::Error::Success();
}


// The output layer with the greedy pick, the recycling candidates and a sampler's candidates fused in: for each row r
// of x [M, K],
//     ids[r]     = fucina_argmax over the first n columns of row r of x . W^T (select.cc's rule),
//     top[r, :k] = the ids of fucina_top_k of the same n values, k largest first (no -0.0 fold), and
//     cvals[r, :c], cids[r, :c] = fucina_top_k of the same n values with the -0.0 fold (values and ids),
// where the values are those fucina_qmatmul computes, bit for bit. The [M, n] product is never written out: the
// column groups are computed a slice at a time into a buffer that stays in cache and are selected from there, and
// each slice's winners are merged in the selections' total order (key, then lower id), so the answer does not
// depend on the slicing, the threads or the instruction set. A greedy step that no hook needs the logits of saves
// writing, faulting in and re-reading M x n floats (M x 1 MiB at a 262k vocabulary).
ffi::Error QMatmulSelectImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> wq,
                             ffi::AnyBuffer wa, ffi::AnyBuffer wc, ffi::ResultBuffer<ffi::S32> ids,
                             ffi::ResultBuffer<ffi::S32> top, ffi::ResultBuffer<ffi::F32> cvals,
                             ffi::ResultBuffer<ffi::S32> cids, int64_t bs, int64_t n_pad, int64_t n, int64_t k,
                             int64_t c) {
  auto xd = x.dimensions();
  if (xd.size() != 2) return ffi::Error::InvalidArgument("fucina_qmatmul_select: x must be 2-D");
  const int64_t M = xd[0], K = xd[1], N = n_pad;
  if (n < 1 || n > N || k < 0 || k > n || c < 0 || c > n)
    return ffi::Error::InvalidArgument("fucina_qmatmul_select: n must be in [1, n_pad], k and c in [0, n]");
  if (static_cast<int64_t>(ids->element_count()) != M || static_cast<int64_t>(top->element_count()) != M * k ||
      static_cast<int64_t>(cvals->element_count()) != M * c || static_cast<int64_t>(cids->element_count()) != M * c)
    return ffi::Error::InvalidArgument(
        "fucina_qmatmul_select: outputs must be ids [M], top [M, k], cvals [M, c] and cids [M, c]");
  Weights w;
  if (ffi::Error e = make_weights(wq, wa, wc, K, N, bs, &w); e.failure()) return e;
  if (M == 0) return ffi::Error::Success();
  Act act;
  const int isa = current_isa();
  quantize_for(x.typed_data(), M, K, nullptr, w, isa, act);
  const GroupFn group = kIsas[isa].group;
  const int64_t G = N / kLanes;
  // Slices of column groups: about 64 KiB of products per slice (at least one group), so they stay in L2.
  const int64_t per_slice = std::max<int64_t>(1, std::min<int64_t>(64, 1024 / std::max<int64_t>(M, 1)));
  const int64_t S = (G + per_slice - 1) / per_slice;
  // Selections as fucina::ranked (total_key, column) pairs. Each chunk of slices keeps one running selection per
  // row; its argmax goes to the entry of its first slice (kNone: nothing but NaNs, below every non-NaN key),
  constexpr int64_t kNone = INT64_MIN;
  std::vector<int64_t> best(S * M, kNone);
  // and its top-k winners go to the rows' lists (chunks in any order: the merge sorts them in the total order).
  std::vector<std::vector<int64_t>> won(M), cwon(M);
  std::mutex won_lock;
  fucina::parallel_for(pool, S, [&](int64_t s0, int64_t s1) {
    std::vector<float> buf(M * per_slice * kLanes);
    std::vector<fucina::TopKScan> scans(k ? M : 0), cscans(c ? M : 0);
    for (auto& t : scans) t.reset(k, 0);
    for (auto& t : cscans) t.reset(c, 1);
    for (int64_t s = s0; s < s1; ++s) {
      const int64_t g0 = s * per_slice, gs = std::min(G, g0 + per_slice) - g0, ldo = gs * kLanes;
      const Weights ws = from_group(w, g0);
      for (int64_t g = 0; g < gs; ++g) group(ws, g, act, 0, M, buf.data(), ldo);
      const int64_t c0 = g0 * kLanes, cols = std::min(n, c0 + ldo) - c0;
      if (cols <= 0) continue;
      for (int64_t r = 0; r < M; ++r) {
        const float* row = buf.data() + r * ldo;
        const int32_t a = fucina::argmax_row(row, cols);
        if (!std::isnan(row[a]))
          best[s0 * M + r] = std::max(best[s0 * M + r],
                                      fucina::ranked(fucina::total_key(row[a], 1), static_cast<int32_t>(c0 + a)));
        if (k) fucina::top_k_scan(scans[r], row, cols, c0);
        if (c) fucina::top_k_scan(cscans[r], row, cols, c0);
      }
    }
    for (auto& t : scans) t.finish();
    for (auto& t : cscans) t.finish();
    std::lock_guard<std::mutex> hold(won_lock);
    for (int64_t r = 0; r < static_cast<int64_t>(scans.size()); ++r)
      won[r].insert(won[r].end(), scans[r].kept.begin(), scans[r].kept.end());
    for (int64_t r = 0; r < static_cast<int64_t>(cscans.size()); ++r)
      cwon[r].insert(cwon[r].end(), cscans[r].kept.begin(), cscans[r].kept.end());
  }, 1);
  // The kk best of the chunks' winners, best first.
  auto merge = [](std::vector<int64_t>& winners, int64_t kk) {
    std::partial_sort(winners.begin(), winners.begin() + kk, winners.end(), std::greater<int64_t>());
  };
  int32_t* idp = ids->typed_data();
  for (int64_t r = 0; r < M; ++r) {
    int64_t b = kNone;
    for (int64_t s = 0; s < S; ++s) b = std::max(b, best[s * M + r]);
    idp[r] = b != kNone ? fucina::ranked_index(b) : static_cast<int32_t>(n - 1);  // all NaN: n - 1, as fucina_argmax
    if (k) {
      merge(won[r], k);
      for (int64_t j = 0; j < k; ++j) top->typed_data()[r * k + j] = fucina::ranked_index(won[r][j]);
    }
    if (c) {
      merge(cwon[r], c);
      for (int64_t j = 0; j < c; ++j) {
        cvals->typed_data()[r * c + j] = fucina::key_value(fucina::ranked_key(cwon[r][j]));
        cids->typed_data()[r * c + j] = fucina::ranked_index(cwon[r][j]);
      }
    }
  }
  return ffi::Error::Success();
}

// Mixture-of-experts product: y[t, u] = x[row(t, u)] . W[ids[t, u]]^T for a stack of E experts packed as one
// weight of E * Ne columns (expert e = columns e * Ne .. (e + 1) * Ne). row(t, u) = t when x has T rows (gate and
// up read the token's input), t * U + u when it has T * U (down reads each expert's own input). The rows of one
// expert are quantized and computed together, column groups of all the used experts in parallel; each output is the
// same sequence as fucina_qmatmul's, so bitwise independent of the batch and of the other rows' experts.
ffi::Error QMatmulExpertsImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> ids,
                              ffi::Buffer<ffi::U8> wq, ffi::AnyBuffer wa, ffi::AnyBuffer wc,
                              ffi::ResultBuffer<ffi::F32> y, int64_t bs, int64_t experts) {
  auto xd = x.dimensions();
  auto id = ids.dimensions();
  auto yd = y->dimensions();
  if (xd.size() != 2 || id.size() != 2 || yd.size() != 3)
    return ffi::Error::InvalidArgument("fucina_qmatmul_experts: x [R, K], ids [T, U] and y [T, U, Ne] expected");
  const int64_t T = id[0], U = id[1], K = xd[1], Ne = yd[2], E = experts;
  if (yd[0] != T || yd[1] != U || (xd[0] != T && xd[0] != T * U) || E < 1 || Ne % kLanes)
    return ffi::Error::InvalidArgument("fucina_qmatmul_experts: shapes of x, ids and y do not match");
  Weights w;
  if (ffi::Error e = make_weights(wq, wa, wc, K, E * Ne, bs, &w); e.failure()) return e;
  const bool own_rows = xd[0] == T * U && U > 1;
  const int32_t* idp = ids.typed_data();
  std::vector<std::vector<int64_t>> pairs(E);  // per expert, the (t * U + u) that use it, in order
  for (int64_t p = 0; p < T * U; ++p) {
    if (idp[p] < 0 || idp[p] >= E) return ffi::Error::InvalidArgument("fucina_qmatmul_experts: expert id out of range");
    pairs[idp[p]].push_back(p);
  }
  struct Job {
    int64_t e;
    Weights w;
    Act act;
    std::vector<float> out;  // [rows, Ne]
  };
  const int isa = current_isa();
  std::vector<Job> jobs;
  for (int64_t e = 0; e < E; ++e) {
    if (pairs[e].empty()) continue;
    std::vector<int64_t> rows(pairs[e]);
    if (!own_rows)
      for (int64_t& r : rows) r /= U;
    Job& j = jobs.emplace_back();
    j.e = e;
    j.w = from_group(w, e * (Ne / kLanes));
    quantize_for(x.typed_data(), static_cast<int64_t>(rows.size()), K, rows.data(), w, isa, j.act);
    j.out.resize(rows.size() * Ne);
  }
  const int64_t Ge = Ne / kLanes;
  const GroupFn fn = kIsas[isa].group;
  fucina::parallel_for(pool, static_cast<int64_t>(jobs.size()) * Ge, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      Job& j = jobs[i / Ge];
      fn(j.w, i % Ge, j.act, 0, j.act.M, j.out.data(), Ne);
    }
  });
  float* out = y->typed_data();
  for (const Job& j : jobs)
    for (size_t m = 0; m < pairs[j.e].size(); ++m)
      std::memcpy(out + pairs[j.e][m] * Ne, j.out.data() + m * Ne, Ne * sizeof(float));
  return ffi::Error::Success();
}

}  // namespace

namespace fucina {
int kernel_isa() { return current_isa(); }  // for fmatmul.cc and attention.cc
int kernel_best_isa() { return best_isa(); }  // for attention.cc
}  // namespace fucina

XLA_FFI_DEFINE_HANDLER_SYMBOL(FucinaQMatmul, QMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("bs"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(FucinaQMatmulSelect, QMatmulSelectImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("bs")
                                  .Attr<int64_t>("n_pad")
                                  .Attr<int64_t>("n")
                                  .Attr<int64_t>("k")
                                  .Attr<int64_t>("c"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(FucinaQMatmulExperts, QMatmulExpertsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("bs")
                                  .Attr<int64_t>("experts"));

// ------------------------------------------------------------------------------------------------------------------
// Python module: the handler capsules and the instruction-set switch (tests force the fallbacks with it).
// ------------------------------------------------------------------------------------------------------------------

#ifndef FUCINA_KERNEL_HARNESS

extern "C" XLA_FFI_Error* FucinaFMatmul(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* FucinaAttention(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* FucinaAttentionWrite(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* FucinaRmsNorm(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* FucinaNormRope(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* FucinaResidualNorm(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* FucinaTopK(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* FucinaArgmax(XLA_FFI_CallFrame* call_frame);
extern "C" PyObject* fucina_py_pack_q8_0(PyObject*, PyObject* args);  // pack.cc
extern "C" PyObject* fucina_py_narrow_codes(PyObject*, PyObject* args);
extern "C" PyObject* fucina_py_decode_codes(PyObject*, PyObject* args);

// name -> the XLA FFI handler registered under "fucina_" + name (fucina_jax/kernels/__init__.py)
static PyObject* py_handlers(PyObject*, PyObject*) {
  const std::pair<const char*, void*> handlers[] = {
      {"qmatmul", reinterpret_cast<void*>(&FucinaQMatmul)},
      {"fmatmul", reinterpret_cast<void*>(&FucinaFMatmul)},
      {"qmatmul_experts", reinterpret_cast<void*>(&FucinaQMatmulExperts)},
      {"qmatmul_select", reinterpret_cast<void*>(&FucinaQMatmulSelect)},
      {"attention", reinterpret_cast<void*>(&FucinaAttention)},
      {"attention_write", reinterpret_cast<void*>(&FucinaAttentionWrite)},
      {"rms_norm", reinterpret_cast<void*>(&FucinaRmsNorm)},
      {"norm_rope", reinterpret_cast<void*>(&FucinaNormRope)},
      {"residual_norm", reinterpret_cast<void*>(&FucinaResidualNorm)},
      {"top_k", reinterpret_cast<void*>(&FucinaTopK)},
      {"argmax", reinterpret_cast<void*>(&FucinaArgmax)},
  };
  PyObject* out = PyDict_New();
  for (const auto& [name, fn] : handlers) {
    PyObject* cap = PyCapsule_New(fn, nullptr, nullptr);
    PyDict_SetItemString(out, name, cap);
    Py_DECREF(cap);
  }
  return out;
}

static PyObject* py_isa(PyObject*, PyObject*) { return PyUnicode_FromString(kIsas[current_isa()].name); }

static PyObject* py_supported_isas(PyObject*, PyObject*) {
  PyObject* out = PyList_New(0);
  for (const Isa& i : kIsas)
    if (i.supported()) {
      PyObject* s = PyUnicode_FromString(i.name);
      PyList_Append(out, s);
      Py_DECREF(s);
    }
  return out;
}

static PyObject* py_set_isa(PyObject*, PyObject* arg) {
  const char* name = PyUnicode_AsUTF8(arg);
  if (!name) return nullptr;
  for (int k = 0; k < 3; ++k) {
    if (std::strcmp(name, kIsas[k].name) == 0) {
      if (!kIsas[k].supported()) {
        PyErr_Format(PyExc_ValueError, "this CPU cannot run the %s kernels", name);
        return nullptr;
      }
      g_isa.store(k);
      Py_RETURN_NONE;
    }
  }
  PyErr_Format(PyExc_ValueError, "unknown kernel instruction set %R; choose avx512, avx2 or scalar", arg);
  return nullptr;
}

static PyObject* py_threads(PyObject*, PyObject*) {
  const bool own = fucina::Workers::enabled();
  const fucina::ParallelCounts& c = fucina::parallel_counts();
  return Py_BuildValue("{s:s,s:L,s:K,s:K,s:K}", "pool", own ? "own" : "xla", "workers",
                       static_cast<long long>(own ? fucina::Workers::get()->size() : 0), "calls_alone",
                       static_cast<unsigned long long>(c.alone.load()), "calls_workers",
                       static_cast<unsigned long long>(c.workers.load()), "calls_pool",
                       static_cast<unsigned long long>(c.pool.load()));
}

static PyMethodDef kMethods[] = {
    {"handlers", py_handlers, METH_NOARGS, "{name: PyCapsule of the XLA FFI handler fucina_<name>}."},
    {"isa", py_isa, METH_NOARGS, "The instruction set the kernels use now."},
    {"supported_isas", py_supported_isas, METH_NOARGS, "Instruction sets this CPU can run, best first."},
    {"threads", py_threads, METH_NOARGS, "Which threads run parallel_for (parallel.h) and how many calls ran where."},
    {"set_isa", py_set_isa, METH_O, "Use the kernels of this instruction set (avx512, avx2, scalar)."},
    {"pack_q8_0", fucina_py_pack_q8_0, METH_VARARGS, "Q8_0 rows -> packed codes and scales (pack.py)."},
    {"narrow_codes", fucina_py_narrow_codes, METH_VARARGS, "Byte codes -> nibbles + bit planes (pack.py)."},
    {"decode_codes", fucina_py_decode_codes, METH_VARARGS, "Blocks of a GGML type -> byte codes (pack.py)."},
    {nullptr, nullptr, 0, nullptr}};

static PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_qmatmul", "Quantized matmul kernels (XLA FFI).", -1, kMethods};

PyMODINIT_FUNC PyInit__qmatmul(void) { return PyModule_Create(&kModule); }
#endif  // FUCINA_KERNEL_HARNESS
