// The C ABI's version 6 same-node device path (lh_same_node_devices, lh_device_region_register,
// lh_device_region_free, lh_step_many_device) against a real server on CPUs: no devices offered,
// a device region refused FAILED_PRECONDITION, bad arguments INVALID_ARGUMENT, and each
// micro-batch's path reported (shared memory, this server being on this host). The device path
// itself runs in tests/service device_path_cuda_test on a GPU host.
#include <dlfcn.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "losshead/capi.h"
#include "tests/capi/capi_fixture.h"

namespace {

constexpr int kInvalidArgument = 3;
constexpr int kFailedPrecondition = 9;
constexpr int kFp32 = 3;  // losshead.v1.DType
constexpr int kInt32 = 4;
constexpr int64_t kV = 13, kD = 8;

class CapiDeviceTest : public CapiServerTest {};

TEST_F(CapiDeviceTest, VersionSixAddsTheDevicePathUnderItsOwnSymbolVersion) {
  EXPECT_GE(lh_capi_version(), 6);
  EXPECT_GE(LH_CAPI_VERSION, 6);
  for (const char* name : {"lh_same_node_devices", "lh_device_region_register",
                           "lh_device_region_free", "lh_step_many_device"}) {
    EXPECT_NE(dlvsym(RTLD_DEFAULT, name, "LH_CAPI_6"), nullptr) << name;
    EXPECT_EQ(dlvsym(RTLD_DEFAULT, name, "LH_CAPI_5"), nullptr) << name;
  }
}

TEST_F(CapiDeviceTest, AServerOnCpusOffersNoDevicesAndRefusesDeviceRegions) {
  lh_same_node_device devices[4] = {};
  size_t count = 99;
  lh_status status{};
  ASSERT_EQ(lh_same_node_devices(client_, devices, 4, &count, &status), 0) << status.message;
  EXPECT_EQ(count, 0u);
  EXPECT_EQ(lh_same_node_devices(client_, nullptr, 4, &count, &status), kInvalidArgument);

  const std::string handle(64, '\x11');
  lh_device_region* region = reinterpret_cast<lh_device_region*>(0x1);
  EXPECT_EQ(lh_device_region_register(client_, handle.data(), handle.size(), 0, 1 << 20,
                                      "0000:00:00.0", &region, &status),
            kFailedPrecondition)
      << status.message;
  EXPECT_EQ(status.code, kFailedPrecondition);
  EXPECT_EQ(region, nullptr);
  EXPECT_EQ(lh_device_region_register(nullptr, handle.data(), handle.size(), 0, 1 << 20, "",
                                      &region, &status),
            kInvalidArgument);
  EXPECT_EQ(lh_device_region_register(client_, nullptr, 64, 0, 1 << 20, "", &region, &status),
            kInvalidArgument);
  lh_device_region_free(nullptr);  // nothing to free: no effect
}

TEST_F(CapiDeviceTest, EachMicrobatchReportsItsPath) {
  const std::string head = CreateHead(kV, kD);
  constexpr int64_t kN = 9;
  std::mt19937_64 rng(3);
  std::uniform_real_distribution<float> value(-1.5f, 1.5f);
  std::vector<float> hidden(kN * kD);
  for (float& x : hidden) x = value(rng);
  std::vector<int32_t> targets(kN);
  for (int32_t& t : targets) t = static_cast<int32_t>(rng() % kV);
  std::vector<float> grad[2] = {std::vector<float>(kN * kD), std::vector<float>(kN * kD)};
  lh_microbatch mbs[2] = {};
  for (int i = 0; i < 2; ++i) {
    mbs[i].head = head.c_str();
    mbs[i].client_id = "capi-device";
    mbs[i].sequence = i + 1;
    mbs[i].num_tokens = kN;
    mbs[i].hidden_dtype = kFp32;
    mbs[i].hidden = hidden.data();
    mbs[i].hidden_bytes = hidden.size() * sizeof(float);
    mbs[i].target_dtype = kInt32;
    mbs[i].targets = targets.data();
    mbs[i].targets_bytes = targets.size() * sizeof(int32_t);
    mbs[i].grad_hidden_out = grad[i].data();
    mbs[i].grad_hidden_capacity = grad[i].size() * sizeof(float);
  }
  // No device region named: both go the host's way (this server is on this host).
  lh_device_tensors none[2] = {};
  lh_step_result results[2] = {};
  int paths[2] = {-1, -1};
  lh_status status{};
  ASSERT_EQ(lh_step_many_device(client_, mbs, nullptr, none, 2, 2, results, paths, &status), 0)
      << status.message;
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(results[i].status.code, 0) << results[i].status.message;
    EXPECT_EQ(paths[i], LH_PATH_SHARED_MEMORY);
  }
  // The same keys again, without devices at all: replayed, dH the same bits.
  std::vector<float> first = grad[0];
  ASSERT_EQ(lh_step_many_device(client_, mbs, nullptr, nullptr, 2, 1, results, nullptr, &status), 0)
      << status.message;
  EXPECT_EQ(results[0].replayed, 1);
  EXPECT_EQ(grad[0], first);
}

}  // namespace
