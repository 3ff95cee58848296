// The shapes, tensors and fused call of losshead_kernel_bench, and its backend variants.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "kernels/bench/kernel_bench.h"

namespace losshead::bench {

Problem MakeProblem(int64_t n, const Shape& s, const Numerics& num) {
  Problem p;
  p.n = n;
  p.v = s.v;
  p.d = s.d;
  p.dtype = num.dtype;
  p.precision = num.precision;
  return p;
}

cudaError_t FillUniform(const Numerics& num, void* data, int64_t count, float scale,
                        uint64_t seed) {
  if (num.dtype == DType::kFP32) {
    return bench::FillUniformF32(static_cast<float*>(data), count, scale, seed, nullptr);
  }
  return bench::FillUniformBf16(static_cast<__nv_bfloat16*>(data), count, scale, seed, nullptr);
}

size_t FreeBytes() {
  size_t free_b = 0, total = 0;
  BENCH_CUDA(cudaMemGetInfo(&free_b, &total));
  return free_b;
}

FusedCall MakeFusedCall(Backend& backend, int64_t n, const Shape& s, const Numerics& num,
                        size_t budget, const void* hidden, const void* weight,
                        const int32_t* targets, void* grad_hidden, float* grad_weight) {
  FusedCall c;
  c.problem = MakeProblem(n, s, num);
  c.workspace_bytes = Unwrap(backend.WorkspaceBytes(c.problem, budget), "workspace");
  c.workspace = Unwrap(backend.Allocate(c.workspace_bytes), "alloc");
  c.loss = Unwrap(backend.Allocate(4), "alloc");
  c.count = Unwrap(backend.Allocate(8), "alloc");
  c.args.hidden = hidden;
  c.args.weight = weight;
  c.args.targets = targets;
  c.args.grad_hidden = grad_hidden;
  c.args.grad_weight = grad_weight;
  c.args.loss_sum = c.loss.as<float>();
  c.args.token_count = c.count.as<int64_t>();
  c.args.workspace = c.workspace.data();
  c.args.workspace_bytes = c.workspace_bytes;
  return c;
}

kernels::CudaBackendOptions ParseVariant(const std::string& variant) {
  kernels::CudaBackendOptions opt;
  size_t start = 0;
  while (start <= variant.size()) {
    size_t end = variant.find('+', start);
    if (end == std::string::npos) end = variant.size();
    const std::string t = variant.substr(start, end - start);
    if (t == "fp32logits") {
      opt.bf16_logits = false;
    } else if (t == "t1024") {
      opt.row_threads = 1024;
    } else if (t == "bal") {
      opt.balance_chunks = true;
    } else if (t == "nobal") {
      opt.balance_chunks = false;
    } else if (t == "ovl") {
      opt.overlap = true;
    } else if (t == "noovl") {
      opt.overlap = false;
    } else if (t == "sm90") {
      opt.sm90_logits_gemm = true;
    } else if (t == "nosm90") {
      opt.sm90_logits_gemm = false;
    } else if (t.rfind("rl", 0) == 0 || t.rfind("rh", 0) == 0 || t.rfind("rw", 0) == 0) {
      opt.gemm_ranks[t[1] == 'l' ? 0 : t[1] == 'h' ? 1 : 2] = std::atoi(t.c_str() + 2);
    } else if (t.rfind("ws", 0) == 0) {
      opt.cublas_workspace_bytes = size_t(std::atoll(t.c_str() + 2)) << 20;
    } else if (t.rfind("res", 0) == 0) {
      opt.handle_reserve_bytes = size_t(std::atoll(t.c_str() + 3)) << 20;
    } else if (t.rfind("bps", 0) == 0) {
      opt.row_blocks_per_sm = std::atoi(t.c_str() + 3);
    } else if (t != "default" && !t.empty()) {
      std::fprintf(stderr, "unknown variant token '%s'\n", t.c_str());
      std::exit(1);
    }
    start = end + 1;
  }
  return opt;
}

}  // namespace losshead::bench
