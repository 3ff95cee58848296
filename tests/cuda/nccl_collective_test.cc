// The NCCL collectives against the host collectives on the same random data, on 2, 3 and 4 GPUs
// (each size skips where fewer CUDA devices are visible): fp32 sums within the rounding of k fp32
// terms, maxima and every copy bit for bit, the slices a call does not own untouched, reruns
// bit-identical, concurrent callers kept in one order; and the refusals only devices can give
// (a stream or memory of another device, host memory, a CPU stream).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "losshead/kernels/backend.h"
#include "losshead/kernels/collective.h"
#include "tests/kernels/slices.h"

namespace losshead::kernels {
namespace {

using ::losshead::testing::Offsets;
using ::losshead::testing::Total;

#define SKIP_WITHOUT_GPUS(k)                                                               \
  if (CudaDeviceCount() < (k))                                                             \
  GTEST_SKIP() << "the NCCL suite needs " << (k) << " CUDA devices, " << CudaDeviceCount() \
               << " visible"

// Every rank's bytes.
using Bytes = std::vector<std::vector<uint8_t>>;
// One collective call on per-rank buffers and streams.
using Call =
    std::function<absl::Status(Collective&, std::span<void* const>, std::span<Stream* const>)>;

constexpr double kFp32Epsilon = 1.0 / (1 << 23);

std::vector<uint8_t> AsBytes(const std::vector<float>& values) {
  std::vector<uint8_t> bytes(values.size() * sizeof(float));
  std::memcpy(bytes.data(), values.data(), bytes.size());
  return bytes;
}

float FloatAt(const std::vector<uint8_t>& bytes, int64_t j) {
  float x;
  std::memcpy(&x, bytes.data() + j * sizeof(float), sizeof(float));
  return x;
}

// Values over a wide range of magnitudes and both signs, so that sums round.
Bytes RandomFloats(std::mt19937_64& rng, int k, int64_t count) {
  std::uniform_real_distribution<float> mantissa(-1.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-12, 12);
  Bytes ranks;
  for (int r = 0; r < k; ++r) {
    std::vector<float> values(count);
    for (float& v : values) v = std::ldexp(mantissa(rng), exponent(rng));
    ranks.push_back(AsBytes(values));
  }
  return ranks;
}

Bytes RandomBytes(std::mt19937_64& rng, int k, size_t bytes) {
  std::uniform_int_distribution<int> byte(0, 255);
  Bytes ranks(k, std::vector<uint8_t>(bytes));
  for (std::vector<uint8_t>& rank : ranks) {
    for (uint8_t& b : rank) b = static_cast<uint8_t>(byte(rng));
  }
  return ranks;
}

// k backends of one kind with one stream each, and the collective over them.
class Ranks {
 public:
  // CUDA backends on devices 0..k-1, or k CPU backends.
  absl::Status Init(int k, bool cuda) {
    std::vector<Backend*> pointers;
    for (int r = 0; r < k; ++r) {
      if (cuda) {
        absl::StatusOr<std::unique_ptr<Backend>> backend = CreateCudaBackend(r);
        if (!backend.ok()) return backend.status();
        backends_.push_back(std::move(*backend));
      } else {
        backends_.push_back(CreateCpuBackend(1));
      }
      pointers.push_back(backends_.back().get());
    }
    if (absl::Status s = AddStreams(); !s.ok()) return s;
    absl::StatusOr<std::unique_ptr<Collective>> collective = CreateCollective(pointers);
    if (!collective.ok()) return collective.status();
    collective_ = std::move(*collective);
    return absl::OkStatus();
  }

  // One more stream per rank; returns its index for streams().
  absl::Status AddStreams() {
    std::vector<Stream*> set;
    for (std::unique_ptr<Backend>& backend : backends_) {
      absl::StatusOr<std::unique_ptr<Stream>> stream = backend->CreateStream();
      if (!stream.ok()) return stream.status();
      set.push_back(stream->get());
      owned_streams_.push_back(std::move(*stream));
    }
    stream_sets_.push_back(set);
    return absl::OkStatus();
  }

  int size() const { return static_cast<int>(backends_.size()); }
  Backend& backend(int r) { return *backends_[r]; }
  Collective& collective() { return *collective_; }
  std::vector<Stream*>& streams(int set = 0) { return stream_sets_[set]; }

  // Each rank's bytes in a fresh buffer of its backend.
  std::vector<DeviceBuffer> Upload(const Bytes& input, int set = 0) {
    std::vector<DeviceBuffer> buffers;
    for (int r = 0; r < size(); ++r) {
      absl::StatusOr<DeviceBuffer> buffer = backends_[r]->Allocate(input[r].size());
      EXPECT_TRUE(buffer.ok()) << buffer.status();
      if (!buffer.ok()) return {};
      EXPECT_TRUE(
          backends_[r]
              ->CopyToDevice(buffer->data(), input[r].data(), input[r].size(), *streams(set)[r])
              .ok());
      buffers.push_back(std::move(*buffer));
    }
    Synchronize(set);
    return buffers;
  }

  Bytes Download(const std::vector<DeviceBuffer>& buffers, int set = 0) {
    Bytes out;
    for (int r = 0; r < size(); ++r) {
      out.emplace_back(buffers[r].bytes());
      EXPECT_TRUE(
          backends_[r]
              ->CopyToHost(out[r].data(), buffers[r].data(), buffers[r].bytes(), *streams(set)[r])
              .ok());
    }
    Synchronize(set);
    return out;
  }

  void Synchronize(int set = 0) {
    for (Stream* stream : streams(set)) EXPECT_TRUE(stream->Synchronize().ok());
  }

  // `call` on buffers holding `input`; every rank's bytes afterwards.
  Bytes Run(const Bytes& input, const Call& call) {
    std::vector<DeviceBuffer> buffers = Upload(input);
    std::vector<void*> pointers;
    for (DeviceBuffer& b : buffers) pointers.push_back(b.data());
    const absl::Status status = call(collective(), pointers, streams());
    EXPECT_TRUE(status.ok()) << status;
    return Download(buffers);
  }

 private:
  std::vector<std::unique_ptr<Backend>> backends_;
  std::vector<std::unique_ptr<Stream>> owned_streams_;
  std::vector<std::vector<Stream*>> stream_sets_;
  std::unique_ptr<Collective> collective_;
};

class NcclCollectiveTest : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override {
    SKIP_WITHOUT_GPUS(k());
    const absl::Status status = gpus_.Init(k(), /*cuda=*/true);
    if (status.code() == absl::StatusCode::kUnimplemented) {
      GTEST_SKIP() << "this build has no NCCL: " << status;
    }
    ASSERT_TRUE(status.ok()) << status;
    ASSERT_TRUE(host_.Init(k(), /*cuda=*/false).ok());
  }

  int k() const { return GetParam(); }

  // `call` on the GPUs, twice, and on the host: the two GPU runs must agree bit for bit.
  void RunBoth(const Bytes& input, const Call& call, Bytes* gpu, Bytes* host) {
    *gpu = gpus_.Run(input, call);
    const Bytes rerun = gpus_.Run(input, call);
    EXPECT_TRUE(rerun == *gpu) << "a rerun on the same input changed the result";
    *host = host_.Run(input, call);
  }

  // fp32 element j of a sum: within the rounding of k fp32 additions of the inputs. Adds one
  // failure and returns false otherwise, so that a broken sum reports once, not per element.
  bool SumClose(const Bytes& input, const std::vector<uint8_t>& gpu,
                const std::vector<uint8_t>& host, int64_t j, int rank) {
    double magnitude = 0;
    for (const std::vector<uint8_t>& r : input) magnitude += std::fabs(FloatAt(r, j));
    const double tolerance = k() * kFp32Epsilon * magnitude;
    if (std::fabs(double{FloatAt(gpu, j)} - double{FloatAt(host, j)}) <= tolerance) return true;
    ADD_FAILURE() << "rank " << rank << " element " << j << ": NCCL " << FloatAt(gpu, j)
                  << ", host " << FloatAt(host, j) << ", tolerance " << tolerance;
    return false;
  }

  // Uneven slices of W-like rows (V = 1001 rows of 3 elements), even ones (NCCL's own
  // reduce-scatter and all-gather), and uneven ones with an empty slice.
  std::vector<std::vector<int64_t>> SliceLayouts() const {
    std::vector<int64_t> with_empty(k(), 9);
    with_empty[0] = 5;
    with_empty[1] = 0;
    return {ShardCounts(1001, k(), 3), ShardCounts(300 * k(), k(), 5), with_empty};
  }

  Ranks gpus_;
  Ranks host_;
  std::mt19937_64 rng_{0x5eed1000u + static_cast<uint64_t>(GetParam())};
};

TEST_P(NcclCollectiveTest, AllReduceSumMatchesTheHostWithinFp32Rounding) {
  for (int64_t count : {int64_t{1}, int64_t{1001}, (int64_t{1} << 22) + 3}) {
    SCOPED_TRACE(count);
    const Bytes input = RandomFloats(rng_, k(), count);
    const Call call = [count](Collective& c, std::span<void* const> b, std::span<Stream* const> s) {
      return c.AllReduce(b, count, DType::kFP32, ReduceOp::kSum, s);
    };
    Bytes gpu, host;
    RunBoth(input, call, &gpu, &host);
    for (int r = 0; r < k(); ++r) {
      for (int64_t j = 0; j < count; ++j) {
        if (!SumClose(input, gpu[r], host[r], j, r)) return;
      }
    }
  }
}

// Only the root's sum is specified: it matches the host's within fp32 rounding, for every root.
TEST_P(NcclCollectiveTest, ReduceSumOnTheRootMatchesTheHostWithinFp32Rounding) {
  constexpr int64_t kCount = (int64_t{1} << 20) + 7;
  for (int root = 0; root < k(); ++root) {
    SCOPED_TRACE(root);
    const Bytes input = RandomFloats(rng_, k(), kCount);
    const Call call = [root](Collective& c, std::span<void* const> b, std::span<Stream* const> s) {
      return c.Reduce(b, kCount, DType::kFP32, root, s);
    };
    Bytes gpu, host;
    RunBoth(input, call, &gpu, &host);
    for (int64_t j = 0; j < kCount; ++j) {
      if (!SumClose(input, gpu[root], host[root], j, root)) return;
    }
  }
}

TEST_P(NcclCollectiveTest, AllReduceMaxMatchesTheHostBitForBit) {
  constexpr int64_t kCount = 100003;
  const Bytes input = RandomFloats(rng_, k(), kCount);
  const Call call = [](Collective& c, std::span<void* const> b, std::span<Stream* const> s) {
    return c.AllReduce(b, kCount, DType::kFP32, ReduceOp::kMax, s);
  };
  Bytes gpu, host;
  RunBoth(input, call, &gpu, &host);
  EXPECT_TRUE(gpu == host);
}

TEST_P(NcclCollectiveTest, ReduceScatterSumsEachSliceIntoItsOwnerOnly) {
  for (const std::vector<int64_t>& counts : SliceLayouts()) {
    SCOPED_TRACE(::testing::PrintToString(counts));
    const std::vector<int64_t> offsets = Offsets(counts);
    const Bytes input = RandomFloats(rng_, k(), Total(counts));
    const Call call = [&counts](Collective& c, std::span<void* const> b,
                                std::span<Stream* const> s) {
      return c.ReduceScatter(b, counts, DType::kFP32, s);
    };
    Bytes gpu, host;
    RunBoth(input, call, &gpu, &host);
    for (int r = 0; r < k(); ++r) {
      for (int s = 0; s < k(); ++s) {
        const size_t at = offsets[s] * sizeof(float);
        const size_t bytes = counts[s] * sizeof(float);
        if (s != r) {
          ASSERT_EQ(std::memcmp(gpu[r].data() + at, input[r].data() + at, bytes), 0)
              << "rank " << r << " slice " << s << " is another's: untouched";
          continue;
        }
        for (int64_t j = offsets[s]; j < offsets[s] + counts[s]; ++j) {
          if (!SumClose(input, gpu[r], host[r], j, r)) return;
        }
      }
    }
  }
}

TEST_P(NcclCollectiveTest, AllGatherMatchesTheHostBitForBitInEveryDType) {
  for (DType dtype : {DType::kFP32, DType::kBF16, DType::kFP16}) {
    for (const std::vector<int64_t>& counts : SliceLayouts()) {
      SCOPED_TRACE(absl::StrCat(DTypeName(dtype), " ", ::testing::PrintToString(counts)));
      const Bytes input = RandomBytes(rng_, k(), Total(counts) * DTypeSize(dtype));
      const Call call = [&counts, dtype](Collective& c, std::span<void* const> b,
                                         std::span<Stream* const> s) {
        return c.AllGather(b, counts, dtype, s);
      };
      Bytes gpu, host;
      RunBoth(input, call, &gpu, &host);
      EXPECT_TRUE(gpu == host);
    }
  }
}

TEST_P(NcclCollectiveTest, BroadcastMatchesTheHostBitForBitInEveryDType) {
  for (DType dtype : {DType::kFP32, DType::kBF16, DType::kFP16}) {
    for (int root = 0; root < k(); ++root) {
      SCOPED_TRACE(absl::StrCat(DTypeName(dtype), " root ", root));
      constexpr int64_t kCount = 65537;
      const Bytes input = RandomBytes(rng_, k(), kCount * DTypeSize(dtype));
      const Call call = [dtype, root](Collective& c, std::span<void* const> b,
                                      std::span<Stream* const> s) {
        return c.Broadcast(b, kCount, dtype, root, s);
      };
      Bytes gpu, host;
      RunBoth(input, call, &gpu, &host);
      EXPECT_TRUE(gpu == host);
    }
  }
}

TEST_P(NcclCollectiveTest, ConcurrentCallersOnTheirOwnStreamsAllComplete) {
  // Small integers: every sum is exact in any order, so each round's result is known exactly.
  constexpr int kThreads = 2;
  constexpr int kRounds = 5;
  constexpr int64_t kCount = 4099;
  for (int t = 1; t < kThreads; ++t) ASSERT_TRUE(gpus_.AddStreams().ok());
  std::vector<Bytes> inputs;
  std::vector<std::vector<DeviceBuffer>> buffers;
  std::uniform_int_distribution<int> small(-8, 8);
  for (int t = 0; t < kThreads; ++t) {
    Bytes input;
    for (int r = 0; r < k(); ++r) {
      std::vector<float> values(kCount);
      for (float& v : values) v = static_cast<float>(small(rng_));
      input.push_back(AsBytes(values));
    }
    inputs.push_back(input);
    buffers.push_back(gpus_.Upload(input, t));
  }
  std::vector<absl::Status> statuses(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([this, t, &buffers, &statuses] {
      std::vector<void*> pointers;
      for (DeviceBuffer& b : buffers[t]) pointers.push_back(b.data());
      for (int round = 0; round < kRounds && statuses[t].ok(); ++round) {
        statuses[t] = gpus_.collective().AllReduce(pointers, kCount, DType::kFP32, ReduceOp::kSum,
                                                   gpus_.streams(t));
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (int t = 0; t < kThreads; ++t) {
    ASSERT_TRUE(statuses[t].ok()) << statuses[t];
    const Bytes got = gpus_.Download(buffers[t], t);
    // Round 1 gives every rank the sum S; each further round multiplies it by k.
    const double growth = std::pow(k(), kRounds - 1);
    for (int64_t j = 0; j < kCount; ++j) {
      double sum = 0;
      for (int r = 0; r < k(); ++r) sum += FloatAt(inputs[t][r], j);
      for (int r = 0; r < k(); ++r) {
        ASSERT_EQ(FloatAt(got[r], j), sum * growth) << "thread " << t << " rank " << r;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Gpus, NcclCollectiveTest, ::testing::Values(2, 3, 4),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return absl::StrCat(info.param, "Gpus");
                         });

// INVALID_ARGUMENT with a message that names `text`.
void ExpectInvalid(const absl::Status& status, const std::string& text) {
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_NE(status.message().find(text), std::string::npos) << status;
}

TEST(NcclCollectiveErrorsTest, OtherDevicesStreamsAndMemoryHostMemoryAndCpuStreams) {
  SKIP_WITHOUT_GPUS(2);
  Ranks gpus;
  const absl::Status init = gpus.Init(2, /*cuda=*/true);
  if (init.code() == absl::StatusCode::kUnimplemented) {
    GTEST_SKIP() << "this build has no NCCL: " << init;
  }
  ASSERT_TRUE(init.ok()) << init;
  std::mt19937_64 rng(99);
  const int64_t count = 1000;
  const Bytes input = RandomFloats(rng, 2, count);
  std::vector<DeviceBuffer> buffers = gpus.Upload(input);
  std::vector<void*> pointers = {buffers[0].data(), buffers[1].data()};
  Collective& c = gpus.collective();
  auto all_reduce = [&](std::vector<void*> b, std::vector<Stream*> s) {
    return c.AllReduce(b, count, DType::kFP32, ReduceOp::kSum, s);
  };

  std::vector<Stream*> swapped = {gpus.streams()[1], gpus.streams()[0]};
  ExpectInvalid(all_reduce(pointers, swapped),
                "AllReduce: stream of rank 0 is on device 1, rank 0 is device 0");
  ExpectInvalid(all_reduce({pointers[1], pointers[0]}, gpus.streams()),
                "AllReduce: buffer of rank 0 is not memory of device 0");
  std::vector<float> host_memory(count);
  ExpectInvalid(all_reduce({pointers[0], host_memory.data()}, gpus.streams()),
                "AllReduce: buffer of rank 1 is not memory of device 1");
  std::unique_ptr<Backend> cpu = CreateCpuBackend(1);
  std::unique_ptr<Stream> cpu_stream = *cpu->CreateStream();
  ExpectInvalid(all_reduce(pointers, {gpus.streams()[0], cpu_stream.get()}),
                "AllReduce: stream of rank 1 is not a CUDA stream");
  std::vector<int64_t> counts = {500, 500};
  ExpectInvalid(c.AllGather(pointers, counts, DType::kFP32, swapped),
                "AllGather: stream of rank 0 is on device 1");
  ExpectInvalid(c.Broadcast(std::vector<void*>{pointers[0], host_memory.data()}, count,
                            DType::kFP32, 0, gpus.streams()),
                "Broadcast: buffer of rank 1 is not memory of device 1");

  // Refused calls touched nothing and left the communicators working.
  EXPECT_TRUE(gpus.Download(buffers) == input);
  ASSERT_TRUE(all_reduce(pointers, gpus.streams()).ok());
  gpus.Synchronize();

  // One device twice among others is refused before NCCL sees it (all ranks on one device get
  // the staged collective instead).
  std::vector<Backend*> twice = {&gpus.backend(0), &gpus.backend(1), &gpus.backend(0)};
  ExpectInvalid(CreateCollective(twice).status(), "device 0 appears twice (rank 2)");
}

}  // namespace
}  // namespace losshead::kernels
