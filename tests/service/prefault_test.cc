// A pull or download into fresh memory has its pages mapped in beside the copies
// (client/src/prefault.h): the range is resident once the population ends, small ranges are left
// alone, and a pull into a fresh buffer carries exactly the bytes a pull into used memory does.
#include "client/src/prefault.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/service/host_tensors.h"
#include "tests/service/test_server.h"

namespace losshead::client {
namespace {

// An anonymous mapping nothing has touched: every page faults on first use.
class FreshMapping {
 public:
  explicit FreshMapping(size_t bytes) : bytes_(bytes) {
    data_ = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  }
  ~FreshMapping() {
    if (data_ != MAP_FAILED) munmap(data_, bytes_);
  }
  bool ok() const { return data_ != MAP_FAILED; }
  std::byte* data() const { return static_cast<std::byte*>(data_); }
  size_t bytes() const { return bytes_; }
  // Pages of the mapping that are resident.
  size_t ResidentPages() const {
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    std::vector<unsigned char> in((bytes_ + page - 1) / page);
    if (mincore(data_, bytes_, in.data()) != 0) return 0;
    size_t n = 0;
    for (unsigned char c : in) n += c & 1;
    return n;
  }

 private:
  void* data_;
  size_t bytes_;
};

bool KernelPopulates() {
  FreshMapping probe(size_t{1} << 16);
  return probe.ok() && madvise(probe.data(), probe.bytes(), 23 /* MADV_POPULATE_WRITE */) == 0;
}

TEST(PrefaultTest, MapsAFreshRangeInForWriting) {
  if (!KernelPopulates()) GTEST_SKIP() << "this kernel has no MADV_POPULATE_WRITE (Linux 5.14)";
  FreshMapping fresh(Prefault::kMinBytes);
  ASSERT_TRUE(fresh.ok());
  ASSERT_EQ(fresh.ResidentPages(), 0u);
  Prefault prefault;
  prefault.Start(fresh.data(), fresh.bytes());
  prefault.Wait();
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  EXPECT_EQ(fresh.ResidentPages(), fresh.bytes() / page);
}

TEST(PrefaultTest, SmallRangesAreLeftAlone) {
  FreshMapping fresh(Prefault::kMinBytes / 2);
  ASSERT_TRUE(fresh.ok());
  Prefault prefault;
  prefault.Start(fresh.data(), fresh.bytes());
  prefault.Wait();
  EXPECT_EQ(fresh.ResidentPages(), 0u);
}

// A 64 MiB dW (16384 x 1024 fp32) pulled into a fresh mapping, populated beside the copies, is
// the one pulled into memory the caller had written before.
TEST(PrefaultTest, PullIntoFreshMemoryMatchesPullIntoUsedMemory) {
  auto server = testing::TestServer::Start();
  ASSERT_TRUE(server.ok()) << server.status();
  auto client = (*server)->NewClient();
  constexpr int64_t kV = 16384, kD = 1024, kN = 8;
  v1::HeadSpec spec;
  spec.set_name("big");
  spec.set_vocab_size(kV);
  spec.set_hidden_size(kD);
  spec.set_weight_dtype(v1::DTYPE_FP32);
  spec.mutable_init()->mutable_normal()->set_std(0.02f);
  ASSERT_TRUE(client->CreateHead(spec).ok());
  const testing::HostBatch batch = testing::MakeBatch(kN, kD, kV, v1::DTYPE_FP32, 5);
  const Microbatch mb = testing::ToMicrobatch("big", "prefault", 1, batch);
  ASSERT_TRUE(client->Step(mb).ok());

  const size_t bytes = kV * kD * sizeof(float);
  std::vector<std::byte> used(bytes, std::byte{0x7f});
  ASSERT_TRUE(client->PullGradientInto("big", v1::DTYPE_FP32, false, used).ok());
  FreshMapping fresh(bytes);
  ASSERT_TRUE(fresh.ok());
  ASSERT_TRUE(client
                  ->PullGradientInto("big", v1::DTYPE_FP32, false,
                                     std::span<std::byte>(fresh.data(), bytes))
                  .ok());
  EXPECT_EQ(std::memcmp(used.data(), fresh.data(), bytes), 0);
  // Not all zeros: the step's dW is in it.
  EXPECT_NE(std::vector<std::byte>(used.begin(), used.begin() + 4096),
            std::vector<std::byte>(4096, std::byte{0}));
}

}  // namespace
}  // namespace losshead::client
