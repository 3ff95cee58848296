#include "tests/kernels/process_sequence.h"

#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <random>

#include "absl/strings/str_cat.h"
#include "tests/kernels/slices.h"

namespace losshead::testing {
namespace {

using kernels::DType;
using kernels::ReduceOp;

struct Call {
  enum Kind { kAllReduce, kReduceScatter, kAllGather, kBroadcast } kind;
  DType dtype = DType::kFP32;
  ReduceOp op = ReduceOp::kSum;
  int64_t count = 0;      // AllReduce, Broadcast
  int root_from_end = 0;  // Broadcast: root k - 1 - root_from_end, clamped at 0
  int layout = 0;         // ReduceScatter, AllGather: 0 ShardCounts(1001, k, 3), 1 with an empty
                          // slice, 2 ShardCounts(2, k) (some ranks own nothing)
};

const std::vector<Call>& Calls() {
  static const std::vector<Call>* const calls = new std::vector<Call>{
      {Call::kAllReduce, DType::kFP32, ReduceOp::kSum, 1001},
      {Call::kAllReduce, DType::kFP32, ReduceOp::kMax, 517},
      {Call::kAllReduce, DType::kFP32, ReduceOp::kSum, 1},       // fewer elements than processes
      {Call::kAllReduce, DType::kFP32, ReduceOp::kSum, 300000},  // more than a socket buffer
      {Call::kReduceScatter, DType::kFP32, ReduceOp::kSum, 0, 0, 0},
      {Call::kReduceScatter, DType::kFP32, ReduceOp::kSum, 0, 0, 1},
      {Call::kReduceScatter, DType::kFP32, ReduceOp::kSum, 0, 0, 2},
      {Call::kAllGather, DType::kFP32, ReduceOp::kSum, 0, 0, 0},
      {Call::kAllGather, DType::kBF16, ReduceOp::kSum, 0, 0, 1},
      {Call::kAllGather, DType::kFP16, ReduceOp::kSum, 0, 0, 2},
      {Call::kAllGather, DType::kBF16, ReduceOp::kSum, 0, 0, 0},
      {Call::kBroadcast, DType::kFP32, ReduceOp::kSum, 517, 0},
      {Call::kBroadcast, DType::kBF16, ReduceOp::kSum, 333, 1},
      {Call::kBroadcast, DType::kFP16, ReduceOp::kSum, 1001, 2},
      {Call::kBroadcast, DType::kFP32, ReduceOp::kSum, 65, 3},
  };
  return *calls;
}

std::vector<int64_t> Layout(int layout, int k) {
  if (layout == 0) return kernels::ShardCounts(1001, k, 3);
  if (layout == 2) return kernels::ShardCounts(2, k);
  std::vector<int64_t> counts(k, 9);
  counts[0] = 5;
  counts[k > 1 ? 1 : 0] = 0;
  return counts;
}

// Rank g's input to call `index`: floats over a wide range of magnitudes (so that sums round) for
// reductions, any bytes for copies.
std::vector<std::byte> Input(uint64_t seed, int index, int g, const Call& call, size_t elements) {
  std::mt19937_64 rng(seed * 1000003u + static_cast<uint64_t>(index) * 1009u +
                      static_cast<uint64_t>(g));
  std::vector<std::byte> bytes(elements * kernels::DTypeSize(call.dtype));
  if (call.kind == Call::kAllReduce || call.kind == Call::kReduceScatter) {
    std::uniform_real_distribution<float> mantissa(-1.0f, 1.0f);
    std::uniform_int_distribution<int> exponent(-12, 12);
    for (size_t j = 0; j < elements; ++j) {
      float v = std::ldexp(mantissa(rng), exponent(rng));
      if (call.op == ReduceOp::kMax && j == 7 && g == 1)
        v = std::numeric_limits<float>::quiet_NaN();
      std::memcpy(bytes.data() + j * sizeof(float), &v, sizeof(float));
    }
    return bytes;
  }
  std::uniform_int_distribution<int> byte(0, 255);
  for (std::byte& b : bytes) b = static_cast<std::byte>(byte(rng));
  return bytes;
}

}  // namespace

int SequenceLength() { return static_cast<int>(Calls().size()); }

namespace {

size_t Elements(const Call& call, int k) {
  return static_cast<size_t>(call.kind == Call::kReduceScatter || call.kind == Call::kAllGather
                                 ? Total(Layout(call.layout, k))
                                 : call.count);
}

}  // namespace

bool SequenceCallSums(int index) {
  const Call& call = Calls()[index];
  return call.kind == Call::kReduceScatter ||
         (call.kind == Call::kAllReduce && call.op == ReduceOp::kSum);
}

bool SequenceCallTakesMax(int index) {
  return Calls()[index].kind == Call::kAllReduce && Calls()[index].op == ReduceOp::kMax;
}

std::vector<double> SequenceAbsSums(uint64_t seed, int index, int k) {
  const Call& call = Calls()[index];
  const size_t elements = Elements(call, k);
  std::vector<double> sums(elements, 0.0);
  for (int g = 0; g < k; ++g) {
    const std::vector<std::byte> input = Input(seed, index, g, call, elements);
    for (size_t j = 0; j < elements; ++j) {
      float x;
      std::memcpy(&x, input.data() + j * sizeof(float), sizeof(float));
      sums[j] += std::fabs(static_cast<double>(x));
    }
  }
  return sums;
}

void RunSequenceCall(kernels::Collective& collective, std::vector<kernels::Stream*>& streams,
                     uint64_t seed, int index, SequenceResults* results,
                     const std::vector<kernels::Backend*>& devices) {
  const Call& call = Calls()[index];
  const int k = collective.size();
  const std::vector<int64_t> counts = Layout(call.layout, k);
  const size_t elements = Elements(call, k);
  std::vector<std::vector<std::byte>> data;
  std::vector<void*> buffers;
  for (int i = 0; i < collective.local_size(); ++i) {
    data.push_back(Input(seed, index, collective.first_rank() + i, call, elements));
  }
  std::vector<kernels::DeviceBuffer> staged;
  absl::Status status;
  for (size_t i = 0; i < data.size(); ++i) {
    if (devices.empty()) {
      buffers.push_back(data[i].data());
      continue;
    }
    absl::StatusOr<kernels::DeviceBuffer> buffer = devices[i]->Allocate(data[i].size());
    if (!buffer.ok()) {
      status.Update(buffer.status());
      break;
    }
    status.Update(
        devices[i]->CopyToDevice(buffer->data(), data[i].data(), data[i].size(), *streams[i]));
    buffers.push_back(buffer->data());
    staged.push_back(std::move(*buffer));
  }
  if (!status.ok()) {
    (*results)[index].code = static_cast<int>(status.code());
    return;
  }
  switch (call.kind) {
    case Call::kAllReduce:
      status = collective.AllReduce(buffers, call.count, call.dtype, call.op, streams);
      break;
    case Call::kReduceScatter:
      status = collective.ReduceScatter(buffers, counts, call.dtype, streams);
      break;
    case Call::kAllGather:
      status = collective.AllGather(buffers, counts, call.dtype, streams);
      break;
    case Call::kBroadcast:
      status = collective.Broadcast(buffers, call.count, call.dtype,
                                    std::max(0, k - 1 - call.root_from_end), streams);
      break;
  }
  for (size_t i = 0; i < staged.size() && status.ok(); ++i) {
    status.Update(
        devices[i]->CopyToHost(data[i].data(), staged[i].data(), data[i].size(), *streams[i]));
    status.Update(streams[i]->Synchronize());
  }
  CallResult& result = (*results)[index];
  result.code = static_cast<int>(status.code());
  for (int i = 0; i < collective.local_size(); ++i) {
    result.ranks[collective.first_rank() + i] = std::move(data[i]);
  }
}

SequenceResults RunSequence(kernels::Collective& collective, std::vector<kernels::Stream*>& streams,
                            uint64_t seed, const std::vector<kernels::Backend*>& devices) {
  SequenceResults results;
  for (int i = 0; i < SequenceLength(); ++i) {
    RunSequenceCall(collective, streams, seed, i, &results, devices);
  }
  return results;
}

namespace {

template <typename T>
void Put(std::ofstream& out, T value) {
  out.write(reinterpret_cast<const char*>(&value), sizeof(value));
}

template <typename T>
bool Get(std::ifstream& in, T* value) {
  return static_cast<bool>(in.read(reinterpret_cast<char*>(value), sizeof(*value)));
}

}  // namespace

absl::Status WriteResults(const std::string& path, const SequenceResults& results) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  for (const auto& [index, result] : results) {
    Put<int32_t>(out, index);
    Put<int32_t>(out, result.code);
    Put<int32_t>(out, static_cast<int32_t>(result.ranks.size()));
    for (const auto& [rank, bytes] : result.ranks) {
      Put<int32_t>(out, rank);
      Put<uint64_t>(out, bytes.size());
      out.write(reinterpret_cast<const char*>(bytes.data()),
                static_cast<std::streamsize>(bytes.size()));
    }
  }
  out.close();
  if (!out) return absl::InternalError(absl::StrCat("cannot write ", path));
  return absl::OkStatus();
}

absl::StatusOr<SequenceResults> ReadResults(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("no results at ", path));
  SequenceResults results;
  int32_t index = 0;
  while (Get(in, &index)) {
    CallResult& result = results[index];
    int32_t code = 0, ranks = 0;
    if (!Get(in, &code) || !Get(in, &ranks)) return absl::DataLossError("truncated results");
    result.code = code;
    for (int32_t i = 0; i < ranks; ++i) {
      int32_t rank = 0;
      uint64_t size = 0;
      if (!Get(in, &rank) || !Get(in, &size)) return absl::DataLossError("truncated results");
      std::vector<std::byte> bytes(size);
      if (!in.read(reinterpret_cast<char*>(bytes.data()), static_cast<std::streamsize>(size))) {
        return absl::DataLossError("truncated results");
      }
      result.ranks[rank] = std::move(bytes);
    }
  }
  return results;
}

}  // namespace losshead::testing
