// /metrics in the Prometheus text format (version 0.0.4).
#pragma once
#include <cstdint>
#include <map>
#include <string>

#include "engine/metrics.h"
#include "engine/scheduler.h"

namespace sparsemla::server {

std::string metrics_text(const engine::EngineMetrics& m, const engine::SchedulerStats& st,
                         const std::map<int, uint64_t>& responses_by_status);

}  // namespace sparsemla::server
