// Row selections over logits on the CPU, called from jax.jit through the XLA FFI: the sampler's top-k and greedy
// argmax, exactly as XLA computes them (the kernels are a faster drop-in, not a different definition).
//
//   fucina_top_k   x [R, V] -> (values [R, k], ids int32 [R, k]): the k largest of each row in XLA TopK's order, a
//                  total order on the float bits (-NaN < -inf < ... < -0.0 < +0.0 < ... < +inf < +NaN), largest
//                  first, equal values by lower index first. With fold_zero, -0.0 counts as (and is returned as)
//                  +0.0: the top-k of where(x == 0, +0.0, x) without that V-wide pass.
//   fucina_argmax  x [R, V] -> ids int32 [R]: the lowest index holding the row's maximum (+0.0 and -0.0 equal),
//                  NaNs skipped (as XLA's CPU max reduction skips them), V - 1 for a row of NaNs: sampling.py's
//                  greedy pick.
//
// XLA's CPU TopK sorts every row (~0.4 ms for V = 262144); here a row is one pass that compares blocks of 16 keys
// against the current k-th best and keeps only the few that beat it (TopKScan).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "parallel.h"
#include "select.h"

namespace ffi = xla::ffi;

namespace {

#define FUCINA_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))

using fucina::total_key;

// 8-lane GCC vectors: native on AVX2 and AVX-512 (GCC keeps vectors wider than the registers in memory, which made
// 16-lane code 25x slower on AVX2). The results below do not depend on the lane count.
typedef float v8f __attribute__((vector_size(32), aligned(4), may_alias));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef int32_t v8iu __attribute__((vector_size(32), aligned(4), may_alias));
typedef int64_t v4l __attribute__((vector_size(32)));

}  // namespace

namespace fucina {

FUCINA_CLONES
void top_k_scan(TopKScan& t, const float* x, int64_t n, int64_t base) {
  // Once t.kept has held k pairs, thr is the key of the k-th best at the last cut: indices grow along the scan, so
  // an element equal to it ranks after it and only a strictly larger key enters (a lagging thr lets a few more in,
  // which the next cut drops).
  auto& kept = t.kept;
  const int64_t k = t.k;
  const int32_t fold = t.fold;
  if (k == 0) return;
  auto cut = [&] {  // the k best to the front, the rest dropped; the k-th best's key
    std::nth_element(kept.begin(), kept.begin() + (k - 1), kept.end(), std::greater<int64_t>());
    kept.resize(static_cast<size_t>(k));
    return ranked_key(kept[k - 1]);
  };
  int64_t i = 0;
  if (static_cast<int64_t>(kept.size()) < k) {
    for (; i < n && static_cast<int64_t>(kept.size()) < k; ++i)
      kept.push_back(ranked(total_key(x[i], fold), static_cast<int32_t>(base + i)));
    if (static_cast<int64_t>(kept.size()) < k) return;
    t.thr = cut();
  }
  int32_t thr = t.thr;
  auto offer = [&](int32_t key, int64_t idx) {  // key > thr
    kept.push_back(ranked(key, static_cast<int32_t>(base + idx)));
    if (static_cast<int64_t>(kept.size()) == 2 * k) thr = cut();
  };
  constexpr int kBlock = 16;
  const v8i foldv = v8i{} + fold;
  for (; i + kBlock <= n; i += kBlock) {
    // total_key of 16 values as two 8-lane vectors
    v8i key[2];
    for (int h = 0; h < 2; ++h) {
      const v8i b = *reinterpret_cast<const v8iu*>(x + i + 8 * h);
      const v8i kk = b ^ ((b >> 31) & 0x7FFFFFFF);
      key[h] = kk + (foldv & -(kk == -1));  // (kk == -1) is -1 per true lane
    }
    const v8i over = (key[0] > thr) | (key[1] > thr);
    v4l o;
    std::memcpy(&o, &over, sizeof o);
    if (((o[0] | o[1]) | (o[2] | o[3])) == 0) continue;
    int32_t keys[kBlock];
    std::memcpy(keys, key, sizeof keys);
    // the lanes over thr as bits, then only those visited (a branch per lane mispredicted on most such blocks);
    // a cut inside may raise thr, so each is checked again
    uint32_t over_bits = 0;
    for (int l = 0; l < kBlock; ++l) over_bits |= static_cast<uint32_t>(keys[l] > thr) << l;
    for (; over_bits != 0; over_bits &= over_bits - 1) {
      const int l = __builtin_ctz(over_bits);
      if (keys[l] > thr) offer(keys[l], i + l);
    }
  }
  for (; i < n; ++i) {
    const int32_t key = total_key(x[i], fold);
    if (key > thr) offer(key, i);
  }
  t.thr = thr;
}

void top_k_row(const float* x, int64_t V, int64_t k, int32_t fold, float* vals, int32_t* ids, TopKScan& t) {
  t.reset(k, fold);
  top_k_scan(t, x, V, 0);
  t.finish();
  for (int64_t j = 0; j < k; ++j) {
    ids[j] = ranked_index(t.kept[j]);
    const float v = x[ids[j]];
    vals[j] = fold && v == 0.0f ? 0.0f : v;
  }
}

FUCINA_CLONES
int32_t argmax_row(const float* x, int64_t V) {
  // One pass: per lane of 16 (two 8-lane halves), the maximum and the first index holding it (a NaN never compares
  // greater, so it is skipped; +0.0 and -0.0 are equal, so the earlier stays); then the lowest index among the
  // lanes' maxima.
  constexpr int kBlock = 16;
  v8f m[2] = {v8f{} - INFINITY, v8f{} - INFINITY};
  v8i at[2] = {v8i{} - 1, v8i{} - 1};
  v8i lane;
  for (int l = 0; l < 8; ++l) lane[l] = l;
  int64_t i = 0;
  for (; i + kBlock <= V && i + kBlock <= INT32_MAX; i += kBlock) {
    for (int h = 0; h < 2; ++h) {
      const v8f v = *reinterpret_cast<const v8f*>(x + i + 8 * h);
      const v8i gt = v > m[h];
      m[h] = gt ? v : m[h];
      at[h] = gt ? lane + static_cast<int32_t>(i + 8 * h) : at[h];
    }
  }
  float best = -INFINITY;
  int64_t best_at = -1;
  for (int h = 0; h < 2; ++h)
    for (int l = 0; l < 8; ++l)
      if (at[h][l] >= 0 && (m[h][l] > best || (m[h][l] == best && at[h][l] < best_at)))
        best = m[h][l], best_at = at[h][l];
  for (; i < V; ++i)
    if (x[i] > best) best = x[i], best_at = i;
  if (best_at < 0) {  // nothing above -inf: the first -inf, or V - 1 when every value is NaN
    for (int64_t j = 0; j < V; ++j)
      if (x[j] == -INFINITY) return static_cast<int32_t>(j);
    return static_cast<int32_t>(V - 1);
  }
  return static_cast<int32_t>(best_at);
}

}  // namespace fucina

namespace {

using fucina::argmax_row;
using fucina::top_k_row;

// Rows of x: all but the last axis.
int64_t row_count(const ffi::Buffer<ffi::F32>& x, int64_t V) {
  return V ? static_cast<int64_t>(x.element_count()) / V : 0;
}

ffi::Error TopKImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> vals,
                    ffi::ResultBuffer<ffi::S32> ids, int64_t k, int64_t fold_zero) {
  auto xd = x.dimensions();
  if (xd.size() == 0) return ffi::Error::InvalidArgument("fucina_top_k: x must have at least one axis");
  const int64_t V = xd[xd.size() - 1], R = row_count(x, V);
  if (k < 1 || k > V) return ffi::Error::InvalidArgument("fucina_top_k: k must be in [1, V]");
  if (static_cast<int64_t>(vals->element_count()) != R * k || static_cast<int64_t>(ids->element_count()) != R * k)
    return ffi::Error::InvalidArgument("fucina_top_k: outputs must be [rows, k]");
  const float* xp = x.typed_data();
  float* vp = vals->typed_data();
  int32_t* ip = ids->typed_data();
  auto run = [&](int64_t r0, int64_t r1) {
    fucina::TopKScan scan;
    for (int64_t r = r0; r < r1; ++r) top_k_row(xp + r * V, V, k, fold_zero != 0, vp + r * k, ip + r * k, scan);
  };
  if (R > 1) {
    fucina::parallel_for(pool, R, run, 1);
  } else {
    run(0, R);
  }
  return ffi::Error::Success();
}

ffi::Error ArgmaxImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::S32> ids) {
  auto xd = x.dimensions();
  if (xd.size() == 0) return ffi::Error::InvalidArgument("fucina_argmax: x must have at least one axis");
  const int64_t V = xd[xd.size() - 1], R = row_count(x, V);
  if (V < 1) return ffi::Error::InvalidArgument("fucina_argmax: rows must not be empty");
  if (static_cast<int64_t>(ids->element_count()) != R)
    return ffi::Error::InvalidArgument("fucina_argmax: the output must hold one id per row");
  const float* xp = x.typed_data();
  int32_t* ip = ids->typed_data();
  auto run = [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) ip[r] = argmax_row(xp + r * V, V);
  };
  if (R > 1) {
    fucina::parallel_for(pool, R, run, 1);
  } else {
    run(0, R);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(FucinaTopK, TopKImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("k")
                                  .Attr<int64_t>("fold_zero"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(FucinaArgmax, ArgmaxImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());
