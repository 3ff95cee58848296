// losshead_kernel_bench's check: a fused call on a few tokens against a float64 host reference.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <thread>
#include <vector>

#include "kernels/bench/kernel_bench.h"

namespace losshead::bench {
namespace {

template <typename Fn>
void ParallelFor(int64_t count, Fn fn) {
  const int threads = std::max(1u, std::thread::hardware_concurrency());
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      for (int64_t i = t; i < count; i += threads) fn(i);
    });
  }
  for (auto& th : pool) th.join();
}

// `count` elements of `dtype` in device memory, widened to fp32 on the host (exact for bf16 and
// fp32 alike, so the reference sees the very values the device holds).
std::vector<float> CopyToHostAsFloat(Backend& backend, kernels::Stream& stream, DType dtype,
                                     const void* src, int64_t count) {
  std::vector<std::byte> raw(count * kernels::DTypeSize(dtype));
  BENCH_OK(backend.CopyToHost(raw.data(), src, raw.size(), stream));
  BENCH_OK(stream.Synchronize());
  std::vector<float> out(count);
  kernels::ToFloat(dtype, raw.data(), out.data(), count);
  return out;
}

}  // namespace

CheckResult Check(Backend& backend, kernels::Stream& stream, const Shape& s,
                  const Numerics& numerics, const void* hidden, const void* weight,
                  const int32_t* targets, int64_t m) {
  DeviceBuffer dh = Unwrap(backend.Allocate(m * s.d * numerics.bytes()), "alloc");
  DeviceBuffer dw = Unwrap(backend.Allocate(s.v * s.d * 4), "alloc");
  BENCH_OK(backend.Memset(dw.data(), 0, s.v * s.d * 4, stream));
  const FusedCall call = MakeFusedCall(backend, m, s, numerics, size_t{1} << 30, hidden, weight,
                                       targets, dh.data(), dw.as<float>());
  BENCH_OK(backend.Run(call.problem, call.args, stream));

  const std::vector<float> h = CopyToHostAsFloat(backend, stream, numerics.dtype, hidden, m * s.d);
  const std::vector<float> w =
      CopyToHostAsFloat(backend, stream, numerics.dtype, weight, s.v * s.d);
  const std::vector<float> dh_got =
      CopyToHostAsFloat(backend, stream, numerics.dtype, dh.data(), m * s.d);
  std::vector<int32_t> y(m);
  float loss_got = 0;
  BENCH_OK(backend.CopyToHost(y.data(), targets, m * 4, stream));
  BENCH_OK(backend.CopyToHost(&loss_got, call.loss.data(), 4, stream));
  BENCH_OK(stream.Synchronize());
  std::vector<int64_t> rows;
  for (int64_t r = 0; r < m; ++r) rows.push_back(y[r]);
  for (int64_t j = 0; j < 56; ++j) rows.push_back((j * 7919 + 13) % s.v);
  std::vector<float> dw_got(rows.size() * s.d);
  for (size_t i = 0; i < rows.size(); ++i) {
    BENCH_OK(backend.CopyToHost(dw_got.data() + i * s.d, dw.as<float>() + rows[i] * s.d, s.d * 4,
                                stream));
  }
  BENCH_OK(stream.Synchronize());

  const std::vector<double> hf(h.begin(), h.end());
  std::vector<double> logits(m * s.v);
  ParallelFor(s.v, [&](int64_t j) {
    double wj[8192 * 2];
    for (int64_t k = 0; k < s.d; ++k) wj[k] = w[j * s.d + k];
    for (int64_t r = 0; r < m; ++r) {
      double acc = 0;
      for (int64_t k = 0; k < s.d; ++k) acc += hf[r * s.d + k] * wj[k];
      logits[r * s.v + j] = acc;
    }
  });
  // g = (softmax - onehot) / m, in place over the logits.
  double loss_ref = 0;
  for (int64_t r = 0; r < m; ++r) {
    double* x = &logits[r * s.v];
    const double mx = *std::max_element(x, x + s.v);
    double sum = 0;
    for (int64_t j = 0; j < s.v; ++j) sum += std::exp(x[j] - mx);
    const double lse = mx + std::log(sum);
    loss_ref += lse - x[y[r]];
    for (int64_t j = 0; j < s.v; ++j) x[j] = (std::exp(x[j] - lse) - (j == y[r] ? 1 : 0)) / m;
  }
  std::vector<double> dh_ref(m * s.d, 0.0);
  const int64_t kBlock = 64;
  ParallelFor((s.d + kBlock - 1) / kBlock, [&](int64_t b) {
    const int64_t k0 = b * kBlock, k1 = std::min(s.d, k0 + kBlock);
    for (int64_t j = 0; j < s.v; ++j) {
      for (int64_t k = k0; k < k1; ++k) {
        const double wv = w[j * s.d + k];
        for (int64_t r = 0; r < m; ++r) dh_ref[r * s.d + k] += logits[r * s.v + j] * wv;
      }
    }
  });
  double num = 0, den = 0;
  for (int64_t i = 0; i < m * s.d; ++i) {
    const double diff = dh_got[i] - dh_ref[i];
    num += diff * diff;
    den += dh_ref[i] * dh_ref[i];
  }
  CheckResult res;
  res.dh_err = std::sqrt(num / den);
  num = den = 0;
  for (size_t i = 0; i < rows.size(); ++i) {
    for (int64_t k = 0; k < s.d; ++k) {
      double ref = 0;
      for (int64_t r = 0; r < m; ++r) ref += logits[r * s.v + rows[i]] * hf[r * s.d + k];
      const double diff = dw_got[i * s.d + k] - ref;
      num += diff * diff;
      den += ref * ref;
    }
  }
  res.dw_err = std::sqrt(num / den);
  res.loss_err = std::abs(loss_got - loss_ref) / std::abs(loss_ref);
  return res;
}

}  // namespace losshead::bench
