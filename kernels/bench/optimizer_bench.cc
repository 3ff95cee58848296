// Benchmark of the CUDA optimizer step and gradient norm over a V x D head (default 128256 x 4096,
// 525 M parameters) on random data.
//
// First the reference: torch.optim.AdamW(fused=True) on the same parameter count, timed by
// torch_optimizer_reference.py in a child process before this one allocates anything. Then, per
// configuration, a check (the step on two windows of the full buffers against the CPU backend,
// bit for bit; the norm against the CPU backend's) and the timing: CUDA events, warm-up, median
// of --runs, with dW refilled with random values outside the events before every step (the step
// zeroes it). Prints ms, GB/s of the bytes the step must move, the fraction of the measured copy
// bandwidth (speed of light) and the ratio to torch.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels/bench/bench_util.h"
#include "kernels/bench/random_fill.cuh"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "losshead/kernels/backend.h"
#include "losshead/kernels/optimizer.h"

namespace losshead {
namespace {

using bench::MedianMs;
using bench::Unwrap;
using kernels::Backend;
using kernels::DeviceBuffer;
using kernels::DType;
using kernels::OptimizerKind;
using kernels::OptimizerProblem;
using kernels::OptimizerTensors;

struct Flags {
  int64_t v = 128256;
  int64_t d = 4096;
  int runs = 50;
  std::string python = "python3";  // "none" skips the torch reference
  std::string torch_script = "kernels/bench/torch_optimizer_reference.py";
};

// Runs the torch reference and returns its fused AdamW median in ms (NaN when it cannot run).
double TorchAdamWMs(const Flags& f, int64_t count) {
  if (f.python == "none") return NAN;
  const std::string cmd = f.python + " " + f.torch_script + " --count=" + std::to_string(count) +
                          " --runs=" + std::to_string(f.runs) + " 2>&1";
  FILE* pipe = popen(cmd.c_str(), "r");
  if (pipe == nullptr) return NAN;
  double ms = NAN;
  char line[512];
  while (std::fgets(line, sizeof(line), pipe) != nullptr) {
    std::printf("torch> %s", line);
    std::sscanf(line, "torch_adamw_fused_ms %lf", &ms);
  }
  if (pclose(pipe) != 0) std::printf("torch reference failed: no ratio to torch\n");
  std::fflush(stdout);
  return ms;
}

// The head's buffers: weights (bf16 or fp32), fp32 master, dW and two state buffers.
struct HeadBuffers {
  HeadBuffers(Backend& backend, int64_t count) : count(count) {
    weight = Unwrap(backend.Allocate(count * 4), "alloc weight");
    master = Unwrap(backend.Allocate(count * 4), "alloc master");
    grad = Unwrap(backend.Allocate(count * 4), "alloc grad");
    state_a = Unwrap(backend.Allocate(count * 4), "alloc state");
    state_b = Unwrap(backend.Allocate(count * 4), "alloc state");
  }
  // Random weights, gradient and state (exp_avg_sq must be >= 0).
  void Fill() {
    BENCH_CUDA(bench::FillUniformF32(master.as<float>(), count, 0.05f, 11, nullptr));
    BENCH_CUDA(bench::FillUniformF32(weight.as<float>(), count, 0.05f, 12, nullptr));
    BENCH_CUDA(bench::FillUniformF32(state_a.as<float>(), count, 1e-3f, 13, nullptr));
    // exp_avg_sq is a running mean of squares: never negative.
    BENCH_CUDA(bench::FillUniformF32Between(state_b.as<float>(), count, 1e-8f, 1e-6f, 14, nullptr));
    BENCH_CUDA(bench::FillUniformF32(grad.as<float>(), count, 30.0f, 15, nullptr));
    BENCH_CUDA(cudaDeviceSynchronize());
  }
  OptimizerTensors Tensors(const OptimizerProblem& p) const {
    OptimizerTensors t;
    t.weight = weight.data();
    t.master = p.dtype == DType::kFP32 ? nullptr : master.as<float>();
    t.grad = grad.as<float>();
    if (kernels::KindOf(p.options) == OptimizerKind::kSgd) {
      t.momentum_buffer = state_a.as<float>();
    } else {
      t.exp_avg = state_a.as<float>();
    }
    if (kernels::KindOf(p.options) == OptimizerKind::kAdamW) t.exp_avg_sq = state_b.as<float>();
    return t;
  }

  int64_t count;
  DeviceBuffer weight, master, grad, state_a, state_b;
};

// Bytes one step must read and write per element: dW read and zeroed, the fp32 parameters and
// the state read and written, and the rounded weights written.
double BytesPerElement(const OptimizerProblem& p) {
  const int states = kernels::KindOf(p.options) == OptimizerKind::kAdamW ? 2 : 1;
  const double weights = p.dtype == DType::kFP32 ? 0.0 : 2.0;
  return 4 + 4 + 8 + 8.0 * states + weights;
}

// Bytes the step's check (Backend::CheckOptimizerStep) reads per element: dW, the fp32
// parameters and the state, each once; it writes nothing but its result.
double CheckBytesPerElement(const OptimizerProblem& p) {
  const int states = kernels::KindOf(p.options) == OptimizerKind::kAdamW ? 2 : 1;
  return 4 + 4 + 4.0 * states;
}

// One step of `p` on a window [begin, begin + n) of the device buffers against the CPU backend
// on copies of the same window: true when every output bit agrees.
bool CheckWindow(Backend& cuda, kernels::Stream& stream, HeadBuffers& b, OptimizerProblem p,
                 int64_t begin, int64_t n) {
  const size_t el = kernels::DTypeSize(p.dtype);
  std::vector<float> master(n), grad(n), a(n), s(n);
  std::vector<uint8_t> weight(n * el);
  const OptimizerTensors full = b.Tensors(p);
  auto copy_in = [&](void* host, const void* dev, size_t elem) {
    if (dev == nullptr) return;
    BENCH_OK(cuda.CopyToHost(host, static_cast<const char*>(dev) + begin * elem, n * elem, stream));
  };
  copy_in(weight.data(), full.weight, el);
  copy_in(master.data(), full.master, 4);
  copy_in(grad.data(), full.grad, 4);
  copy_in(a.data(), full.exp_avg != nullptr ? full.exp_avg : full.momentum_buffer, 4);
  copy_in(s.data(), full.exp_avg_sq, 4);
  BENCH_OK(stream.Synchronize());

  p.count = n;
  OptimizerTensors host;
  host.weight = weight.data();
  host.master = full.master != nullptr ? master.data() : nullptr;
  host.grad = grad.data();
  (full.exp_avg != nullptr ? host.exp_avg : host.momentum_buffer) = a.data();
  host.exp_avg_sq = full.exp_avg_sq != nullptr ? s.data() : nullptr;
  std::unique_ptr<Backend> cpu = kernels::CreateCpuBackend();
  std::unique_ptr<kernels::Stream> cpu_stream = Unwrap(cpu->CreateStream(), "cpu stream");
  BENCH_OK(cpu->OptimizerStep(p, host, *cpu_stream));

  OptimizerTensors window = full;
  auto shift = [&](auto* ptr, size_t elem) {
    using T = std::remove_pointer_t<decltype(ptr)>;
    return ptr == nullptr ? nullptr
                          : reinterpret_cast<T*>(reinterpret_cast<char*>(ptr) + begin * elem);
  };
  window.weight = shift(static_cast<char*>(full.weight), el);
  window.master = shift(full.master, 4);
  window.grad = shift(full.grad, 4);
  window.exp_avg = shift(full.exp_avg, 4);
  window.exp_avg_sq = shift(full.exp_avg_sq, 4);
  window.momentum_buffer = shift(full.momentum_buffer, 4);
  BENCH_OK(cuda.OptimizerStep(p, window, stream));
  bool same = true;
  auto compare = [&](const void* host_data, const void* dev, size_t elem) {
    if (dev == nullptr) return;
    std::vector<uint8_t> got(n * elem);
    BENCH_OK(cuda.CopyToHost(got.data(), dev, n * elem, stream));
    BENCH_OK(stream.Synchronize());
    same &= std::memcmp(got.data(), host_data, n * elem) == 0;
  };
  compare(weight.data(), window.weight, el);
  compare(master.data(), window.master, 4);
  compare(grad.data(), window.grad, 4);
  compare(a.data(), window.exp_avg != nullptr ? window.exp_avg : window.momentum_buffer, 4);
  compare(s.data(), window.exp_avg_sq, 4);
  return same;
}

struct Row {
  std::string name;
  OptimizerProblem problem;
};

int Main(int argc, char** argv) {
  Flags f;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--v=", 0) == 0) f.v = std::atoll(a.c_str() + 4);
    if (a.rfind("--d=", 0) == 0) f.d = std::atoll(a.c_str() + 4);
    if (a.rfind("--runs=", 0) == 0) f.runs = std::max(1, std::atoi(a.c_str() + 7));
    if (a.rfind("--python=", 0) == 0) f.python = a.substr(9);
    if (a.rfind("--torch_script=", 0) == 0) f.torch_script = a.substr(15);
  }
  if (kernels::CudaDeviceCount() == 0) {
    std::fprintf(stderr, "no CUDA device\n");
    return 1;
  }
  const int64_t count = f.v * f.d;
  const double torch_ms = TorchAdamWMs(f, count);

  cudaDeviceProp prop;
  BENCH_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s; V=%lld D=%lld (%lld parameters); median of %d\n", prop.name,
              (long long)f.v, (long long)f.d, (long long)count, f.runs);
  std::unique_ptr<Backend> cuda = Unwrap(kernels::CreateCudaBackend(0), "backend");
  std::unique_ptr<kernels::Stream> stream = Unwrap(cuda->CreateStream(), "stream");
  const auto cs = static_cast<cudaStream_t>(stream->native());
  HeadBuffers b(*cuda, count);
  b.Fill();

  // Speed of light: the copy bandwidth of this device, measured on the same buffers.
  const float copy_ms = MedianMs(cs, 3, f.runs, [&] {
    BENCH_CUDA(cudaMemcpyAsync(b.state_b.data(), b.state_a.data(), count * 4,
                               cudaMemcpyDeviceToDevice, cs));
  });
  const double copy_gbs = 2.0 * count * 4 / copy_ms / 1e6;
  b.Fill();
  std::printf("device-to-device copy: %.3f ms for %.2f GB read + written: %.0f GB/s\n", copy_ms,
              2.0 * count * 4 / 1e9, copy_gbs);

  // The norm: checked against the CPU backend over the whole buffer, then timed.
  DeviceBuffer norm = Unwrap(cuda->Allocate(sizeof(double)), "alloc");
  BENCH_OK(cuda->SquaredNorm(b.grad.as<float>(), count, norm.as<double>(), *stream));
  double got_norm = 0;
  BENCH_OK(cuda->CopyToHost(&got_norm, norm.data(), sizeof(double), *stream));
  std::vector<float> grad_host(count);
  BENCH_OK(cuda->CopyToHost(grad_host.data(), b.grad.data(), count * 4, *stream));
  BENCH_OK(stream->Synchronize());
  std::unique_ptr<Backend> cpu = kernels::CreateCpuBackend();
  std::unique_ptr<kernels::Stream> cpu_stream = Unwrap(cpu->CreateStream(), "cpu stream");
  double want_norm = 0;
  BENCH_OK(cpu->SquaredNorm(grad_host.data(), count, &want_norm, *cpu_stream));
  grad_host = {};
  const double norm_err = std::abs(got_norm - want_norm) / want_norm;
  bool all_ok = norm_err < 1e-12;
  const float norm_ms = MedianMs(cs, 3, f.runs, [&] {
    BENCH_OK(cuda->SquaredNorm(b.grad.as<float>(), count, norm.as<double>(), *stream));
  });
  std::printf("squared norm: %.3f ms, %.0f GB/s (%.2f of copy), rel err vs cpu %.1e %s\n", norm_ms,
              count * 4 / norm_ms / 1e6, count * 4 / norm_ms / 1e6 / copy_gbs, norm_err,
              norm_err < 1e-12 ? "ok" : "FAIL");

  std::vector<Row> rows;
  auto add = [&](std::string name, DType dtype, kernels::OptimizerOptions options) {
    OptimizerProblem p;
    p.count = count;
    p.dtype = dtype;
    p.options = options;
    p.grad_scale = 1.0f / 65536;
    p.step = 10;
    rows.push_back({std::move(name), p});
  };
  add("adamw bf16 W + fp32 master", DType::kBF16, kernels::AdamWOptions{});
  add("adamw fp32 W", DType::kFP32, kernels::AdamWOptions{});
  add("sgd momentum bf16 W", DType::kBF16, kernels::SgdOptions{.lr = 1e-2f, .momentum = 0.9f});
  add("lion bf16 W", DType::kBF16, kernels::LionOptions{});

  // The check that an apply runs where the bound of the head's magnitudes cannot rule out an
  // overflow: timed beside each step, as a share of it.
  DeviceBuffer check = Unwrap(cuda->Allocate(sizeof(kernels::OptimizerCheck)), "alloc");
  std::printf(
      "\n| step | ms | GB/s | of copy | torch fused AdamW ms | ratio to torch | check | "
      "range check ms | its GB/s | of the step |\n"
      "|---|---|---|---|---|---|---|---|---|---|\n");
  uint64_t seed = 100;
  for (const Row& row : rows) {
    b.Fill();
    const bool ok =
        CheckWindow(*cuda, *stream, b, row.problem, 0, 1 << 20) &&
        CheckWindow(*cuda, *stream, b, row.problem, count - (1 << 20) - 3, (1 << 20) + 3);
    all_ok &= ok;
    const OptimizerTensors t = b.Tensors(row.problem);
    const float ms = MedianMs(
        cs, 3, f.runs, [&] { BENCH_OK(cuda->OptimizerStep(row.problem, t, *stream)); },
        [&] { BENCH_CUDA(bench::FillUniformF32(t.grad, count, 30.0f, ++seed, cs)); });
    const double gbs = BytesPerElement(row.problem) * count / ms / 1e6;
    const float check_ms = MedianMs(cs, 3, f.runs, [&] {
      BENCH_OK(
          cuda->CheckOptimizerStep(row.problem, t, check.as<kernels::OptimizerCheck>(), *stream));
    });
    std::printf("| %s | %.3f | %.0f | %.2f | %.3f | %.3f | %s | %.3f | %.0f | %.2f |\n",
                row.name.c_str(), ms, gbs, gbs / copy_gbs, torch_ms, ms / torch_ms,
                ok ? "ok" : "FAIL", check_ms,
                CheckBytesPerElement(row.problem) * count / check_ms / 1e6, check_ms / ms);
    std::fflush(stdout);
  }
  return all_ok ? 0 : 2;
}

}  // namespace
}  // namespace losshead

int main(int argc, char** argv) { return losshead::Main(argc, argv); }
