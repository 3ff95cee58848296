#include "kernels/cpu/cpu_backend.h"

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/cpu_backend_impl.h"

namespace losshead::kernels {
namespace cpu {
namespace {

uint64_t MemInfoField(const std::string& field) {
  std::ifstream meminfo("/proc/meminfo");
  std::string name;
  uint64_t kib = 0;
  std::string unit;
  while (meminfo >> name >> kib >> unit) {
    if (name == field + ":") return kib * 1024;
  }
  return 0;
}

}  // namespace

std::mutex& BlasMutex() {
  static std::mutex* mu = new std::mutex;
  return *mu;
}

absl::Status CheckTargets(const Problem& problem, const int32_t* targets, int64_t* count) {
  int64_t counted = 0;
  for (int64_t t = 0; t < problem.n; ++t) {
    const int32_t y = targets[t];
    if (y == problem.options.ignore_index) continue;
    if (y < 0 || y >= problem.v) {
      return absl::InvalidArgumentError(absl::StrCat("targets[", t, "] = ", y, " is outside [0, ",
                                                     problem.v, ") and is not ignore_index (",
                                                     problem.options.ignore_index, ")"));
    }
    ++counted;
  }
  *count = counted;
  return absl::OkStatus();
}

float EffectiveGradScale(const LossOptions& options, int64_t token_count) {
  float grad_scale = options.grad_scale;
  if (options.reduction == Reduction::kMean) {
    grad_scale = token_count > 0 ? static_cast<float>(static_cast<double>(options.grad_scale) /
                                                      static_cast<double>(token_count))
                                 : 0.0f;
  }
  return grad_scale;
}

MemoryInfo HostMemoryInfo() {
  MemoryInfo info;
  info.total_bytes = MemInfoField("MemTotal");
  info.free_bytes = MemInfoField("MemAvailable");
  if (info.total_bytes == 0) {
    const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
    info.total_bytes = static_cast<uint64_t>(sysconf(_SC_PHYS_PAGES)) * page;
    info.free_bytes = static_cast<uint64_t>(sysconf(_SC_AVPHYS_PAGES)) * page;
  }
  return info;
}

}  // namespace cpu

std::unique_ptr<Backend> CreateCpuBackend(int threads) {
  if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return std::make_unique<cpu::CpuBackend>(threads);
}

}  // namespace losshead::kernels
