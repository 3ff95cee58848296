// losshead_kernel_bench's command line (see kernel_bench.cc's file comment for the flags).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "kernels/bench/kernel_bench.h"

namespace losshead::bench {

bool ParseOutputs(const std::string& value, BenchOutputs* outputs) {
  *outputs = BenchOutputs{};
  outputs->label = value;
  size_t start = 0;
  while (start < value.size()) {
    size_t end = value.find_first_of(",+", start);
    if (end == std::string::npos) end = value.size();
    const std::string name = value.substr(start, end - start);
    start = end + 1;
    if (name.empty()) continue;
    if (name == "logprob") {
      outputs->logprob = true;
    } else if (name == "entropy") {
      outputs->entropy = true;
    } else if (name == "argmax") {
      outputs->argmax = true;
    } else if (name == "correct") {
      outputs->correct_count = true;
    } else if (name.rfind("topk:", 0) == 0) {
      outputs->top_k = std::atoi(name.c_str() + 5);
      if (outputs->top_k < 1 || outputs->top_k > kernels::kMaxTopK) {
        std::fprintf(stderr, "--outputs: topk:K needs K in [1, %d], got '%s'\n", kernels::kMaxTopK,
                     name.c_str());
        return false;
      }
    } else {
      std::fprintf(stderr, "--outputs: unknown '%s' (logprob, entropy, argmax, correct, topk:K)\n",
                   name.c_str());
      return false;
    }
  }
  return true;
}

namespace {

constexpr char kUsage[] =
    "losshead_kernel_bench [flags]: the fused CUDA call against plain cuBLAS\n"
    "  --shapes=N:V:D,...    shapes to run (default: six LLM heads; --quick: one)\n"
    "  --dtype=bf16|fp32     H, W and dH (default bf16)\n"
    "  --precision=highest|high|medium  an fp32 problem's GEMMs\n"
    "  --variants=a,b        backend options per run, '+'-joined tokens (default,fp32logits)\n"
    "  --runs=R              timed calls per median (20)\n"
    "  --budget_mib=M        workspace budget (1024)\n"
    "  --outputs=LIST        also time the call with distribution outputs, LIST of logprob,\n"
    "                        entropy, argmax, correct, topk:K (K in [1, 16]), e.g.\n"
    "                        --outputs=entropy,topk:5: prints its ms and % over the plain call\n"
    "  --profile_n=N, --memprobe_n=N  one call for a profiler; the memory one call needs\n";

}  // namespace

bool ParseArgs(int argc, char** argv, BenchArgs* args) {
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--help") {
      std::printf("%s", kUsage);
      return false;
    }
  }
  std::string shapes_arg;
  std::string dtype_arg = "bf16", precision_arg = "highest";
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("--dtype=", 0) == 0) dtype_arg = a.substr(8);
    if (a.rfind("--precision=", 0) == 0) precision_arg = a.substr(12);
    if (a.rfind("--runs=", 0) == 0) args->runs = std::max(1, std::atoi(a.c_str() + 7));
    if (a.rfind("--budget_mib=", 0) == 0) args->budget = size_t(std::atoll(a.c_str() + 13)) << 20;
    if (a.rfind("--variants=", 0) == 0) args->variants = a.substr(11);
    if (a.rfind("--shapes=", 0) == 0) shapes_arg = a.substr(9);  // N:V:D,N:V:D
    if (a.rfind("--profile_n=", 0) == 0) args->profile_n = std::atoll(a.c_str() + 12);
    if (a.rfind("--memprobe_n=", 0) == 0) args->memprobe_n = std::atoll(a.c_str() + 13);
    if (a == "--quick") quick = true;
    if (a.rfind("--outputs=", 0) == 0 && !ParseOutputs(a.substr(10), &args->outputs)) return false;
  }
  // The last: a vocabulary that is not a multiple of 8 (GPT-2's), where plain cuBLAS falls off its
  // Hopper kernels and the fused call must not (head_gemms.h).
  args->shapes = {{4096, 128256, 4096}, {8192, 128256, 4096}, {16384, 128256, 4096},
                  {8192, 256000, 2304}, {8192, 128256, 8192}, {8192, 50257, 4096}};
  if (quick) args->shapes = {{4096, 128256, 4096}};
  if (!shapes_arg.empty()) {
    args->shapes.clear();
    size_t start = 0;
    while (start < shapes_arg.size()) {
      size_t end = shapes_arg.find(',', start);
      if (end == std::string::npos) end = shapes_arg.size();
      long long n = 0, v = 0, d = 0;
      if (std::sscanf(shapes_arg.substr(start, end - start).c_str(), "%lld:%lld:%lld", &n, &v,
                      &d) != 3) {
        std::fprintf(stderr, "bad --shapes\n");
        return false;
      }
      args->shapes.push_back({n, v, d});
      start = end + 1;
    }
  }
  Numerics& num = args->numerics;
  if (dtype_arg == "fp32") {
    num.dtype = DType::kFP32;
  } else if (dtype_arg != "bf16") {
    std::fprintf(stderr, "--dtype must be bf16 or fp32, got '%s'\n", dtype_arg.c_str());
    return false;
  }
  if (precision_arg == "high") {
    num.precision = MatmulPrecision::kHigh;
  } else if (precision_arg == "medium") {
    num.precision = MatmulPrecision::kMedium;
  } else if (precision_arg != "highest") {
    std::fprintf(stderr, "--precision must be highest, high or medium, got '%s'\n",
                 precision_arg.c_str());
    return false;
  }
  // As the backend would refuse it (ValidateProblem): a bf16 product is exact in fp32 already.
  if (num.precision != MatmulPrecision::kHighest && num.dtype != DType::kFP32) {
    std::fprintf(stderr, "--precision=%s needs --dtype=fp32\n", precision_arg.c_str());
    return false;
  }
  return true;
}

}  // namespace losshead::bench
