// Float-weight matmul y[M, N] = x[M, K] . W[N, K]^T for F32, F16 and BF16 weights, called from jax.jit through the
// XLA FFI: the kernels' path for the layers a GGUF file stores as floats (small models often ship F16 or BF16).
//
// The weight stays as the file stores it, row-major [N, K] (2 bytes per value for F16/BF16 instead of the f32 path's
// 4); each value is widened exactly to f32 (vcvtph2ps; BF16 is the upper half of an f32) and multiplied by the f32
// activations, which are not rounded (llama.cpp rounds them to the weight's type first). Every output is one fixed
// sequence, whatever M, the row's position in the batch, the thread count or the instruction set:
//     16 partial sums, P[p] = fma(w[k], x[k], P[p]) for k = p, p + 16, p + 32, ... in order (P starts at +0),
//     then P[p] += P[p + h] for h = 8, 4, 2, 1 (p < h); the output is P[0].
// So a verify row is bitwise the decode row, as with the quantized kernels (qmatmul.cc). K must be a multiple of 16.
// AVX2 + FMA + F16C or scalar (bitwise the same); an AVX-512 CPU runs the AVX2 code: the decode is bound by memory
// bandwidth, and this machine has no AVX-512 to test a wider version on.

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "xla/ffi/api/ffi.h"
#include "parallel.h"

namespace ffi = xla::ffi;

namespace fucina {
int kernel_isa();  // qmatmul.cc: 0 AVX-512, 1 AVX2, 2 scalar
}

namespace {

constexpr int kParts = 16;  // partial sums per output
enum WType : int { kF32, kF16, kBF16 };

template <int T>
inline float weight(const void* w, int64_t i) {
  if (T == kF16) return static_cast<float>(static_cast<const _Float16*>(w)[i]);
  if (T == kBF16) {
    const uint32_t bits = static_cast<uint32_t>(static_cast<const uint16_t*>(w)[i]) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  }
  return static_cast<const float*>(w)[i];
}

// The portable statement of the sequence above.
template <int T>
void cols_scalar(const void* w, const float* x, int64_t M, int64_t K, int64_t n0, int64_t n1, float* y, int64_t N) {
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t m = 0; m < M; ++m) {
      float P[kParts] = {};
      for (int64_t k = 0; k < K; k += kParts)
        for (int p = 0; p < kParts; ++p) P[p] = std::fmaf(weight<T>(w, n * K + k + p), x[m * K + k + p], P[p]);
      for (int h = kParts / 2; h >= 1; h /= 2)
        for (int p = 0; p < h; ++p) P[p] += P[p + h];
      y[m * N + n] = P[0];
    }
}

// 8 weights from element i, widened exactly to f32.
template <int T>
__attribute__((target("avx2,fma,f16c"))) inline __m256 load_w8(const void* w, int64_t i) {
  if (T == kF32) return _mm256_loadu_ps(static_cast<const float*>(w) + i);
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(w) + i));
  if (T == kF16) return _mm256_cvtph_ps(h);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// Partials 0-7 in a, 8-15 in b -> the tree sum of the sequence above.
__attribute__((target("avx2,fma,f16c"))) inline float tree_sum(__m256 a, __m256 b) {
  const __m256 s = _mm256_add_ps(a, b);                                                       // h = 8
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));              // h = 4
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));                                                     // h = 2
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));                                    // h = 1
}

// 2-byte weights stream from memory faster with the next tile's rows prefetched: 16-20% on the F16 output layer of
// Gemma 3 (262144 x 640) at one row, 30% at 8 (f32 weights, four times the F16 tile's bytes ahead, ran slower).
template <int T, int C>
__attribute__((target("avx2,fma,f16c"))) inline void prefetch_next(const void* w, int64_t wr, int64_t K, int64_t k) {
  if (T == kF32) return;
#pragma GCC unroll 8
  for (int c = 0; c < C; ++c) _mm_prefetch(static_cast<const char*>(w) + (wr + (c + C) * K + k) * 2, _MM_HINT_T0);
}

// One row x columns [n0, n0 + C): both halves of each 16-value step at once, 2 C independent fma chains (C = 4: the
// 8 that hide the fma latency).
template <int T, int C>
__attribute__((target("avx2,fma,f16c"))) void row_avx2(const void* w, const float* x, int64_t K, int64_t n0, float* y) {
  __m256 acc[C][2];
#pragma GCC unroll 8
  for (int c = 0; c < C; ++c) acc[c][0] = acc[c][1] = _mm256_setzero_ps();
  const int64_t wr = n0 * K;
  for (int64_t k = 0; k < K; k += kParts) {
    prefetch_next<T, C>(w, wr, K, k);
    const __m256 x0 = _mm256_loadu_ps(x + k), x1 = _mm256_loadu_ps(x + k + 8);
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      acc[c][0] = _mm256_fmadd_ps(load_w8<T>(w, wr + c * K + k), x0, acc[c][0]);
      acc[c][1] = _mm256_fmadd_ps(load_w8<T>(w, wr + c * K + k + 8), x1, acc[c][1]);
    }
  }
  for (int c = 0; c < C; ++c) y[n0 + c] = tree_sum(acc[c][0], acc[c][1]);
}

// Rows [m0, m0 + R) x columns [n0, n0 + C), R C <= 12 accumulators: a pass over K for partials 0-7 (which streams
// the weights from memory), then one for partials 8-15 (from the cache). Each weight vector is widened once for R
// rows, each activation vector loaded once for C columns: 25% faster at 4-8 rows than both halves in one pass, which
// needs twice the accumulators for the same tile.
template <int T, int R, int C>
__attribute__((target("avx2,fma,f16c"))) void tile_avx2(const void* w, const float* x, int64_t K, int64_t m0,
                                                         int64_t n0, float* y, int64_t N) {
  __m256 half[2][R][C];
  const float* xr = x + m0 * K;
  const int64_t wr = n0 * K;
  for (int h = 0; h < 2; ++h) {
    __m256 acc[R][C];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
    for (int64_t k = 8 * h; k < K; k += kParts) {
      if (h == 0) prefetch_next<T, C>(w, wr, K, k);
      __m256 wv[C];
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) wv[c] = load_w8<T>(w, wr + c * K + k);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256 xv = _mm256_loadu_ps(xr + r * K + k);
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(wv[c], xv, acc[r][c]);
      }
    }
    std::memcpy(half[h], acc, sizeof(acc));
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) y[(m0 + r) * N + n0 + c] = tree_sum(half[0][r][c], half[1][r][c]);
}

// Every row of C columns: tiles of 4 rows, then the rest.
template <int T, int C>
void rows_avx2(const void* w, const float* x, int64_t M, int64_t K, int64_t n0, float* y, int64_t N) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) tile_avx2<T, 4, C>(w, x, K, m, n0, y, N);
  switch (M - m) {
    case 3: tile_avx2<T, 3, C>(w, x, K, m, n0, y, N); break;
    case 2: tile_avx2<T, 2, C>(w, x, K, m, n0, y, N); break;
    case 1: tile_avx2<T, 1, C>(w, x, K, m, n0, y, N); break;
  }
}

template <int T>
void cols_avx2(const void* w, const float* x, int64_t M, int64_t K, int64_t n0, int64_t n1, float* y, int64_t N) {
  int64_t n = n0;
  if (M == 1) {
    for (; n + 4 <= n1; n += 4) row_avx2<T, 4>(w, x, K, n, y);
    for (; n < n1; ++n) row_avx2<T, 1>(w, x, K, n, y);
    return;
  }
  for (; n + 3 <= n1; n += 3) rows_avx2<T, 3>(w, x, M, K, n, y, N);
  for (; n < n1; ++n) rows_avx2<T, 1>(w, x, M, K, n, y, N);
}

using ColsFn = void (*)(const void*, const float*, int64_t, int64_t, int64_t, int64_t, float*, int64_t);

ffi::Error FMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  auto yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 2 || yd.size() != 2)
    return ffi::Error::InvalidArgument("fucina_fmatmul: x, w and y must be 2-D");
  const int64_t M = xd[0], K = xd[1], N = wd[0];
  if (wd[1] != K || yd[0] != M || yd[1] != N)
    return ffi::Error::InvalidArgument("fucina_fmatmul: shapes do not match: x [M, K], w [N, K], y [M, N]");
  if (K % kParts) return ffi::Error::InvalidArgument("fucina_fmatmul: K must be a multiple of 16");
  const ffi::DataType t = w.element_type();
  const int wt = t == ffi::DataType::F16 ? kF16 : t == ffi::DataType::BF16 ? kBF16 : kF32;
  if (wt == kF32 && t != ffi::DataType::F32)
    return ffi::Error::InvalidArgument("fucina_fmatmul: weights must be f32, f16 or bf16");
  if (M == 0 || N == 0) return ffi::Error::Success();
  const bool simd = fucina::kernel_isa() != 2;
  static constexpr ColsFn kFns[2][3] = {{cols_scalar<kF32>, cols_scalar<kF16>, cols_scalar<kBF16>},
                                        {cols_avx2<kF32>, cols_avx2<kF16>, cols_avx2<kBF16>}};
  const ColsFn fn = kFns[simd][wt];
  const void* wp = w.untyped_data();
  const float* xp = x.typed_data();
  float* yp = y->typed_data();
  // Blocks of 4 columns in parallel; a block is computed whole by one thread, and no output depends on the split.
  const int64_t blocks = (N + 3) / 4;
  fucina::parallel_for(pool, blocks, [&](int64_t b0, int64_t b1) {
    fn(wp, xp, M, K, b0 * 4, std::min(N, b1 * 4), yp, N);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(FucinaFMatmul, FMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
