// Attention of query rows over the KV cache on the CPU, called from jax.jit through the XLA FFI.
//
//   out[b, t, h] = sum_j softmax_j(scale * q[b, t, h] . k[b, j, h / G]) * v[b, j, h / G]
//   over the visible slots j: j <= pos[b, t], and pos[b, t] - j < window on sliding layers (window > 0).
//
// Each (b, t, h) row is computed on its own, in one fixed order (dot products in 16 lanes folded by a fixed tree,
// the softmax sum and the weighted V sum in slot order), so a row is bitwise the same whatever the other rows of
// the step: decode and verify rows agree exactly. Only visible slots are read, so a step costs O(position) (O(window)
// on sliding layers), not O(cache capacity). Compiled with -ffp-contract=off: the AVX-512 / AVX2 clones GCC makes of
// the row function do the same IEEE operations in the same order as the generic one.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "parallel.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kLanes = 16;

#define FUCINA_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))

// a . b over n values: 16 partial sums, then a fixed halving tree.
inline float dot_fixed(const float* a, const float* b, int64_t n) {
  float acc[kLanes] = {0};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] += a[i + l] * b[i + l];
  for (int l = 0; i + l < n; ++l) acc[l] += a[i + l] * b[i + l];
  for (int w = kLanes / 2; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
  return acc[0];
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
};

FUCINA_CLONES
void attend_row(const float* q, const float* k, const float* v, int64_t pos, float scale, int64_t window,
                const Shape& s, float* scores, float* out) {
  // k and v point at [S, K, D] of this batch row and kv head; slots are s.K * D apart.
  const int64_t hi = std::min<int64_t>(pos, s.S - 1);
  const int64_t lo = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
  for (int64_t d = 0; d < s.Dv; ++d) out[d] = 0.0f;
  if (hi < lo) return;
  float m = -INFINITY;
  for (int64_t j = lo; j <= hi; ++j) {
    const float sc = dot_fixed(q, k + j * s.K * s.Dh, s.Dh) * scale;
    scores[j - lo] = sc;
    m = std::max(m, sc);
  }
  float l = 0.0f;
  for (int64_t j = lo; j <= hi; ++j) {
    const float e = exp_neg(scores[j - lo] - m);
    scores[j - lo] = e;
    l += e;
  }
  for (int64_t j = lo; j <= hi; ++j) {
    const float e = scores[j - lo];
    const float* vj = v + j * s.K * s.Dv;
    for (int64_t d = 0; d < s.Dv; ++d) out[d] += e * vj[d];
  }
  const float inv = 1.0f / l;
  for (int64_t d = 0; d < s.Dv; ++d) out[d] *= inv;
}

ffi::Error AttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                         ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> pos, ffi::ResultBuffer<ffi::F32> out,
                         float scale, int64_t window) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(), pd = pos.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4 || pd.size() != 2)
    return ffi::Error::InvalidArgument("fucina_attention: q, k, v must be 4-D and pos 2-D");
  Shape s{qd[0], qd[1], qd[2], qd[3], kd[1], kd[2], vd[3], 0};
  if (kd[0] != s.B || vd[0] != s.B || vd[1] != s.S || vd[2] != s.K || kd[3] != s.Dh || pd[0] != s.B ||
      pd[1] != s.T || s.K == 0 || s.H % s.K)
    return ffi::Error::InvalidArgument("fucina_attention: inconsistent q/k/v/pos shapes");
  s.G = s.H / s.K;
  const float* qp = q.typed_data();
  const float* kp = k.typed_data();
  const float* vp = v.typed_data();
  const int32_t* pp = pos.typed_data();
  float* op = out->typed_data();
  const int64_t rows = s.B * s.T * s.H;
  auto run = [&](int64_t r0, int64_t r1) {
    std::vector<float> scores(static_cast<size_t>(s.S));
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t h = r % s.H, t = (r / s.H) % s.T, b = r / (s.H * s.T);
      const int64_t kh = h / s.G;
      attend_row(qp + r * s.Dh, kp + (b * s.S * s.K + kh) * s.Dh, vp + (b * s.S * s.K + kh) * s.Dv,
                 pp[b * s.T + t], scale, window, s, scores.data(), op + r * s.Dv);
    }
  };
  // Waking a pool thread costs more than a short decode row's work: small calls stay on this thread.
  int64_t span = 0;
  for (int64_t i = 0; i < s.B * s.T; ++i) span = std::max<int64_t>(span, std::min<int64_t>(pp[i] + 1, s.S));
  if (window > 0) span = std::min(span, window);
  if (rows * span * (s.Dh + s.Dv) < (1 << 18)) {
    run(0, rows);
  } else {
    fucina::parallel_for(pool, rows, run);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(FucinaAttention, AttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
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
// own vfmaddsub choices, even under -ffp-contract=off).
__attribute__((optimize("no-tree-vectorize"))) void rotate_pairs(float* y, const float* cs, int64_t half,
                                                                 bool neox) {
  for (int64_t i = 0; i < half; ++i) {
    const int64_t a = neox ? i : 2 * i, b = neox ? i + half : 2 * i + 1;
    const float c = cs[2 * i], s = cs[2 * i + 1];
    const float x0 = y[a], x1 = y[b];
    y[a] = std::fmaf(x0, c, -(x1 * s));
    y[b] = std::fmaf(x0, s, x1 * c);
  }
}

FUCINA_CLONES
void norm_rope_row(const float* x, const float* w, int64_t Dh, float eps, bool norm, const float* cs,
                   int64_t half, bool neox, float* y) {
  if (norm) {
    norm_row(x, w, Dh, eps, y);
  } else {
    for (int64_t d = 0; d < Dh; ++d) y[d] = x[d];
  }
  rotate_pairs(y, cs, half, neox);
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
  for (int64_t bt = 0; bt < B * T; ++bt)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t r = bt * H + h;
      norm_rope_row(xp + r * Dh, wp, Dh, eps, norm != 0, cs.typed_data() + bt * 2 * half, half, neox != 0,
                    yp + r * Dh);
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
