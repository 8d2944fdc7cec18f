// Environment switches: SPARSEMLA_* variables that turn a path on or off without a rebuild (A/B
// comparisons, debugging). Read them once (a static) where they are asked on a hot path.
#pragma once
#include <cstdlib>
#include <cstring>

namespace sparsemla {

// -1 unset or empty, 0 for "0", 1 for anything else.
inline int env_switch(const char* name) {
  const char* v = std::getenv(name);
  if (!v || !*v) return -1;
  return std::strcmp(v, "0") == 0 ? 0 : 1;
}

// Whether switch `name` is set to "0" (turned off).
inline bool env_off(const char* name) { return env_switch(name) == 0; }

// The integer in `name`, or `fallback` where it is unset, empty or not a whole number.
inline long long env_int(const char* name, long long fallback) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  char* end = nullptr;
  const long long x = std::strtoll(v, &end, 10);
  return *end ? fallback : x;
}

}  // namespace sparsemla
