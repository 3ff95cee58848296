// CreateBackend, the CPU backend's memory management and DeviceBuffer ownership.
#include <cstdint>
#include <cstring>
#include <numeric>
#include <vector>

#include "gtest/gtest.h"
#include "losshead/kernels/backend.h"

namespace losshead::kernels {
namespace {

TEST(BackendFactoryTest, CpuKindGivesTheCpuBackend) {
  absl::StatusOr<std::unique_ptr<Backend>> backend = CreateBackend(BackendKind::kCpu);
  ASSERT_TRUE(backend.ok()) << backend.status();
  EXPECT_EQ((*backend)->name(), "cpu");
  EXPECT_NE((*backend)->device_description().find("cpu"), std::string::npos);
  const MemoryInfo memory = (*backend)->memory_info();
  EXPECT_GT(memory.total_bytes, 0u);
  EXPECT_LE(memory.free_bytes, memory.total_bytes);
}

TEST(BackendFactoryTest, CudaKindIsUnavailableWithoutCudaAndAutoFallsBackToCpu) {
  if (CudaAvailable()) GTEST_SKIP() << "a CUDA device is present";
  EXPECT_EQ(CreateBackend(BackendKind::kCuda).status().code(), absl::StatusCode::kUnavailable);
  absl::StatusOr<std::unique_ptr<Backend>> automatic = CreateBackend(BackendKind::kAuto);
  ASSERT_TRUE(automatic.ok()) << automatic.status();
  EXPECT_EQ((*automatic)->name(), "cpu");
}

TEST(CpuMemoryTest, AllocateCopyMemsetRoundTrip) {
  std::unique_ptr<Backend> backend = *CreateBackend(BackendKind::kCpu);
  absl::StatusOr<std::unique_ptr<Stream>> stream = backend->CreateStream();
  ASSERT_TRUE(stream.ok());
  EXPECT_EQ((*stream)->native(), nullptr);
  absl::StatusOr<DeviceBuffer> buffer = backend->Allocate(1001);
  ASSERT_TRUE(buffer.ok());
  ASSERT_NE(buffer->data(), nullptr);
  EXPECT_EQ(buffer->bytes(), 1001u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(buffer->data()) % 64, 0u);

  std::vector<uint8_t> in(1001), out(1001, 0);
  std::iota(in.begin(), in.end(), 0);
  ASSERT_TRUE(backend->CopyToDevice(buffer->data(), in.data(), in.size(), **stream).ok());
  ASSERT_TRUE(backend->CopyToHost(out.data(), buffer->data(), out.size(), **stream).ok());
  ASSERT_TRUE((*stream)->Synchronize().ok());
  EXPECT_EQ(in, out);
  ASSERT_TRUE(backend->Memset(buffer->as<uint8_t>() + 10, 0xab, 20, **stream).ok());
  ASSERT_TRUE(backend->CopyToHost(out.data(), buffer->data(), out.size(), **stream).ok());
  ASSERT_TRUE((*stream)->Synchronize().ok());
  for (size_t i = 0; i < out.size(); ++i) {
    ASSERT_EQ(out[i], i >= 10 && i < 30 ? 0xab : in[i]) << i;
  }
}

TEST(CpuMemoryTest, DeviceBufferMovesOwnershipAndResets) {
  std::unique_ptr<Backend> backend = *CreateBackend(BackendKind::kCpu);
  DeviceBuffer a = *backend->Allocate(256);
  void* data = a.data();
  DeviceBuffer b = std::move(a);
  EXPECT_EQ(a.data(),
            nullptr);  // NOLINT(bugprone-use-after-move): the moved-from state is the contract
  EXPECT_EQ(a.bytes(), 0u);
  EXPECT_EQ(b.data(), data);
  DeviceBuffer c;
  c = std::move(b);
  EXPECT_EQ(c.data(), data);
  EXPECT_EQ(c.bytes(), 256u);
  c.Reset();
  EXPECT_EQ(c.data(), nullptr);
  EXPECT_EQ(c.bytes(), 0u);

  absl::StatusOr<DeviceBuffer> empty = backend->Allocate(0);
  ASSERT_TRUE(empty.ok());
  EXPECT_EQ(empty->bytes(), 0u);
}

}  // namespace
}  // namespace losshead::kernels
