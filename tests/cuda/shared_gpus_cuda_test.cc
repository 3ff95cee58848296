// Several placed heads on the same GPUs at once (tests/server/shared_devices_scenario.h): on 2
// and 4 GPUs through NCCL, where each head's communicators run beside the others', and on 2 ranks
// of one GPU through the staged collective wherever one GPU is visible.
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "losshead/kernels/backend.h"
#include "tests/cuda/placed_devices.h"
#include "tests/server/shared_devices_scenario.h"

namespace losshead::server {
namespace {

struct Shared {
  int k;
  bool one_gpu = false;  // k ranks of device 0 (the staged collective)
};

class SharedGpusCudaTest : public ::testing::TestWithParam<Shared> {};

TEST_P(SharedGpusCudaTest, HeadsOnTheSameGpusRunAtOnceAndCountEverythingOnce) {
  const int k = GetParam().k;
  const bool one_gpu = GetParam().one_gpu;
  if (const std::string why = testing::TooFewGpus(k, one_gpu); !why.empty()) GTEST_SKIP() << why;
  auto gpus = testing::PlacedBackends(k, one_gpu);
  ASSERT_TRUE(gpus.ok()) << gpus.status();
  const std::vector<kernels::Backend*> devices = testing::Pointers(*gpus);
  shared_devices::RunHeadsSharingDevices(devices, *devices[0]);
}

INSTANTIATE_TEST_SUITE_P(Gpus, SharedGpusCudaTest,
                         ::testing::Values(Shared{2}, Shared{4}, Shared{2, true}),
                         [](const auto& info) {
                           return absl::StrCat(info.param.k,
                                               info.param.one_gpu ? "ranks_on_one_gpu" : "gpus");
                         });

}  // namespace
}  // namespace losshead::server
