// The host collectives on 2 and 3 CPU ranks, called directly and through the staged collective's
// copies (its path for CUDA backends that share a device): every op on random fp32 data with uneven
// slices, bit for bit against an fp64 sum in rank order; the copies in every dtype; the shard
// arithmetic; the factory's choices; and every refusal with its exact status code, leaving every
// buffer untouched.
#include "losshead/kernels/collective.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/collective/staged_collective.h"
#include "kernels/cpu/cpu_backend.h"
#include "losshead/kernels/backend.h"
#include "tests/kernels/slices.h"

namespace losshead::kernels {
namespace {

using ::losshead::testing::Offsets;
using ::losshead::testing::Total;

constexpr float kNan = std::numeric_limits<float>::quiet_NaN();

uint32_t Bits(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return bits;
}

// `code`, with a message that names `text`.
void ExpectStatus(const absl::Status& status, absl::StatusCode code, const std::string& text) {
  EXPECT_EQ(status.code(), code) << status;
  EXPECT_NE(status.message().find(text), std::string::npos) << status;
}

// Values over a wide range of magnitudes and both signs, so that sums round.
std::vector<float> RandomFloats(std::mt19937_64& rng, int64_t count) {
  std::uniform_real_distribution<float> mantissa(-1.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-12, 12);
  std::vector<float> values(count);
  for (float& v : values) v = std::ldexp(mantissa(rng), exponent(rng));
  return values;
}

std::vector<uint8_t> RandomBytes(std::mt19937_64& rng, size_t count) {
  std::uniform_int_distribution<int> byte(0, 255);
  std::vector<uint8_t> bytes(count);
  for (uint8_t& b : bytes) b = static_cast<uint8_t>(byte(rng));
  return bytes;
}

// Element j summed over the ranks in rank order, in fp64, rounded to fp32 once.
float OrderedSum(const std::vector<std::vector<float>>& ranks, int64_t j) {
  double sum = ranks[0][j];
  for (size_t r = 1; r < ranks.size(); ++r) sum += ranks[r][j];
  return static_cast<float>(sum);
}

template <typename T>
std::vector<void*> Pointers(std::vector<std::vector<T>>& ranks) {
  std::vector<void*> pointers;
  for (std::vector<T>& v : ranks) pointers.push_back(v.data());
  return pointers;
}

// k CPU backends with one stream each, and the collective over them: the one CreateCollective
// gives (the host's), or the staged one, which must give the same bits through its copies.
class CpuRanks {
 public:
  explicit CpuRanks(int k, bool staged = false) {
    std::vector<Backend*> backends;
    for (int r = 0; r < k; ++r) {
      backends_.push_back(CreateCpuBackend(1));
      backends.push_back(backends_.back().get());
      owned_streams_.push_back(*backends_.back()->CreateStream());
      streams_.push_back(owned_streams_.back().get());
    }
    if (staged) {
      collective_ = CreateStagedCollective(backends);
      return;
    }
    absl::StatusOr<std::unique_ptr<Collective>> collective = CreateCollective(backends);
    EXPECT_TRUE(collective.ok()) << collective.status();
    if (collective.ok()) collective_ = std::move(*collective);
  }

  Collective& collective() { return *collective_; }
  std::vector<Stream*>& streams() { return streams_; }

 private:
  std::vector<std::unique_ptr<Backend>> backends_;
  std::vector<std::unique_ptr<Stream>> owned_streams_;
  std::vector<Stream*> streams_;
  std::unique_ptr<Collective> collective_;
};

TEST(ShardRangeTest, SplitsEveryTotalIntoContiguousNearlyEqualShards) {
  const int64_t large = (int64_t{1} << 62) + 3;  // total * i overflows int64 here
  for (int64_t total :
       {int64_t{0}, int64_t{1}, int64_t{2}, int64_t{5}, int64_t{1001}, int64_t{128256}, large}) {
    for (int k = 1; k <= 8; ++k) {
      int64_t next = 0;
      for (int i = 0; i < k; ++i) {
        const Shard shard = ShardRange(total, k, i);
        const auto want_begin = static_cast<int64_t>(static_cast<__int128>(total) * i / k);
        EXPECT_EQ(shard.begin, want_begin) << "total " << total << " k " << k << " i " << i;
        EXPECT_EQ(shard.begin, next) << "shards are contiguous";
        EXPECT_GE(shard.size(), total / k);
        EXPECT_LE(shard.size(), total / k + 1);
        next = shard.end;
      }
      EXPECT_EQ(next, total) << "the shards cover every index";
    }
  }
}

TEST(ShardRangeTest, ShardCountsAreRowsTimesRowElements) {
  // V = 1001 over 3 devices, D = 4: rows 333, 334, 334.
  EXPECT_EQ(ShardCounts(1001, 3, 4), (std::vector<int64_t>{1332, 1336, 1336}));
  EXPECT_EQ(ShardCounts(7, 2), (std::vector<int64_t>{3, 4}));
  EXPECT_EQ(ShardCounts(2, 3), (std::vector<int64_t>{0, 1, 1}));
}

struct RankSetup {
  int k;
  bool staged;  // through CreateStagedCollective's copies
};

class HostCollectiveTest : public ::testing::TestWithParam<RankSetup> {
 protected:
  int k() const { return GetParam().k; }

  std::vector<std::vector<float>> RandomRanks(int64_t count) {
    std::vector<std::vector<float>> ranks;
    for (int r = 0; r < k(); ++r) ranks.push_back(RandomFloats(rng_, count));
    return ranks;
  }

  // Uneven slices of W-like rows (V = 1001 rows of 3 elements), and slices with an empty one.
  std::vector<std::vector<int64_t>> SliceLayouts() const {
    std::vector<std::vector<int64_t>> layouts = {ShardCounts(1001, k(), 3)};
    std::vector<int64_t> with_empty(k(), 9);
    with_empty[1] = 0;
    with_empty[0] = 5;
    layouts.push_back(with_empty);
    return layouts;
  }

  std::mt19937_64 rng_{0x5eed0000u + static_cast<uint64_t>(GetParam().k)};
  CpuRanks ranks_{GetParam().k, GetParam().staged};
};

TEST_P(HostCollectiveTest, AllReduceSumIsTheFp64SumInRankOrder) {
  for (int64_t count : {int64_t{1}, int64_t{1001}, int64_t{4099}}) {
    const std::vector<std::vector<float>> input = RandomRanks(count);
    std::vector<std::vector<float>> data = input;
    ASSERT_TRUE(
        ranks_.collective()
            .AllReduce(Pointers(data), count, DType::kFP32, ReduceOp::kSum, ranks_.streams())
            .ok());
    for (int r = 0; r < k(); ++r) {
      for (int64_t j = 0; j < count; ++j) {
        ASSERT_EQ(Bits(data[r][j]), Bits(OrderedSum(input, j)))
            << "rank " << r << " element " << j << " of " << count;
      }
    }
  }
}

// The root holds the fp64 sum in rank order, whichever rank it is.
TEST_P(HostCollectiveTest, ReduceSumOnTheRootIsTheFp64SumInRankOrder) {
  constexpr int64_t kCount = 1001;
  for (int root = 0; root < k(); ++root) {
    const std::vector<std::vector<float>> input = RandomRanks(kCount);
    std::vector<std::vector<float>> data = input;
    ASSERT_TRUE(ranks_.collective()
                    .Reduce(Pointers(data), kCount, DType::kFP32, root, ranks_.streams())
                    .ok());
    for (int64_t j = 0; j < kCount; ++j) {
      ASSERT_EQ(Bits(data[root][j]), Bits(OrderedSum(input, j)))
          << "root " << root << " element " << j;
    }
  }
}

TEST_P(HostCollectiveTest, AllReduceMaxIsTheLargestValue) {
  const int64_t count = 2003;
  std::vector<std::vector<float>> input = RandomRanks(count);
  input[k() - 1][7] = kNan;  // NaN wins wherever it is
  std::vector<std::vector<float>> data = input;
  ASSERT_TRUE(ranks_.collective()
                  .AllReduce(Pointers(data), count, DType::kFP32, ReduceOp::kMax, ranks_.streams())
                  .ok());
  for (int r = 0; r < k(); ++r) {
    for (int64_t j = 0; j < count; ++j) {
      if (j == 7) {
        ASSERT_TRUE(std::isnan(data[r][j]));
        continue;
      }
      float want = input[0][j];
      for (int i = 1; i < k(); ++i) want = std::max(want, input[i][j]);
      ASSERT_EQ(Bits(data[r][j]), Bits(want)) << "rank " << r << " element " << j;
    }
  }
}

TEST_P(HostCollectiveTest, ReduceScatterSumsEachSliceIntoItsOwnerOnly) {
  for (const std::vector<int64_t>& counts : SliceLayouts()) {
    const std::vector<int64_t> offsets = Offsets(counts);
    const std::vector<std::vector<float>> input = RandomRanks(Total(counts));
    std::vector<std::vector<float>> data = input;
    ASSERT_TRUE(ranks_.collective()
                    .ReduceScatter(Pointers(data), counts, DType::kFP32, ranks_.streams())
                    .ok());
    for (int r = 0; r < k(); ++r) {
      for (int s = 0; s < k(); ++s) {
        for (int64_t j = offsets[s]; j < offsets[s] + counts[s]; ++j) {
          const float want = s == r ? OrderedSum(input, j) : input[r][j];
          ASSERT_EQ(Bits(data[r][j]), Bits(want))
              << "rank " << r << " slice " << s << " element " << j
              << (s == r ? " (its own: the sum)" : " (another's: untouched)");
        }
      }
    }
  }
}

TEST_P(HostCollectiveTest, AllGatherCopiesEachOwnersSliceEverywhereInEveryDType) {
  for (DType dtype : {DType::kFP32, DType::kBF16, DType::kFP16}) {
    const size_t size = DTypeSize(dtype);
    for (const std::vector<int64_t>& counts : SliceLayouts()) {
      const std::vector<int64_t> offsets = Offsets(counts);
      std::vector<std::vector<uint8_t>> input;
      for (int r = 0; r < k(); ++r) input.push_back(RandomBytes(rng_, Total(counts) * size));
      std::vector<std::vector<uint8_t>> data = input;
      ASSERT_TRUE(
          ranks_.collective().AllGather(Pointers(data), counts, dtype, ranks_.streams()).ok());
      for (int r = 0; r < k(); ++r) {
        for (int s = 0; s < k(); ++s) {
          const size_t at = offsets[s] * size;
          EXPECT_EQ(std::memcmp(data[r].data() + at, input[s].data() + at, counts[s] * size), 0)
              << DTypeName(dtype) << ": rank " << r << " slice " << s;
        }
      }
    }
  }
}

TEST_P(HostCollectiveTest, BroadcastCopiesTheRootEverywhereInEveryDType) {
  for (DType dtype : {DType::kFP32, DType::kBF16, DType::kFP16}) {
    for (int root = 0; root < k(); ++root) {
      const int64_t count = 517;
      std::vector<std::vector<uint8_t>> input;
      for (int r = 0; r < k(); ++r) input.push_back(RandomBytes(rng_, count * DTypeSize(dtype)));
      std::vector<std::vector<uint8_t>> data = input;
      ASSERT_TRUE(
          ranks_.collective().Broadcast(Pointers(data), count, dtype, root, ranks_.streams()).ok());
      for (int r = 0; r < k(); ++r) {
        EXPECT_EQ(data[r], input[root]) << DTypeName(dtype) << ": root " << root << " rank " << r;
      }
    }
  }
}

TEST_P(HostCollectiveTest, NothingToMoveIsOkWithNullBuffers) {
  std::vector<void*> null(k(), nullptr);
  std::vector<int64_t> zeros(k(), 0);
  Collective& c = ranks_.collective();
  EXPECT_TRUE(c.AllReduce(null, 0, DType::kFP32, ReduceOp::kSum, ranks_.streams()).ok());
  EXPECT_TRUE(c.ReduceScatter(null, zeros, DType::kFP32, ranks_.streams()).ok());
  EXPECT_TRUE(c.AllGather(null, zeros, DType::kBF16, ranks_.streams()).ok());
  EXPECT_TRUE(c.Broadcast(null, 0, DType::kFP16, 0, ranks_.streams()).ok());
}

INSTANTIATE_TEST_SUITE_P(Ranks, HostCollectiveTest,
                         ::testing::Values(RankSetup{2, false}, RankSetup{3, false},
                                           RankSetup{2, true}, RankSetup{3, true}),
                         [](const ::testing::TestParamInfo<RankSetup>& info) {
                           return absl::StrCat(info.param.k, "Ranks",
                                               info.param.staged ? "Staged" : "");
                         });

TEST(HostCollectiveSumTest, AccumulatesInFp64BeforeRoundingOnce) {
  // In fp32, 1e8 + 1 rounds back to 1e8 and the 1 is lost; in fp64 it survives the cancellation.
  CpuRanks ranks(3);
  std::vector<std::vector<float>> data = {{1e8f, -0.0f}, {1.0f, -0.0f}, {-1e8f, -0.0f}};
  ASSERT_TRUE(ranks.collective()
                  .AllReduce(Pointers(data), 2, DType::kFP32, ReduceOp::kSum, ranks.streams())
                  .ok());
  for (const std::vector<float>& rank : data) {
    EXPECT_EQ(rank[0], 1.0f);
    EXPECT_EQ(Bits(rank[1]), Bits(-0.0f)) << "a sum of -0s stays -0";
  }
}

TEST(HostCollectiveSumTest, OneRankIsTheIdentity) {
  CpuRanks ranks(1);
  EXPECT_EQ(ranks.collective().size(), 1);
  std::vector<std::vector<float>> data = {{1.5f, -2.0f, 3.25f}};
  const std::vector<std::vector<float>> input = data;
  ASSERT_TRUE(ranks.collective()
                  .AllReduce(Pointers(data), 3, DType::kFP32, ReduceOp::kSum, ranks.streams())
                  .ok());
  ASSERT_TRUE(
      ranks.collective()
          .ReduceScatter(Pointers(data), std::vector<int64_t>{3}, DType::kFP32, ranks.streams())
          .ok());
  EXPECT_EQ(data, input);
}

// A stream that claims a device: the host collective cannot read what such a stream orders.
class DeviceLikeStream final : public Stream {
 public:
  absl::Status Synchronize() override { return absl::OkStatus(); }
  void* native() const override { return reinterpret_cast<void*>(uintptr_t{0x1000}); }
};

// Every refusal on 3 ranks: its code, the problem its message names, and untouched buffers.
class HostCollectiveErrorsTest : public ::testing::Test {
 protected:
  static constexpr int kRanks = 3;
  static constexpr float kPoison = 12345.0f;

  void SetUp() override {
    for (std::vector<float>& rank : data_) rank.assign(kCount, kPoison);
    buffers_ = Pointers(data_);
  }

  void ExpectRefused(const absl::Status& status, const std::string& text) {
    ExpectStatus(status, absl::StatusCode::kInvalidArgument, text);
    for (const std::vector<float>& rank : data_) {
      for (float x : rank) ASSERT_EQ(x, kPoison) << "a refused call touched a buffer";
    }
  }

  Collective& c() { return ranks_.collective(); }
  std::vector<Stream*>& streams() { return ranks_.streams(); }

  static constexpr int64_t kCount = 12;
  CpuRanks ranks_{kRanks};
  std::vector<std::vector<float>> data_{kRanks};
  std::vector<void*> buffers_;
  std::vector<int64_t> counts_{4, 4, 4};
};

TEST_F(HostCollectiveErrorsTest, WrongNumberOfBuffersStreamsOrCounts) {
  std::vector<void*> two_buffers(buffers_.begin(), buffers_.begin() + 2);
  std::vector<Stream*> two_streams(streams().begin(), streams().begin() + 2);
  std::vector<int64_t> four_counts = {3, 3, 3, 3};
  ExpectRefused(c().AllReduce(two_buffers, kCount, DType::kFP32, ReduceOp::kSum, streams()),
                "AllReduce: 2 buffers for 3 ranks");
  ExpectRefused(c().AllReduce(buffers_, kCount, DType::kFP32, ReduceOp::kSum, two_streams),
                "AllReduce: 2 streams for 3 ranks");
  ExpectRefused(c().ReduceScatter(buffers_, four_counts, DType::kFP32, streams()),
                "ReduceScatter: 4 counts for 3 ranks");
  ExpectRefused(c().AllGather(two_buffers, counts_, DType::kFP32, streams()),
                "AllGather: 2 buffers for 3 ranks");
  ExpectRefused(c().AllGather(buffers_, std::vector<int64_t>{6, 6}, DType::kFP32, streams()),
                "AllGather: 2 counts for 3 ranks");
  ExpectRefused(c().Broadcast(buffers_, kCount, DType::kFP32, 0, two_streams),
                "Broadcast: 2 streams for 3 ranks");
}

TEST_F(HostCollectiveErrorsTest, NegativeCounts) {
  ExpectRefused(c().AllReduce(buffers_, -1, DType::kFP32, ReduceOp::kSum, streams()),
                "AllReduce: count -1 is negative");
  ExpectRefused(c().Broadcast(buffers_, -5, DType::kBF16, 1, streams()),
                "Broadcast: count -5 is negative");
  ExpectRefused(
      c().ReduceScatter(buffers_, std::vector<int64_t>{4, -4, 4}, DType::kFP32, streams()),
      "ReduceScatter: counts[1] = -4 is negative");
  ExpectRefused(c().AllGather(buffers_, std::vector<int64_t>{4, 4, -1}, DType::kFP16, streams()),
                "AllGather: counts[2] = -1 is negative");
}

TEST_F(HostCollectiveErrorsTest, CountsWhoseSumOverflows) {
  const int64_t max = std::numeric_limits<int64_t>::max();
  ExpectRefused(
      c().ReduceScatter(buffers_, std::vector<int64_t>{max, 1, 0}, DType::kFP32, streams()),
      "ReduceScatter: the counts' sum overflows int64");
  ExpectRefused(c().AllReduce(buffers_, max / 2, DType::kFP32, ReduceOp::kSum, streams()),
                "overflow a byte count");
}

TEST_F(HostCollectiveErrorsTest, NullBufferWithElementsOrNullStream) {
  std::vector<void*> buffers = buffers_;
  buffers[1] = nullptr;
  ExpectRefused(c().AllReduce(buffers, kCount, DType::kFP32, ReduceOp::kMax, streams()),
                "AllReduce: buffer of rank 1 is null with 12 elements");
  ExpectRefused(c().ReduceScatter(buffers, counts_, DType::kFP32, streams()),
                "ReduceScatter: buffer of rank 1 is null");
  ExpectRefused(c().AllGather(buffers, counts_, DType::kBF16, streams()),
                "AllGather: buffer of rank 1 is null");
  ExpectRefused(c().Broadcast(buffers, kCount, DType::kFP32, 0, streams()),
                "Broadcast: buffer of rank 1 is null");
  std::vector<Stream*> null_stream = streams();
  null_stream[2] = nullptr;
  ExpectRefused(c().AllReduce(buffers_, kCount, DType::kFP32, ReduceOp::kSum, null_stream),
                "AllReduce: stream of rank 2 is null");
  ExpectRefused(c().AllReduce(buffers_, 0, DType::kFP32, ReduceOp::kSum, null_stream),
                "AllReduce: stream of rank 2 is null");
}

TEST_F(HostCollectiveErrorsTest, ReductionsTakeFp32Only) {
  ExpectRefused(c().AllReduce(buffers_, kCount, DType::kBF16, ReduceOp::kSum, streams()),
                "AllReduce: reduces fp32 only, got bf16");
  ExpectRefused(c().AllReduce(buffers_, kCount, DType::kFP16, ReduceOp::kMax, streams()),
                "AllReduce: reduces fp32 only, got fp16");
  ExpectRefused(c().ReduceScatter(buffers_, counts_, DType::kBF16, streams()),
                "ReduceScatter: reduces fp32 only, got bf16");
  ExpectRefused(c().Reduce(buffers_, kCount, DType::kBF16, 0, streams()),
                "Reduce: reduces fp32 only, got bf16");
}

TEST_F(HostCollectiveErrorsTest, UnknownOpDTypeOrRoot) {
  ExpectRefused(c().AllReduce(buffers_, kCount, DType::kFP32, static_cast<ReduceOp>(7), streams()),
                "AllReduce: unknown reduce op 7");
  ExpectRefused(c().AllGather(buffers_, counts_, static_cast<DType>(9), streams()),
                "AllGather: unknown dtype 9");
  ExpectRefused(c().Broadcast(buffers_, kCount, DType::kFP32, 3, streams()),
                "Broadcast: root 3 is outside [0, 3)");
  ExpectRefused(c().Broadcast(buffers_, kCount, DType::kFP32, -1, streams()),
                "Broadcast: root -1 is outside [0, 3)");
  ExpectRefused(c().Reduce(buffers_, kCount, DType::kFP32, 3, streams()),
                "Reduce: root 3 is outside [0, 3)");
}

TEST_F(HostCollectiveErrorsTest, DeviceStream) {
  DeviceLikeStream device_stream;
  std::vector<Stream*> mixed = streams();
  mixed[1] = &device_stream;
  ExpectRefused(c().AllReduce(buffers_, kCount, DType::kFP32, ReduceOp::kSum, mixed),
                "AllReduce: stream of rank 1 is a device stream");
  ExpectRefused(c().ReduceScatter(buffers_, counts_, DType::kFP32, mixed),
                "ReduceScatter: stream of rank 1 is a device stream");
  ExpectRefused(c().AllGather(buffers_, counts_, DType::kFP32, mixed),
                "AllGather: stream of rank 1 is a device stream");
  ExpectRefused(c().Broadcast(buffers_, kCount, DType::kFP32, 0, mixed),
                "Broadcast: stream of rank 1 is a device stream");
}

// A backend that only has a name and a device: enough for the factory, which runs nothing on it.
class NamedBackend final : public Backend {
 public:
  NamedBackend(std::string name, int device) : name_(std::move(name)), device_(device) {}

  absl::string_view name() const override { return name_; }
  std::string device_description() const override { return absl::StrCat(name_, ":", device_); }
  int device_ordinal() const override { return device_; }
  MemoryInfo memory_info() const override { return {}; }
  absl::Status CanImplement(const Problem&) const override { return Unused(); }
  absl::StatusOr<size_t> WorkspaceBytes(const Problem&, size_t) const override { return Unused(); }
  absl::Status Run(const Problem&, const Arguments&, Stream&) override { return Unused(); }
  absl::Status SquaredNorm(const float*, int64_t, double*, Stream&) override { return Unused(); }
  absl::Status OptimizerStep(const OptimizerProblem&, const OptimizerTensors&, Stream&) override {
    return Unused();
  }
  absl::Status CheckOptimizerStep(const OptimizerProblem&, const OptimizerTensors&, OptimizerCheck*,
                                  Stream&) override {
    return Unused();
  }
  absl::StatusOr<DeviceBuffer> Allocate(size_t) override { return Unused(); }
  absl::StatusOr<std::unique_ptr<Stream>> CreateStream() override { return Unused(); }
  absl::Status CopyToDevice(void*, const void*, size_t, Stream&) override { return Unused(); }
  absl::Status CopyToHost(void*, const void*, size_t, Stream&) override { return Unused(); }
  absl::Status Memset(void*, int, size_t, Stream&) override { return Unused(); }

 protected:
  void Free(void*) override {}

 private:
  static absl::Status Unused() { return absl::UnimplementedError("not used by these tests"); }
  std::string name_;
  int device_;
};

TEST(CreateCollectiveTest, CpuBackendsGetTheHostCollectiveAndMayRepeat) {
  std::unique_ptr<Backend> a = CreateCpuBackend(1);
  std::unique_ptr<Backend> b = CreateCpuBackend(1);
  EXPECT_EQ(a->device_ordinal(), -1);
  std::vector<Backend*> backends = {a.get(), b.get(), a.get()};
  absl::StatusOr<std::unique_ptr<Collective>> collective = CreateCollective(backends);
  ASSERT_TRUE(collective.ok()) << collective.status();
  EXPECT_EQ((*collective)->size(), 3);
}

TEST(CreateCollectiveTest, RefusesWhatItCannotSpan) {
  std::unique_ptr<Backend> cpu = CreateCpuBackend(1);
  NamedBackend cuda0("cuda", 0), cuda1("cuda", 1), other_cuda0("cuda", 0);
  NamedBackend no_device("cuda", -1), tpu("tpu", 0);
  using Backends = std::vector<Backend*>;
  ExpectStatus(CreateCollective(Backends{}).status(), absl::StatusCode::kInvalidArgument,
               "no backends");
  ExpectStatus(CreateCollective(Backends{cpu.get(), nullptr}).status(),
               absl::StatusCode::kInvalidArgument, "backend of rank 1 is null");
  ExpectStatus(CreateCollective(Backends{cpu.get(), &cuda0}).status(),
               absl::StatusCode::kInvalidArgument, "1 cpu and 1 cuda backends");
  ExpectStatus(CreateCollective(Backends{&tpu}).status(), absl::StatusCode::kInvalidArgument,
               "\"tpu\", which has no collective implementation");
  ExpectStatus(CreateCollective(Backends{&cuda0, &no_device}).status(),
               absl::StatusCode::kInvalidArgument, "rank 1 (cuda:-1) names no device ordinal");
  ExpectStatus(CreateCollective(Backends{&cuda0, &cuda1, &other_cuda0}).status(),
               absl::StatusCode::kInvalidArgument, "device 0 appears twice (rank 2)");
}

TEST(CreateCollectiveTest, CudaBackendsAllOnOneDeviceGetTheStagedCollective) {
  // NCCL takes one rank per device; k ranks of one GPU are staged through the host instead.
  NamedBackend cuda0("cuda", 0), other_cuda0("cuda", 0), third_cuda0("cuda", 0);
  absl::StatusOr<std::unique_ptr<Collective>> collective =
      CreateCollective(std::vector<Backend*>{&cuda0, &other_cuda0, &third_cuda0});
  ASSERT_TRUE(collective.ok()) << collective.status();
  EXPECT_EQ((*collective)->size(), 3);
}

TEST(CreateCollectiveTest, CudaBackendsNeedNcclAndVisibleDevices) {
  NamedBackend far0("cuda", 1000), far1("cuda", 1001);
  const absl::Status status = CreateCollective(std::vector<Backend*>{&far0, &far1}).status();
#ifdef LOSSHEAD_HAVE_NCCL
  ExpectStatus(status, absl::StatusCode::kInvalidArgument, "device 1000 of rank 0 does not exist");
#else
  ExpectStatus(status, absl::StatusCode::kUnimplemented, "has no NCCL");
#endif
}

}  // namespace
}  // namespace losshead::kernels
