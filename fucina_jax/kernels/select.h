// The row selections' shared definitions (select.cc, and qmatmul.cc's output layer with the selections fused in).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <utility>
#include <vector>

namespace fucina {

// Float bits -> int32 ordered as XLA TopK's total order (-NaN < -inf < ... < -0.0 < +0.0 < ... < +inf < +NaN);
// fold (0 or 1) maps -0.0 (key -1) to +0.0's key 0.
inline int32_t total_key(float f, int32_t fold) {
  int32_t b;
  std::memcpy(&b, &f, 4);
  const int32_t key = b ^ ((b >> 31) & 0x7FFFFFFF);
  return key + (fold & (key == -1));
}

// The float whose total_key (unfolded) is key: the map is its own inverse (a folded -0.0 comes back as +0.0).
inline float key_value(int32_t key) {
  const int32_t b = key ^ ((key >> 31) & 0x7FFFFFFF);
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

// A (total_key, index) pair as one int64 in the selections' order: a pair ranks before another when its key is
// larger, or equal with a lower index. The key is in the high half and the index's complement in the low half, so a
// larger int64 ranks first (and the selections compare and move one integer, not a pair).
inline int64_t ranked(int32_t key, int32_t index) {
  return static_cast<int64_t>((static_cast<uint64_t>(static_cast<uint32_t>(key)) << 32) |
                              static_cast<uint32_t>(~static_cast<uint32_t>(index)));
}
inline int32_t ranked_key(int64_t r) { return static_cast<int32_t>(r >> 32); }
inline int32_t ranked_index(int64_t r) { return static_cast<int32_t>(~static_cast<uint32_t>(r)); }

// The k best (total_key, index) pairs of a scan in the selections' order (ranked), over one or more stretches of
// values whose indices grow from stretch to stretch. The pairs that beat the k-th best seen so far are appended to `kept`, and
// when it holds 2k they are cut back to the k best (nth_element): amortised O(1) work per pair that enters, where
// a heap paid two sifts of log k levels with unpredictable branches (most of a top-64 scan's time). The k best of
// a strict total order are one set, however they were collected; finish() orders them.
struct TopKScan {
  std::vector<int64_t> kept;  // ranked pairs: the k best offered so far (and maybe others)
  int64_t k = 0;
  int32_t fold = 0;  // 1: -0.0 counts as +0.0
  int32_t thr = 0;   // once kept has held k pairs: the key of the k-th best at the last cut (a pair must beat it)
  void reset(int64_t k_, int32_t fold_) {
    kept.clear();
    kept.reserve(static_cast<size_t>(2 * k_ + 1));
    k = k_;
    fold = fold_;
  }
  // Cut kept back to its min(k, size) best, best first.
  void finish() {
    const size_t n = std::min(kept.size(), static_cast<size_t>(k));
    std::partial_sort(kept.begin(), kept.begin() + n, kept.end(), std::greater<int64_t>());
    kept.resize(n);
  }
};

// Offers x[0, n) at indices base .. base + n - 1 (past every index offered since the reset).
void top_k_scan(TopKScan& t, const float* x, int64_t n, int64_t base);

// The k largest of x[0, V) (k <= V) in the selections' order of their keys: values and ids, largest first.
void top_k_row(const float* x, int64_t V, int64_t k, int32_t fold, float* vals, int32_t* ids, TopKScan& scratch);

// The lowest index holding the maximum of x[0, V) (+0.0 and -0.0 equal, NaNs skipped); with nothing above -inf the
// first -inf, and V - 1 when every value is NaN.
int32_t argmax_row(const float* x, int64_t V);

}  // namespace fucina
