// Several placed heads on the same CPU devices at once (shared_devices_scenario.h), each head
// with its own host collective: on 2 and 3 devices.
#include <memory>
#include <vector>

#include "gtest/gtest.h"
#include "losshead/kernels/backend.h"
#include "tests/server/shared_devices_scenario.h"

namespace losshead::server {
namespace {

class SharedDevicesTest : public ::testing::TestWithParam<int> {};

TEST_P(SharedDevicesTest, HeadsOnTheSameDevicesRunAtOnceAndCountEverythingOnce) {
  std::vector<std::unique_ptr<kernels::Backend>> cpus;
  std::vector<kernels::Backend*> devices;
  for (int i = 0; i < GetParam(); ++i) {
    auto backend = kernels::CreateBackend(kernels::BackendKind::kCpu);
    ASSERT_TRUE(backend.ok()) << backend.status();
    devices.push_back(backend->get());
    cpus.push_back(std::move(*backend));
  }
  auto one = kernels::CreateBackend(kernels::BackendKind::kCpu);
  ASSERT_TRUE(one.ok()) << one.status();
  shared_devices::RunHeadsSharingDevices(devices, **one);
}

INSTANTIATE_TEST_SUITE_P(Devices, SharedDevicesTest, ::testing::Values(2, 3));

}  // namespace
}  // namespace losshead::server
