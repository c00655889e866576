// The row selections' shared definitions (select.cc, and qmatmul.cc's output layer with the selections fused in).
#pragma once

#include <cstdint>
#include <cstring>
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

// (key, index): `a` ranks before `b` when its key is larger, or equal with a lower index.
inline bool ranks_before(const std::pair<int32_t, int32_t>& a, const std::pair<int32_t, int32_t>& b) {
  return a.first != b.first ? a.first > b.first : a.second < b.second;
}

// The k best (total_key, index) pairs of a scan in ranks_before order, over one or more stretches of values whose
// indices grow from stretch to stretch.
struct TopKScan {
  std::vector<std::pair<int32_t, int32_t>> heap;  // the kept pairs (a min-heap by rank once it holds k)
  int64_t k = 0;
  int32_t fold = 0;  // 1: -0.0 counts as +0.0
  void reset(int64_t k_, int32_t fold_) {
    heap.clear();
    heap.reserve(static_cast<size_t>(k_));
    k = k_;
    fold = fold_;
  }
};

// Offers x[0, n) at indices base .. base + n - 1 (past every index offered since the reset).
void top_k_scan(TopKScan& t, const float* x, int64_t n, int64_t base);

// The k largest of x[0, V) (k <= V) in ranks_before order of their keys: values and ids, largest first.
void top_k_row(const float* x, int64_t V, int64_t k, int32_t fold, float* vals, int32_t* ids, TopKScan& scratch);

// The lowest index holding the maximum of x[0, V) (+0.0 and -0.0 equal, NaNs skipped); with nothing above -inf the
// first -inf, and V - 1 when every value is NaN.
int32_t argmax_row(const float* x, int64_t V);

}  // namespace fucina
