#include "engine/metrics.h"

#include <algorithm>

namespace sparsemla::engine {

void Histogram::observe(double v) {
  std::lock_guard lk(mu_);
  const size_t b = size_t(std::lower_bound(bounds_.begin(), bounds_.end(), v) - bounds_.begin());
  if (b < counts_.size()) ++counts_[b];
  ++count_;
  sum_ += v;
}

Histogram::Snapshot Histogram::snapshot() const {
  std::lock_guard lk(mu_);
  Snapshot s{bounds_, std::vector<uint64_t>(bounds_.size()), count_, sum_};
  uint64_t c = 0;
  for (size_t i = 0; i < bounds_.size(); ++i) s.cumulative[i] = c += counts_[i];
  return s;
}

}  // namespace sparsemla::engine
