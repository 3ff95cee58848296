#include "server/engine/weight_init.h"

#include <algorithm>
#include <atomic>
#include <cassert>
#include <random>
#include <thread>
#include <vector>

#include "losshead/kernels/dtype_convert.h"

namespace losshead::server {
namespace {

// Block `block` of W, `count` (<= kNormalInitBlock) of its values, as `dtype` into `out`;
// false when one of them is not finite in `dtype`.
bool DrawBlock(const v1::NormalInit& init, kernels::DType dtype, int64_t block, int64_t count,
               std::vector<float>& values, char* out) {
  const uint64_t seed = init.seed();
  const uint64_t index = static_cast<uint64_t>(block);
  std::seed_seq seeds{static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32),
                      static_cast<uint32_t>(index), static_cast<uint32_t>(index >> 32)};
  std::mt19937_64 rng(seeds);
  std::normal_distribution<float> normal(0.0f, init.std());
  values.resize(static_cast<size_t>(count));
  for (float& x : values) x = normal(rng);
  kernels::FromFloat(dtype, values.data(), out, values.size());
  return !kernels::HasNonFinite(dtype, out, values.size());
}

}  // namespace

bool DrawNormalInit(const v1::NormalInit& init, kernels::DType dtype, int64_t first, int64_t count,
                    int threads, char* out) {
  assert(first % kNormalInitBlock == 0);
  const int64_t blocks = (count + kNormalInitBlock - 1) / kNormalInitBlock;
  const size_t esize = kernels::DTypeSize(dtype);
  std::atomic<int64_t> next{0};
  std::atomic<bool> finite{true};
  auto draw = [&] {
    std::vector<float> values;
    for (int64_t b = next++; b < blocks; b = next++) {
      const int64_t begin = b * kNormalInitBlock;
      if (!DrawBlock(init, dtype, first / kNormalInitBlock + b,
                     std::min(kNormalInitBlock, count - begin), values, out + begin * esize)) {
        finite = false;
      }
    }
  };
  {
    std::vector<std::jthread> helpers;
    const int64_t workers = std::clamp<int64_t>(threads, 1, std::max<int64_t>(blocks, 1));
    for (int64_t i = 1; i < workers; ++i) helpers.emplace_back(draw);
    draw();
  }  // the helpers join here
  return finite;
}

int NormalInitThreads() {
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

}  // namespace losshead::server
