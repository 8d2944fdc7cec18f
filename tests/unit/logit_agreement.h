// How close one run's logits are to a reference's, the measure every logits test states its bound
// in: the largest difference over the largest reference logit, per row and overall, and how often
// the argmax agrees (also counting rows whose reference top two are within 2 tol as agreeing).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "test_util.h"

namespace sparsemla::test {

struct Agreement {
  double rel = 0;         // max |got - ref| / max |ref| (infinite for a non-finite logit or too few rows)
  double median = 0;      // median over rows of max |got - ref| / max |ref|
  double argmax = 0;      // share of rows whose argmax agrees
  double argmax_tie = 0;  // the same, counting rows where the reference's top two are within 2 tol as agreeing
  double within = 0;      // share of rows whose max |got - ref| / max |ref| is <= tol
  bool finite = true;
};

// The first `rows` rows of [*, V] logits.
inline Agreement compare(const std::vector<float>& got, const std::vector<float>& ref, int64_t V, int64_t rows,
                         double tol) {
  Agreement a;
  if (got.size() < size_t(rows * V) || ref.size() < size_t(rows * V) || rows == 0) {
    a.rel = INFINITY;
    return a;
  }
  double max_ref = 0;
  for (int64_t i = 0; i < rows * V; ++i) {
    if (!std::isfinite(got[size_t(i)])) a.finite = false;
    max_ref = std::max(max_ref, std::fabs(double(ref[size_t(i)])));
  }
  max_ref = std::max(max_ref, 1e-30);
  std::vector<double> row_err;
  int64_t same = 0, same_tie = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = got.data() + r * V;
    const float* f = ref.data() + r * V;
    double d = 0;
    for (int64_t i = 0; i < V; ++i) d = std::max(d, std::fabs(double(g[i]) - f[i]));
    row_err.push_back(d / max_ref);
    a.within += d / max_ref <= tol;
    const int32_t ag = argmax(g, V), af = argmax(f, V);
    same += ag == af;
    same_tie += ag == af || double(f[af]) - f[ag] <= 2 * tol * max_ref;
  }
  a.rel = a.finite ? *std::max_element(row_err.begin(), row_err.end()) : INFINITY;
  std::nth_element(row_err.begin(), row_err.begin() + rows / 2, row_err.end());
  a.median = row_err[size_t(rows / 2)];
  a.argmax = double(same) / double(rows);
  a.argmax_tie = double(same_tie) / double(rows);
  a.within /= double(rows);
  return a;
}

// Whole runs of the same length: every row (an infinite rel when the lengths differ).
inline Agreement compare_all(const std::vector<float>& got, const std::vector<float>& ref, int64_t V, double tol = 0) {
  if (got.size() != ref.size()) return Agreement{INFINITY, INFINITY, 0, 0, 0, true};
  return compare(got, ref, V, int64_t(ref.size()) / V, tol);
}

}  // namespace sparsemla::test
