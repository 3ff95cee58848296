#include "tests/service/host_tensors.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>

#include "absl/strings/str_cat.h"
#include "losshead/kernels/dtype_convert.h"
#include "losshead/v1/wire_dtype.h"

namespace losshead::testing {
namespace {

kernels::DType KernelDType(v1::DType dtype) {
  switch (dtype) {
    case v1::DTYPE_BF16:
      return kernels::DType::kBF16;
    case v1::DTYPE_FP16:
      return kernels::DType::kFP16;
    default:
      return kernels::DType::kFP32;
  }
}

}  // namespace

std::vector<float> RandomValues(size_t count, double std, v1::DType dtype, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, static_cast<float>(std));
  std::vector<float> values(count);
  for (float& x : values) x = normal(rng);
  return Decode(Encode(values, dtype), dtype);
}

client::Bytes Encode(const std::vector<float>& values, v1::DType dtype) {
  client::Bytes out(values.size() * v1::WireDTypeSize(dtype));
  kernels::FromFloat(KernelDType(dtype), values.data(), out.data(), values.size());
  return out;
}

std::vector<float> Decode(const client::Bytes& bytes, v1::DType dtype) {
  std::vector<float> out(bytes.size() / v1::WireDTypeSize(dtype));
  kernels::ToFloat(KernelDType(dtype), bytes.data(), out.data(), out.size());
  return out;
}

void SetTargets(HostBatch& batch, std::vector<int64_t> targets) {
  batch.targets = std::move(targets);
  const size_t size = v1::WireDTypeSize(batch.target_dtype);
  batch.target_bytes.resize(batch.targets.size() * size);
  for (size_t i = 0; i < batch.targets.size(); ++i) {
    if (batch.target_dtype == v1::DTYPE_INT64) {
      std::memcpy(batch.target_bytes.data() + i * size, &batch.targets[i], size);
    } else {
      const int32_t t = static_cast<int32_t>(batch.targets[i]);
      std::memcpy(batch.target_bytes.data() + i * size, &t, size);
    }
  }
}

HostBatch MakeBatch(int64_t n, int64_t d, int64_t v, v1::DType dtype, uint64_t seed,
                    int ignore_every, int64_t ignore_index, v1::DType target_dtype) {
  HostBatch b;
  b.n = n;
  b.dtype = dtype;
  b.target_dtype = target_dtype;
  b.hidden = RandomValues(static_cast<size_t>(n * d), 1.0, dtype, seed);
  b.hidden_bytes = Encode(b.hidden, dtype);
  std::mt19937_64 rng(seed ^ 0x9e3779b97f4a7c15ull);
  std::uniform_int_distribution<int64_t> pick(0, v - 1);
  std::vector<int64_t> targets(n);
  for (int64_t i = 0; i < n; ++i) {
    targets[i] =
        (ignore_every > 0 && i % ignore_every == ignore_every - 1) ? ignore_index : pick(rng);
  }
  SetTargets(b, std::move(targets));
  return b;
}

client::Microbatch ToMicrobatch(const std::string& head, const std::string& client_id,
                                uint64_t sequence, const HostBatch& batch) {
  client::Microbatch mb;
  mb.head = head;
  mb.client_id = client_id;
  mb.sequence = sequence;
  mb.num_tokens = batch.n;
  mb.hidden_dtype = batch.dtype;
  mb.hidden = batch.hidden_bytes;
  mb.target_dtype = batch.target_dtype;
  mb.targets = batch.target_bytes;
  return mb;
}

Tolerance ToleranceFor(v1::DType dtype) {
  switch (dtype) {
    case v1::DTYPE_FP32:
      return {.loss_rel = 1e-5, .grad = 1e-4};
    default:  // bf16 / fp16 outputs carry 8 / 11 significant bits
      return {.loss_rel = 1e-4, .grad = 1e-2};
  }
}

::testing::AssertionResult AllClose(const std::vector<float>& got, const std::vector<double>& want,
                                    double tol) {
  if (got.size() != want.size()) {
    return ::testing::AssertionFailure()
           << "size " << got.size() << " != reference size " << want.size();
  }
  double scale = 0;
  for (double w : want) scale = std::max(scale, std::fabs(w));
  const double bound = tol * std::max(scale, 1e-6);
  size_t bad = 0, first = 0;
  double worst = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::fabs(static_cast<double>(got[i]) - want[i]);
    if (!(err <= bound)) {  // NaN fails too
      if (bad++ == 0) first = i;
      worst = std::max(worst, err);
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << bad << " of " << got.size() << " elements off by more than " << bound << " (max |ref| "
         << scale << "); first at " << first << ": got " << got[first] << ", want " << want[first]
         << "; worst error " << worst;
}

}  // namespace losshead::testing
