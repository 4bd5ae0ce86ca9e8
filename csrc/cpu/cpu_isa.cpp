// The CPU dispatch level (rheo/common.h): the CPU's best, or RHEO_CPU_ISA lowered to it. The
// dispatchers of cpu_math.h's RHEO_ISA_COPIES read it on every call (one relaxed atomic load).
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <string>

#include "rheo/common.h"

namespace rheo {
namespace cpu {
namespace {

// What this CPU (and its OS: __builtin_cpu_supports checks the saved register state) can run.
Isa best_supported() {
#if defined(__GNUC__) && defined(__x86_64__)
  __builtin_cpu_init();  // may run before libgcc's constructor when called from a static init
  if (__builtin_cpu_supports("avx512f")) return Isa::kAvx512;
  if (__builtin_cpu_supports("avx2")) return Isa::kAvx2;
#endif
  return Isa::kDefault;
}

Isa lowered(Isa level) { return std::min(level, best_supported()); }

// Read once, as torch reads ATEN_CPU_CAPABILITY; unset or empty means the CPU's best.
Isa from_env() {
  const char* name = std::getenv("RHEO_CPU_ISA");
  if (name == nullptr || *name == '\0') return best_supported();
  return lowered(parse_isa(name, "RHEO_CPU_ISA"));
}

// A throwing from_env leaves the static unset, so every later call raises the same error.
std::atomic<Isa>& level_slot() {
  static std::atomic<Isa> slot{from_env()};
  return slot;
}

}  // namespace

Isa active_isa() { return level_slot().load(std::memory_order_relaxed); }

Isa set_active_isa(Isa level) {
  const Isa now = lowered(level);
  level_slot().store(now, std::memory_order_relaxed);
  return now;
}

Isa parse_isa(const std::string& name, const char* what) {
  if (name == "default") return Isa::kDefault;
  if (name == "avx2") return Isa::kAvx2;
  if (name == "avx512") return Isa::kAvx512;
  fail(what, "='", name, "' is not a CPU ISA level; use default, avx2 or avx512");
}

const char* isa_name(Isa level) {
  switch (level) {
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    default: return "default";
  }
}

}  // namespace cpu
}  // namespace rheo
