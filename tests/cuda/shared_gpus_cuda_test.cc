// Several placed heads on the same GPUs at once (tests/server/shared_devices_scenario.h): on 2
// and 4 GPUs through NCCL, where each head's communicators run beside the others', and on 2 ranks
// of one GPU through the staged collective wherever one GPU is visible.
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/cuda/cuda_backend.h"
#include "losshead/kernels/backend.h"
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
  const int needed = one_gpu ? 1 : k;
  if (kernels::CudaDeviceCount() < needed) {
    GTEST_SKIP() << "needs " << needed << " CUDA devices, " << kernels::CudaDeviceCount()
                 << " visible";
  }
  std::vector<std::unique_ptr<kernels::Backend>> gpus;
  std::vector<kernels::Backend*> devices;
  for (int i = 0; i < k; ++i) {
    auto backend = kernels::CreateBackend(kernels::BackendKind::kCuda, one_gpu ? 0 : i);
    ASSERT_TRUE(backend.ok()) << backend.status();
    devices.push_back(backend->get());
    gpus.push_back(std::move(*backend));
  }
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
