// TakeRegionInput (server/rpc/region_input.h): a micro-batch's tensors copied out of a region when
// it runs are what StepAssembler assembles from the same bytes received in a message, digests and
// largest |h| included, so that a repeat matches across the paths; its refusals change nothing.
// Exercised through a host region (a sealed memfd): the copy is the only step a device region
// does otherwise (tests/service/device_path_cuda_test.cc runs that one on a GPU).
#include "server/rpc/region_input.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>

#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "server/rpc/shared_regions.h"
#include "server/rpc/step_assembler.h"

namespace losshead::server {
namespace {

constexpr uint64_t kRegionBytes = uint64_t{4} << 20;

// A sealed memfd of kRegionBytes registered in `regions`, and this process's mapping of it.
struct HostRegion {
  std::shared_ptr<SharedRegion> region;
  uint8_t* data = nullptr;
  explicit HostRegion(SharedRegions& regions) {
    const int fd = ::memfd_create("losshead-region-input", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    EXPECT_GE(fd, 0);
    EXPECT_EQ(::ftruncate(fd, static_cast<off_t>(kRegionBytes)), 0);
    EXPECT_EQ(::fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW), 0);
    data = static_cast<uint8_t*>(
        ::mmap(nullptr, kRegionBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
    auto registered = regions.Register(fd, kRegionBytes, "");
    EXPECT_TRUE(registered.ok()) << registered.status();
    if (registered.ok()) region = *registered;
    ::close(fd);
  }
  ~HostRegion() { ::munmap(data, kRegionBytes); }
};

std::string RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> byte(0, 255);
  std::string out(n, '\0');
  for (char& c : out) c = static_cast<char>(byte(rng));
  return out;
}

// Finite bf16 values (exponents below the top), so that the largest |h| is a number.
std::string FiniteBf16(size_t count, uint32_t seed) {
  std::string out = RandomBytes(2 * count, seed);
  for (size_t i = 1; i < out.size(); i += 2) out[i] = static_cast<char>(out[i] & 0x3f);
  return out;
}

v1::StepHeader Header(v1::DType dtype, bool client_id, bool forward_only) {
  v1::StepHeader h;
  h.set_head("h");
  h.set_sequence(3);
  h.set_hidden_dtype(dtype);
  if (client_id) h.set_client_id("c");
  h.mutable_options()->set_forward_only(forward_only);
  return h;
}

// The micro-batch StepAssembler makes of `hidden` and `targets` received in one message.
MicroBatch Assembled(const v1::StepHeader& header, const std::string& hidden,
                     const std::string& targets) {
  StepAssembler assembler(size_t{1} << 30);
  v1::StepRequest request;
  *request.mutable_header() = header;
  request.set_hidden(hidden);
  request.set_targets(targets);
  request.set_last(true);
  auto got = assembler.Add(request, absl::Now());
  EXPECT_TRUE(got.ok() && got->has_value());
  return (*got)->microbatch;
}

void ExpectSame(const MicroBatch& got, const MicroBatch& want) {
  EXPECT_EQ(got.hidden_bytes(), want.hidden_bytes());
  EXPECT_EQ(got.targets, want.targets);
  EXPECT_EQ(got.hidden_digest, want.hidden_digest);
  EXPECT_EQ(got.targets_digest, want.targets_digest);
  ASSERT_EQ(got.hidden_max_abs.has_value(), want.hidden_max_abs.has_value());
  if (got.hidden_max_abs.has_value()) {
    // Bit for bit: NaN/Inf included (+Inf either way).
    EXPECT_EQ(std::memcmp(&*got.hidden_max_abs, &*want.hidden_max_abs, sizeof(float)), 0)
        << *got.hidden_max_abs << " vs " << *want.hidden_max_abs;
  }
}

TEST(RegionInputTest, IsWhatTheAssemblerMakesOfTheSameBytes) {
  SharedRegions regions;
  HostRegion host(regions);
  ASSERT_NE(host.region, nullptr);
  struct Case {
    const char* what;
    v1::DType dtype;
    std::string hidden;
    bool client_id;
    bool forward_only;
  };
  std::string with_nan = FiniteBf16(300000, 4);
  with_nan[2 * 123457 + 1] = static_cast<char>(0x7f);  // exponent all ones: Inf or NaN
  with_nan[2 * 123457] = static_cast<char>(0x81);
  const Case cases[] = {
      {"bf16 over many cache steps", v1::DTYPE_BF16, FiniteBf16(700001, 1), true, false},
      {"fp32, random bits (NaNs likely)", v1::DTYPE_FP32, RandomBytes(4 * 70001, 2), true, false},
      {"no client id: no digests", v1::DTYPE_BF16, FiniteBf16(5000, 3), false, false},
      {"forward-only: no digests", v1::DTYPE_BF16, FiniteBf16(5000, 5), true, true},
      {"a NaN deep inside", v1::DTYPE_BF16, with_nan, true, false},
      {"a trailing partial element: no largest |h|", v1::DTYPE_FP32, FiniteBf16(5001, 6), true,
       false},
      {"not a float dtype: no largest |h|", v1::DTYPE_UNSPECIFIED, FiniteBf16(100, 7), true, false},
      {"no hidden states", v1::DTYPE_BF16, "", true, false},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    const std::string targets = RandomBytes(4 * 1000, 9);
    const uint64_t targets_at = 3 << 20;
    ASSERT_LE(c.hidden.size(), targets_at - 64);
    std::memcpy(host.data + 64, c.hidden.data(), c.hidden.size());
    std::memcpy(host.data + targets_at, targets.data(), targets.size());
    const v1::StepHeader header = Header(c.dtype, c.client_id, c.forward_only);
    MicroBatch got;
    got.header = header;
    const RegionInput input{.region = host.region,
                            .hidden_offset = 64,
                            .hidden_bytes = c.hidden.size(),
                            .targets_offset = targets_at,
                            .targets_bytes = targets.size()};
    ASSERT_TRUE(TakeRegionInput(input, nullptr, got).ok());
    ExpectSame(got, Assembled(header, c.hidden, targets));
    EXPECT_EQ(got.hidden_digest.has_value(), c.client_id && !c.forward_only);
  }
}

// With a pool of page-locked buffers the hidden states land in one of them, as the network path's
// micro-batches of several messages do.
TEST(RegionInputTest, HiddenStatesLandInThePinnedPool) {
  SharedRegions regions;
  HostRegion host(regions);
  ASSERT_NE(host.region, nullptr);
  auto pool = PinnedPool::Create(
      [](size_t bytes) -> absl::StatusOr<kernels::HostBuffer> {
        return kernels::HostBuffer(std::malloc(bytes), bytes, &std::free);
      },
      size_t{64} << 20);
  const std::string hidden = FiniteBf16(600000, 11);
  const std::string targets = RandomBytes(4 * 77, 12);
  std::memcpy(host.data, hidden.data(), hidden.size());
  std::memcpy(host.data + hidden.size(), targets.data(), targets.size());
  const v1::StepHeader header = Header(v1::DTYPE_BF16, true, false);
  MicroBatch got;
  got.header = header;
  const RegionInput input{.region = host.region,
                          .hidden_offset = 0,
                          .hidden_bytes = hidden.size(),
                          .targets_offset = hidden.size(),
                          .targets_bytes = targets.size()};
  ASSERT_TRUE(TakeRegionInput(input, pool.get(), got).ok());
  ASSERT_NE(got.pinned_hidden, nullptr);
  EXPECT_TRUE(got.hidden.empty());
  EXPECT_GE(pool->held_bytes(), hidden.size());
  ExpectSame(got, Assembled(header, hidden, targets));
  got.ReleaseTensors();
  EXPECT_EQ(pool->idle_bytes(), pool->held_bytes());  // given back
}

// A client that closes its region's connection after its header was admitted: the micro-batch is
// refused NOT_FOUND when it comes to run, nothing taken, although the mapping still lives.
TEST(RegionInputTest, ARegionUnregisteredSinceAdmissionIsNotFoundAndChangesNothing) {
  SharedRegions regions;
  HostRegion host(regions);
  ASSERT_NE(host.region, nullptr);
  EXPECT_TRUE(host.region->registered());
  regions.Unregister(host.region->id());
  EXPECT_FALSE(host.region->registered());
  EXPECT_EQ(regions.mapped_regions(), 1u);  // still mapped: the micro-batch holds it
  MicroBatch mb;
  mb.header = Header(v1::DTYPE_BF16, true, false);
  const RegionInput input{.region = host.region,
                          .hidden_offset = 0,
                          .hidden_bytes = 1024,
                          .targets_offset = 1024,
                          .targets_bytes = 64};
  const absl::Status taken = TakeRegionInput(input, nullptr, mb);
  EXPECT_EQ(taken.code(), absl::StatusCode::kNotFound) << taken;
  EXPECT_TRUE(mb.hidden_bytes().empty());
  EXPECT_TRUE(mb.targets.empty());
  EXPECT_FALSE(mb.hidden_digest.has_value());
  EXPECT_FALSE(mb.hidden_max_abs.has_value());
}

TEST(RegionInputTest, TensorsInTheMessagesTooAreInvalidAndKept) {
  SharedRegions regions;
  HostRegion host(regions);
  ASSERT_NE(host.region, nullptr);
  MicroBatch mb;
  mb.header = Header(v1::DTYPE_BF16, true, false);
  mb.hidden = "abcd";
  const RegionInput input{.region = host.region, .hidden_bytes = 8, .targets_bytes = 4};
  EXPECT_EQ(TakeRegionInput(input, nullptr, mb).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(mb.hidden, "abcd");
  mb.hidden.clear();
  mb.targets = "tt";
  EXPECT_EQ(TakeRegionInput(input, nullptr, mb).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(mb.targets, "tt");
}

}  // namespace
}  // namespace losshead::server
