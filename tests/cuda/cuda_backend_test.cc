// The CUDA backend against the CPU reference backend (CreateCpuBackend) on fresh random inputs.
//
// Error bounds are relative norms ||cuda - cpu|| / ||cpu|| per output, per dtype:
//   fp32: true fp32 GEMMs (no TF32) on both sides; only summation order differs.
//   bf16/fp16: the logit gradient G is rounded to the input dtype before the dH/dW GEMMs (the
//   tensor cores' operand), and dH is stored in it: about one rounding (2^-9 bf16, 2^-11 fp16).
#include "kernels/cuda/cuda_backend.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "losshead/kernels/backend.h"
#include "losshead/kernels/dtype_convert.h"
#include "losshead/kernels/problem.h"
#include "tests/cuda/tolerance.h"

namespace losshead::kernels {
namespace {

constexpr size_t kMiB = size_t{1} << 20;
constexpr size_t kGiB = size_t{1} << 30;

#define SKIP_WITHOUT_GPU() \
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device visible: the CUDA suite needs a GPU"

#define ASSERT_OK(expr)                          \
  do {                                           \
    const absl::Status s_ = (expr);              \
    ASSERT_TRUE(s_.ok()) << #expr << ": " << s_; \
  } while (0)

// Host copies of one problem's inputs and outputs.
struct Inputs {
  std::vector<uint8_t> hidden, weight;  // problem.dtype
  std::vector<int32_t> targets;
  std::vector<float> grad_weight_init;  // dW before the call
};

struct Outputs {
  float loss_sum = 0;
  int64_t token_count = 0;
  std::vector<float> per_token_loss, per_token_lse;
  std::vector<float> grad_hidden;  // converted to fp32
  std::vector<float> grad_weight;  // dW after the call(s)
  std::vector<uint8_t> grad_hidden_raw;
};

struct Case {
  std::string name;
  DType dtype = DType::kBF16;
  int64_t n = 0, v = 0, d = 0;
  LossOptions options;
  double ignored_fraction = 0.1;
  float logit_std = 3.0f;   // typical |logit|
  int64_t chunk_rows = 0;   // 0: default 1 GiB budget; else the budget for about this many rows
  bool bf16_logits = true;  // the backend's default; applies to bf16 problems only
  int row_threads = 512;
  int row_blocks_per_sm = 0;
  bool overlap = false;
  bool balance_chunks = true;
  bool sm90_logits_gemm = CudaBackendOptions{}.sm90_logits_gemm;  // where the device runs it
  bool extreme_logits = false;  // bf16 logits at |logit| ~ 1e4: looser gradient bound
  MatmulPrecision precision = MatmulPrecision::kHighest;
};

Inputs MakeInputs(const Case& c, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  Inputs in;
  const size_t el = DTypeSize(c.dtype);
  std::vector<float> h(c.n * c.d), w(c.v * c.d);
  for (float& x : h) x = normal(rng);
  // logit = h . w has standard deviation logit_std when w ~ N(0, logit_std^2 / d).
  const float ws = c.logit_std / std::sqrt(static_cast<float>(c.d));
  for (float& x : w) x = normal(rng) * ws;
  in.hidden.resize(h.size() * el);
  in.weight.resize(w.size() * el);
  FromFloat(c.dtype, h.data(), in.hidden.data(), h.size());
  FromFloat(c.dtype, w.data(), in.weight.data(), w.size());
  std::uniform_int_distribution<int32_t> target(0, static_cast<int32_t>(c.v - 1));
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  in.targets.resize(c.n);
  for (int32_t& t : in.targets) {
    t = unit(rng) < c.ignored_fraction ? static_cast<int32_t>(c.options.ignore_index) : target(rng);
  }
  in.grad_weight_init.resize(c.v * c.d);
  for (float& x : in.grad_weight_init) x = normal(rng) * 1e-3f;
  return in;
}

Problem ProblemFor(const Case& c) {
  Problem p;
  p.n = c.n;
  p.v = c.v;
  p.d = c.d;
  p.dtype = c.dtype;
  p.options = c.options;
  p.precision = c.precision;
  return p;
}

// Runs `calls` calls of `problem` on `backend` through its own memory and stream: dW starts at
// in.grad_weight_init and accumulates over the calls; the other outputs come from the last call.
// `with_grad_weight` false passes no dW accumulator (a forward-only step); dW then reads back as
// its initial value.
absl::Status RunOn(Backend& backend, const Problem& problem, const Inputs& in, size_t budget,
                   Outputs* out, int calls = 1, bool with_grad_weight = true) {
  const size_t el = DTypeSize(problem.dtype);
  const int64_t n = problem.n, d = problem.d, v = problem.v;
  absl::StatusOr<size_t> ws_bytes = backend.WorkspaceBytes(problem, budget);
  if (!ws_bytes.ok()) return ws_bytes.status();
  absl::StatusOr<std::unique_ptr<Stream>> stream_or = backend.CreateStream();
  if (!stream_or.ok()) return stream_or.status();
  Stream& stream = **stream_or;
  auto alloc = [&](size_t bytes) { return backend.Allocate(bytes); };
  auto hidden = alloc(n * d * el), weight = alloc(v * d * el), targets = alloc(n * 4),
       grad_hidden = alloc(n * d * el), grad_weight = alloc(v * d * 4), loss = alloc(4),
       count = alloc(8), ptl = alloc(n * 4), lse = alloc(n * 4), ws = alloc(*ws_bytes);
  for (auto* b :
       {&hidden, &weight, &targets, &grad_hidden, &grad_weight, &loss, &count, &ptl, &lse, &ws}) {
    if (!b->ok()) return b->status();
  }
  absl::Status s;
  auto chk = [&](absl::Status st) {
    if (s.ok()) s = st;
  };
  chk(backend.CopyToDevice(hidden->data(), in.hidden.data(), in.hidden.size(), stream));
  chk(backend.CopyToDevice(weight->data(), in.weight.data(), in.weight.size(), stream));
  chk(backend.CopyToDevice(targets->data(), in.targets.data(), n * 4, stream));
  chk(backend.CopyToDevice(grad_weight->data(), in.grad_weight_init.data(), v * d * 4, stream));
  // Poison every output: a value the call forgets to write shows up as NaN.
  chk(backend.Memset(grad_hidden->data(), 0xff, n * d * el, stream));
  chk(backend.Memset(ptl->data(), 0xff, n * 4, stream));
  chk(backend.Memset(lse->data(), 0xff, n * 4, stream));
  chk(backend.Memset(loss->data(), 0xff, 4, stream));
  chk(backend.Memset(ws->data(), 0xff, *ws_bytes, stream));
  if (!s.ok()) return s;
  Arguments args;
  args.hidden = hidden->data();
  args.weight = weight->data();
  args.targets = targets->as<int32_t>();
  args.grad_hidden = grad_hidden->data();
  args.grad_weight = with_grad_weight ? grad_weight->as<float>() : nullptr;
  args.loss_sum = loss->as<float>();
  args.token_count = count->as<int64_t>();
  args.per_token_loss = ptl->as<float>();
  args.per_token_lse = lse->as<float>();
  args.workspace = ws->data();
  args.workspace_bytes = *ws_bytes;
  for (int i = 0; i < calls; ++i) {
    if (absl::Status st = backend.Run(problem, args, stream); !st.ok()) return st;
  }
  out->per_token_loss.resize(n);
  out->per_token_lse.resize(n);
  out->grad_hidden_raw.resize(n * d * el);
  out->grad_weight.resize(v * d);
  chk(backend.CopyToHost(&out->loss_sum, loss->data(), 4, stream));
  chk(backend.CopyToHost(&out->token_count, count->data(), 8, stream));
  chk(backend.CopyToHost(out->per_token_loss.data(), ptl->data(), n * 4, stream));
  chk(backend.CopyToHost(out->per_token_lse.data(), lse->data(), n * 4, stream));
  chk(backend.CopyToHost(out->grad_hidden_raw.data(), grad_hidden->data(), n * d * el, stream));
  chk(backend.CopyToHost(out->grad_weight.data(), grad_weight->data(), v * d * 4, stream));
  chk(stream.Synchronize());
  out->grad_hidden.resize(n * d);
  ToFloat(problem.dtype, out->grad_hidden_raw.data(), out->grad_hidden.data(), n * d);
  return s;
}

// ||a - b|| / ||b|| in fp64; NaN anywhere gives +inf. An all-zero reference compares absolutely.
double RelErr(const std::vector<float>& a, const std::vector<float>& b,
              const std::vector<float>* subtract = nullptr) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    double x = a[i], y = b[i];
    if (subtract != nullptr) {
      x -= (*subtract)[i];
      y -= (*subtract)[i];
    }
    if (!std::isfinite(x)) return std::numeric_limits<double>::infinity();
    num += (x - y) * (x - y);
    den += y * y;
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

std::unique_ptr<Backend> MakeCuda(const Case* c = nullptr) {
  CudaBackendOptions o;
  if (c != nullptr) {
    o.bf16_logits = c->bf16_logits;
    o.row_threads = c->row_threads;
    o.row_blocks_per_sm = c->row_blocks_per_sm;
    o.overlap = c->overlap;
    o.balance_chunks = c->balance_chunks;
    o.sm90_logits_gemm = c->sm90_logits_gemm;
  }
  absl::StatusOr<std::unique_ptr<Backend>> b = CreateCudaBackend(0, o);
  EXPECT_TRUE(b.ok()) << b.status();
  return b.ok() ? std::move(*b) : nullptr;
}

// The budget that gives the CUDA backend chunks of about `rows` rows.
size_t BudgetForRows(const Case& c) {
  if (c.chunk_rows == 0) return kGiB;
  const bool narrow = c.bf16_logits && c.dtype == DType::kBF16;
  // Our own logits GEMM's statistics (a float per 256 columns) where it may run.
  const size_t stats = narrow && c.sm90_logits_gemm ? (c.v / 8 * 8 + 255) / 256 * 4 : 0;
  const size_t row = ((c.v + 15) / 16 * 16) * (narrow ? 2 : 4) + 4 + stats;
  // The cuBLAS part of the workspace, the handle's reserve, scalars and alignment slack.
  const CudaBackendOptions o;
  return o.cublas_workspace_bytes + o.handle_reserve_bytes + 4096 + c.chunk_rows * row;
}

void CompareWithCpu(const Case& c, uint64_t seed) {
  const Problem problem = ProblemFor(c);
  const Inputs in = MakeInputs(c, seed);
  std::unique_ptr<Backend> cuda = MakeCuda(&c);
  ASSERT_NE(cuda, nullptr);
  std::unique_ptr<Backend> cpu = CreateCpuBackend();
  Outputs got, want;
  ASSERT_OK(RunOn(*cuda, problem, in, BudgetForRows(c), &got));
  ASSERT_OK(RunOn(*cpu, problem, in, 2 * kGiB, &want));
  Tolerance tol = ToleranceFor(c.dtype, c.bf16_logits && c.dtype == DType::kBF16, c.precision);
  if (c.extreme_logits && c.bf16_logits && c.dtype == DType::kBF16) tol.dh = tol.dw = 0.15;
  EXPECT_EQ(got.token_count, want.token_count);
  const double loss_err = std::abs(static_cast<double>(got.loss_sum) - want.loss_sum) /
                          std::max(1e-30, std::abs(static_cast<double>(want.loss_sum)));
  if (want.token_count > 0) {
    EXPECT_LE(loss_err, tol.loss) << "loss_sum " << got.loss_sum << " vs " << want.loss_sum;
  } else {
    EXPECT_EQ(got.loss_sum, 0.0f);
  }
  EXPECT_LE(RelErr(got.per_token_loss, want.per_token_loss), tol.loss) << "per-token loss";
  EXPECT_LE(RelErr(got.per_token_lse, want.per_token_lse), tol.loss) << "per-token lse";
  EXPECT_LE(RelErr(got.grad_hidden, want.grad_hidden), tol.dh) << "dH";
  // dW: compare what the call added, not the random starting values that would hide it.
  EXPECT_LE(RelErr(got.grad_weight, want.grad_weight, &in.grad_weight_init), tol.dw) << "dW";
}

class CudaVsCpuTest : public ::testing::TestWithParam<Case> {};

TEST_P(CudaVsCpuTest, MatchesCpuReference) {
  SKIP_WITHOUT_GPU();
  CompareWithCpu(GetParam(), 0x5eed0000u + std::hash<std::string>()(GetParam().name));
}

std::vector<Case> Cases() {
  std::vector<Case> cases;
  auto add = [&](
                 DType dt, int64_t n, int64_t v, int64_t d, Reduction red, std::string extra = "",
                 auto tweak = [](Case&) {}) {
    Case c;
    c.dtype = dt;
    c.n = n;
    c.v = v;
    c.d = d;
    c.options.reduction = red;
    tweak(c);
    const char* rname = red == Reduction::kMean ? "mean" : red == Reduction::kSum ? "sum" : "none";
    c.name = absl::StrCat(DTypeName(dt), "_N", n, "_V", v, "_D", d, "_", rname, extra);
    cases.push_back(c);
  };
  auto none = [](Case&) {};
  for (DType dt : {DType::kBF16, DType::kFP16, DType::kFP32}) {
    add(dt, 1, 1001, 64, Reduction::kMean, "", none);
    add(dt, 257, 32003, 768, Reduction::kMean, "", none);
    add(dt, 1000, 1001, 64, Reduction::kSum, "_chunk256", [](Case& c) { c.chunk_rows = 256; });
    add(dt, 64, 1001, 4096, Reduction::kNone, "", none);
  }
  add(DType::kBF16, 16384, 1001, 64, Reduction::kMean, "", none);
  add(DType::kBF16, 16384, 1001, 64, Reduction::kMean, "_chunk2048",
      [](Case& c) { c.chunk_rows = 2048; });
  add(DType::kBF16, 96, 32003, 2304, Reduction::kMean, "", none);
  add(DType::kBF16, 48, 32003, 4096, Reduction::kSum, "_gradscale",
      [](Case& c) { c.options.grad_scale = 0.37f; });
  add(DType::kBF16, 700, 1001, 768, Reduction::kMean, "_allignored",
      [](Case& c) { c.ignored_fraction = 1.0; });
  add(DType::kFP32, 300, 1001, 64, Reduction::kMean, "_logits1e4",
      [](Case& c) { c.logit_std = 1e4f; });
  add(DType::kBF16, 300, 1001, 64, Reduction::kSum, "_fp32logits_logits1e4", [](Case& c) {
    c.logit_std = 1e4f;
    c.bf16_logits = false;
  });
  // bf16 logits at |logit| ~ 1e4 round each logit by up to 32, which reorders near-ties of the
  // softmax: only the fp32-logits path (above) meets the bf16 bound there; this bounds the default.
  add(DType::kBF16, 300, 1001, 64, Reduction::kSum, "_logits1e4", [](Case& c) {
    c.logit_std = 1e4f;
    c.extreme_logits = true;
  });
  add(DType::kBF16, 1000, 32003, 768, Reduction::kMean, "_fp32logits_chunk256", [](Case& c) {
    c.bf16_logits = false;
    c.chunk_rows = 256;
  });
  add(DType::kBF16, 1000, 32003, 768, Reduction::kMean, "_rowthreads1024_chunk256", [](Case& c) {
    c.row_threads = 1024;
    c.chunk_rows = 256;
  });
  add(DType::kFP32, 300, 32003, 64, Reduction::kMean, "_rowthreads1024_softcap", [](Case& c) {
    c.row_threads = 1024;
    c.options.softcap = 20.0f;
    c.options.label_smoothing = 0.1f;
  });
  // Widths against the GEMMs' split (head_gemms.h): a tail alone (V < 8), an aligned width with
  // no tail, and bulk plus tail with the 16-bit dH summed in fp32 scratch, in halves.
  for (DType dt : {DType::kBF16, DType::kFP16, DType::kFP32}) {
    add(dt, 300, 7, 256, Reduction::kMean, "_tailonly", none);
    add(dt, 300, 1024, 256, Reduction::kSum, "_aligned", none);
  }
  add(DType::kBF16, 1500, 4093, 512, Reduction::kMean, "_overlap_tail_chunk1024", [](Case& c) {
    c.overlap = true;
    c.chunk_rows = 1024;
  });
  // The overlapped schedule (row kernel of one half beside the other half's GEMMs), balanced
  // chunks of 2500 / 3 rows, and the per-SM row cap, in every combination the defaults lack.
  add(DType::kBF16, 2500, 32003, 768, Reduction::kMean, "_overlap_chunk1024", [](Case& c) {
    c.overlap = true;
    c.chunk_rows = 1024;
  });
  add(DType::kBF16, 2500, 32003, 768, Reduction::kNone, "_overlap_unbalanced_chunk1024",
      [](Case& c) {
        c.overlap = true;
        c.balance_chunks = false;
        c.chunk_rows = 1024;
      });
  add(DType::kFP32, 1200, 32003, 256, Reduction::kMean, "_overlap_fp32_smoothing", [](Case& c) {
    c.overlap = true;
    c.options.label_smoothing = 0.1f;
  });
  add(DType::kBF16, 1000, 32003, 768, Reduction::kMean, "_bps1_t1024_chunk512", [](Case& c) {
    c.row_threads = 1024;
    c.row_blocks_per_sm = 1;
    c.chunk_rows = 512;
  });
  add(DType::kBF16, 1000, 32003, 768, Reduction::kSum, "_fp32logits_bps2", [](Case& c) {
    c.bf16_logits = false;
    c.row_blocks_per_sm = 2;
  });
  // Our own logits GEMM (CudaBackendOptions::sm90_logits_gemm, compute capability 9.0; cuBLASLt's
  // elsewhere): with its statistics for the row kernel, a tail, chunks, the overlapped schedule,
  // the z-loss, every row ignored, extreme logits; without them (a soft-cap); a D that is no whole
  // number of 16-byte vectors, which it leaves to cuBLASLt.
  const auto sm90 = [](Case& c) { c.sm90_logits_gemm = true; };
  add(DType::kBF16, 257, 32003, 768, Reduction::kMean, "_sm90", sm90);
  add(DType::kBF16, 16384, 1001, 64, Reduction::kMean, "_sm90_chunk2048", [=](Case& c) {
    sm90(c);
    c.chunk_rows = 2048;
  });
  add(DType::kBF16, 1500, 4093, 512, Reduction::kSum, "_sm90_overlap_tail_chunk1024", [=](Case& c) {
    sm90(c);
    c.overlap = true;
    c.chunk_rows = 1024;
  });
  add(DType::kBF16, 500, 32003, 768, Reduction::kMean, "_sm90_zloss", [=](Case& c) {
    sm90(c);
    c.options.z_loss = 1e-4f;
  });
  add(DType::kBF16, 700, 1001, 768, Reduction::kMean, "_sm90_allignored", [=](Case& c) {
    sm90(c);
    c.ignored_fraction = 1.0;
  });
  add(DType::kBF16, 300, 1001, 64, Reduction::kSum, "_sm90_logits1e4", [=](Case& c) {
    sm90(c);
    c.logit_std = 1e4f;
    c.extreme_logits = true;
  });
  add(DType::kBF16, 500, 32003, 768, Reduction::kMean, "_sm90_softcap", [=](Case& c) {
    sm90(c);
    c.options.softcap = 15.0f;
    c.logit_std = 20.0f;
  });
  add(DType::kBF16, 300, 4093, 100, Reduction::kMean, "_sm90_d100", sm90);
  add(DType::kBF16, 500, 32003, 768, Reduction::kMean, "_smoothing",
      [](Case& c) { c.options.label_smoothing = 0.1f; });
  add(DType::kBF16, 500, 32003, 768, Reduction::kMean, "_zloss",
      [](Case& c) { c.options.z_loss = 1e-4f; });
  add(DType::kBF16, 500, 32003, 768, Reduction::kMean, "_softcap", [](Case& c) {
    c.options.softcap = 15.0f;
    c.logit_std = 20.0f;
  });
  add(DType::kFP32, 500, 1001, 768, Reduction::kNone, "_all_options_chunk256", [](Case& c) {
    c.options.softcap = 30.0f;
    c.options.z_loss = 1e-3f;
    c.options.label_smoothing = 0.05f;
    c.options.ignore_index = 7;  // a real class id: that class is then never a target
    c.chunk_rows = 256;
  });
  add(DType::kFP16, 500, 1001, 768, Reduction::kMean, "_gradscale65536",
      [](Case& c) { c.options.grad_scale = 65536.0f; });
  add(DType::kBF16, 300, 1001, 64, Reduction::kMean, "_softcap_smoothing", [](Case& c) {
    c.options.softcap = 30.0f;
    c.options.label_smoothing = 0.1f;
  });
  // fp32 problems on the tensor cores (MatmulPrecision): one chunk and several, a width with a
  // tail, the overlapped schedule, every loss option.
  for (MatmulPrecision precision : {MatmulPrecision::kHigh, MatmulPrecision::kMedium}) {
    const std::string p = absl::StrCat("_", MatmulPrecisionName(precision));
    const auto with = [precision](Case& c) { c.precision = precision; };
    add(DType::kFP32, 257, 32003, 768, Reduction::kMean, p, with);
    add(DType::kFP32, 1000, 4093, 256, Reduction::kSum, p + "_tail_chunk256", [=](Case& c) {
      with(c);
      c.chunk_rows = 256;
    });
    add(DType::kFP32, 1200, 32003, 256, Reduction::kMean, p + "_overlap", [=](Case& c) {
      with(c);
      c.overlap = true;
    });
    add(DType::kFP32, 500, 1001, 768, Reduction::kNone, p + "_all_options", [=](Case& c) {
      with(c);
      c.options.softcap = 30.0f;
      c.options.z_loss = 1e-3f;
      c.options.label_smoothing = 0.05f;
    });
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaVsCpuTest, ::testing::ValuesIn(Cases()),
                         [](const auto& info) { return info.param.name; });

Case SmallCase(DType dtype = DType::kBF16) {
  Case c;
  c.dtype = dtype;
  c.n = 600;
  c.v = 32003;
  c.d = 256;
  c.chunk_rows = 256;
  c.name = "small";
  return c;
}

TEST(CudaBackendTest, TwoRunsAreBitIdentical) {
  SKIP_WITHOUT_GPU();
  for (auto [dt, sm90] : {std::pair{DType::kBF16, false}, std::pair{DType::kBF16, true},
                          std::pair{DType::kFP32, false}}) {
    Case c = SmallCase(dt);
    c.sm90_logits_gemm = sm90;
    SCOPED_TRACE(sm90 ? "our logits GEMM" : "cuBLASLt's logits GEMM");
    const Inputs in = MakeInputs(c, 42);
    std::unique_ptr<Backend> cuda = MakeCuda(&c);
    ASSERT_NE(cuda, nullptr);
    Outputs a, b;
    ASSERT_OK(RunOn(*cuda, ProblemFor(c), in, BudgetForRows(c), &a));
    ASSERT_OK(RunOn(*cuda, ProblemFor(c), in, BudgetForRows(c), &b));
    EXPECT_EQ(std::memcmp(&a.loss_sum, &b.loss_sum, 4), 0) << DTypeName(dt);
    EXPECT_EQ(a.grad_hidden_raw, b.grad_hidden_raw) << DTypeName(dt);
    EXPECT_EQ(std::memcmp(a.grad_weight.data(), b.grad_weight.data(), a.grad_weight.size() * 4), 0)
        << DTypeName(dt);
    EXPECT_EQ(std::memcmp(a.per_token_loss.data(), b.per_token_loss.data(), c.n * 4), 0);
  }
}

// high and medium reach cuBLAS: their results move away from highest's by about their inputs'
// rounding (TF32 keeps 10 mantissa bits; medium permits bf16's 7, though cuBLAS on an H100 picks
// its TF32 kernels for it), far beyond the few ulps of a changed summation order, and are still
// the same bits on every rerun.
TEST(CudaBackendTest, FasterPrecisionsRoundTheGemmInputsAndRerunBitIdentically) {
  SKIP_WITHOUT_GPU();
  Case c = SmallCase(DType::kFP32);
  const Inputs in = MakeInputs(c, 7);
  std::unique_ptr<Backend> cuda = MakeCuda();
  ASSERT_NE(cuda, nullptr);
  Outputs highest;
  ASSERT_OK(RunOn(*cuda, ProblemFor(c), in, BudgetForRows(c), &highest));
  double dh_err[3] = {0, 0, 0}, dw_err[3] = {0, 0, 0};
  for (MatmulPrecision precision : {MatmulPrecision::kHigh, MatmulPrecision::kMedium}) {
    SCOPED_TRACE(MatmulPrecisionName(precision));
    c.precision = precision;
    Outputs a, b;
    ASSERT_OK(RunOn(*cuda, ProblemFor(c), in, BudgetForRows(c), &a));
    ASSERT_OK(RunOn(*cuda, ProblemFor(c), in, BudgetForRows(c), &b));
    EXPECT_EQ(a.grad_hidden_raw, b.grad_hidden_raw);
    EXPECT_EQ(std::memcmp(a.grad_weight.data(), b.grad_weight.data(), a.grad_weight.size() * 4), 0);
    EXPECT_EQ(std::memcmp(&a.loss_sum, &b.loss_sum, 4), 0);
    const int i = static_cast<int>(precision);
    dh_err[i] = RelErr(a.grad_hidden, highest.grad_hidden);
    dw_err[i] = RelErr(a.grad_weight, highest.grad_weight, &in.grad_weight_init);
  }
  const int high = static_cast<int>(MatmulPrecision::kHigh);
  const int medium = static_cast<int>(MatmulPrecision::kMedium);
  for (int i : {high, medium}) {
    EXPECT_GT(dh_err[i], 1e-5) << i;
    EXPECT_GT(dw_err[i], 1e-5) << i;
  }
}

TEST(CudaBackendTest, OverlappedRunsAreBitIdenticalToSerial) {
  SKIP_WITHOUT_GPU();
  Case c = SmallCase();
  c.n = 1500;
  c.chunk_rows = 768;
  const Inputs in = MakeInputs(c, 43);
  std::unique_ptr<Backend> serial = MakeCuda(&c);
  c.overlap = true;
  std::unique_ptr<Backend> overlapped = MakeCuda(&c);
  ASSERT_NE(serial, nullptr);
  ASSERT_NE(overlapped, nullptr);
  Outputs a, b, b2;
  ASSERT_OK(RunOn(*serial, ProblemFor(c), in, BudgetForRows(c), &a));
  ASSERT_OK(RunOn(*overlapped, ProblemFor(c), in, BudgetForRows(c), &b));
  ASSERT_OK(RunOn(*overlapped, ProblemFor(c), in, BudgetForRows(c), &b2));
  // The split changes the dH GEMMs' shapes (cuBLAS may pick other kernels), so dH is compared
  // run against run; the loss reduction and dW see the same operands in the same order.
  EXPECT_EQ(std::memcmp(&a.loss_sum, &b.loss_sum, 4), 0);
  EXPECT_EQ(std::memcmp(a.per_token_loss.data(), b.per_token_loss.data(), c.n * 4), 0);
  EXPECT_EQ(b.grad_hidden_raw, b2.grad_hidden_raw);
  EXPECT_EQ(std::memcmp(b.grad_weight.data(), b2.grad_weight.data(), b.grad_weight.size() * 4), 0);
  EXPECT_LE(RelErr(b.grad_hidden, a.grad_hidden), 1e-2);
}

// CudaBackendOptions::gemm_ranks picks other cuBLASLt candidates for the three GEMMs only where
// they sum as the heuristic's first does: the same bits, whatever the ranks (a rank the heuristic
// does not offer falls back to the first).
TEST(CudaBackendTest, OtherGemmCandidatesGiveTheSameBits) {
  SKIP_WITHOUT_GPU();
  Case c = SmallCase();
  c.n = 1024;
  c.v = 32000;
  c.d = 512;
  c.chunk_rows = 512;
  const Inputs in = MakeInputs(c, 44);
  std::unique_ptr<Backend> first = MakeCuda(&c);
  ASSERT_NE(first, nullptr);
  Outputs want;
  ASSERT_OK(RunOn(*first, ProblemFor(c), in, BudgetForRows(c), &want));
  const int rank_sets[][3] = {{5, 1, 5}, {1, 2, 3}, {7, 7, 7}, {50, 50, 50}};
  for (const auto& ranks : rank_sets) {
    SCOPED_TRACE(::testing::Message() << ranks[0] << "," << ranks[1] << "," << ranks[2]);
    CudaBackendOptions o;
    for (int i = 0; i < 3; ++i) o.gemm_ranks[i] = ranks[i];
    absl::StatusOr<std::unique_ptr<Backend>> other = CreateCudaBackend(0, o);
    ASSERT_TRUE(other.ok()) << other.status();
    Outputs got;
    ASSERT_OK(RunOn(**other, ProblemFor(c), in, BudgetForRows(c), &got));
    EXPECT_EQ(std::memcmp(&got.loss_sum, &want.loss_sum, 4), 0);
    EXPECT_EQ(got.grad_hidden_raw, want.grad_hidden_raw);
    EXPECT_EQ(
        std::memcmp(got.grad_weight.data(), want.grad_weight.data(), want.grad_weight.size() * 4),
        0);
  }
}

// An allocation the device cannot hold is RESOURCE_EXHAUSTED, and nothing of it lingers: the next
// run on the same thread, whose launch checks read the thread's last CUDA error, goes through and
// gives the same bits as the run before it.
TEST(CudaBackendTest, AFailedAllocationDoesNotFailTheNextRun) {
  SKIP_WITHOUT_GPU();
  const Case c = SmallCase();
  const Inputs in = MakeInputs(c, 44);
  std::unique_ptr<Backend> cuda = MakeCuda();
  ASSERT_NE(cuda, nullptr);
  Outputs before, after;
  ASSERT_OK(RunOn(*cuda, ProblemFor(c), in, BudgetForRows(c), &before));
  auto huge = cuda->Allocate(2 * cuda->memory_info().total_bytes);
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kResourceExhausted) << huge.status();
  ASSERT_OK(RunOn(*cuda, ProblemFor(c), in, BudgetForRows(c), &after));
  EXPECT_EQ(std::memcmp(&before.loss_sum, &after.loss_sum, 4), 0);
  EXPECT_EQ(before.grad_hidden_raw, after.grad_hidden_raw);
}

TEST(CudaBackendTest, GradWeightAccumulatesAcrossCalls) {
  SKIP_WITHOUT_GPU();
  const Case c = SmallCase();
  const Inputs in = MakeInputs(c, 7);
  std::unique_ptr<Backend> cuda = MakeCuda();
  ASSERT_NE(cuda, nullptr);
  std::unique_ptr<Backend> cpu = CreateCpuBackend();
  Outputs got, want;
  ASSERT_OK(RunOn(*cuda, ProblemFor(c), in, BudgetForRows(c), &got, /*calls=*/2));
  ASSERT_OK(RunOn(*cpu, ProblemFor(c), in, 2 * kGiB, &want, /*calls=*/2));
  EXPECT_LE(RelErr(got.grad_weight, want.grad_weight, &in.grad_weight_init), 1.2e-2);
  // Two calls add twice what one adds.
  Outputs once;
  ASSERT_OK(RunOn(*cuda, ProblemFor(c), in, BudgetForRows(c), &once, /*calls=*/1));
  std::vector<float> twice(once.grad_weight.size());
  for (size_t i = 0; i < twice.size(); ++i) {
    twice[i] = in.grad_weight_init[i] + 2 * (once.grad_weight[i] - in.grad_weight_init[i]);
  }
  EXPECT_LE(RelErr(got.grad_weight, twice, &in.grad_weight_init), 1e-5);
}

TEST(CudaBackendTest, WithoutGradWeightLossAndDhAreUnchangedAndDwUntouched) {
  SKIP_WITHOUT_GPU();
  for (DType dtype : {DType::kBF16, DType::kFP32}) {
    const Case c = SmallCase(dtype);
    const Inputs in = MakeInputs(c, 21);
    std::unique_ptr<Backend> cuda = MakeCuda();
    ASSERT_NE(cuda, nullptr);
    Outputs full, forward;
    ASSERT_OK(RunOn(*cuda, ProblemFor(c), in, BudgetForRows(c), &full));
    ASSERT_OK(RunOn(*cuda, ProblemFor(c), in, BudgetForRows(c), &forward, 1,
                    /*with_grad_weight=*/false));
    EXPECT_EQ(forward.loss_sum, full.loss_sum);
    EXPECT_EQ(forward.token_count, full.token_count);
    EXPECT_EQ(forward.grad_hidden_raw, full.grad_hidden_raw);
    EXPECT_EQ(std::memcmp(forward.per_token_loss.data(), full.per_token_loss.data(),
                          full.per_token_loss.size() * 4),
              0);
    ASSERT_EQ(forward.grad_weight.size(), in.grad_weight_init.size());
    EXPECT_EQ(std::memcmp(forward.grad_weight.data(), in.grad_weight_init.data(),
                          in.grad_weight_init.size() * 4),
              0);
  }
}

TEST(CudaBackendTest, ConcurrentStreamsMatchSerialResults) {
  SKIP_WITHOUT_GPU();
  const Case c = SmallCase();
  const Inputs in1 = MakeInputs(c, 1), in2 = MakeInputs(c, 2);
  std::unique_ptr<Backend> cuda = MakeCuda();
  ASSERT_NE(cuda, nullptr);
  Outputs s1, s2, p1, p2;
  ASSERT_OK(RunOn(*cuda, ProblemFor(c), in1, BudgetForRows(c), &s1));
  ASSERT_OK(RunOn(*cuda, ProblemFor(c), in2, BudgetForRows(c), &s2));
  absl::Status st1, st2;
  std::thread t1([&] { st1 = RunOn(*cuda, ProblemFor(c), in1, BudgetForRows(c), &p1); });
  std::thread t2([&] { st2 = RunOn(*cuda, ProblemFor(c), in2, BudgetForRows(c), &p2); });
  t1.join();
  t2.join();
  ASSERT_OK(st1);
  ASSERT_OK(st2);
  EXPECT_EQ(s1.grad_hidden_raw, p1.grad_hidden_raw);
  EXPECT_EQ(s2.grad_hidden_raw, p2.grad_hidden_raw);
  EXPECT_EQ(std::memcmp(s1.grad_weight.data(), p1.grad_weight.data(), s1.grad_weight.size() * 4),
            0);
  EXPECT_EQ(s2.loss_sum, p2.loss_sum);
}

TEST(CudaBackendTest, OutOfRangeTargetIsTreatedAsIgnored) {
  SKIP_WITHOUT_GPU();
  Case c = SmallCase();
  c.n = 8;
  c.ignored_fraction = 0.0;
  Inputs in = MakeInputs(c, 3);
  in.targets[2] = static_cast<int32_t>(c.v);  // one past the end
  in.targets[5] = -5;
  std::unique_ptr<Backend> cuda = MakeCuda();
  ASSERT_NE(cuda, nullptr);
  Outputs got;
  ASSERT_OK(RunOn(*cuda, ProblemFor(c), in, BudgetForRows(c), &got));
  EXPECT_EQ(got.token_count, 6);
  EXPECT_EQ(got.per_token_loss[2], 0.0f);
  EXPECT_EQ(got.per_token_loss[5], 0.0f);
  for (int64_t j = 0; j < c.d; ++j) {
    EXPECT_EQ(got.grad_hidden[2 * c.d + j], 0.0f);
    EXPECT_EQ(got.grad_hidden[5 * c.d + j], 0.0f);
  }
  // The same call with those targets set to ignore_index is the reference.
  in.targets[2] = in.targets[5] = static_cast<int32_t>(c.options.ignore_index);
  Outputs want;
  ASSERT_OK(RunOn(*cuda, ProblemFor(c), in, BudgetForRows(c), &want));
  EXPECT_EQ(got.loss_sum, want.loss_sum);
  EXPECT_EQ(got.grad_hidden_raw, want.grad_hidden_raw);
}

// Error paths: exact codes, and nothing launched (outputs keep their sentinel values).
class CudaBackendErrorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (CudaDeviceCount() == 0)
      GTEST_SKIP() << "no CUDA device visible: the CUDA suite needs a GPU";
    cuda_ = MakeCuda();
    ASSERT_NE(cuda_, nullptr);
    problem_.n = 16;
    problem_.v = 1001;
    problem_.d = 64;
    auto stream = cuda_->CreateStream();
    ASSERT_TRUE(stream.ok());
    stream_ = std::move(*stream);
    auto ws = cuda_->WorkspaceBytes(problem_, kGiB);
    ASSERT_TRUE(ws.ok());
    ws_bytes_ = *ws;
    for (auto [buf, bytes] : {std::pair{&hidden_, size_t{16 * 64 * 2}},
                              {&weight_, 1001 * 64 * 2},
                              {&targets_, 16 * 4},
                              {&loss_, 4},
                              {&count_, 8},
                              {&ws_, ws_bytes_}}) {
      auto b = cuda_->Allocate(bytes);
      ASSERT_TRUE(b.ok());
      *buf = std::move(*b);
    }
    std::vector<int32_t> t(16, 3);
    ASSERT_OK(cuda_->CopyToDevice(targets_.data(), t.data(), 64, *stream_));
    ASSERT_OK(cuda_->Memset(loss_.data(), 0x7f, 4, *stream_));
    ASSERT_OK(stream_->Synchronize());
    args_.hidden = hidden_.data();
    args_.weight = weight_.data();
    args_.targets = targets_.as<int32_t>();
    args_.loss_sum = loss_.as<float>();
    args_.token_count = count_.as<int64_t>();
    args_.workspace = ws_.data();
    args_.workspace_bytes = ws_bytes_;
  }

  void ExpectUntouched() {
    uint32_t bits = 0;
    ASSERT_OK(cuda_->CopyToHost(&bits, loss_.data(), 4, *stream_));
    ASSERT_OK(stream_->Synchronize());
    EXPECT_EQ(bits, 0x7f7f7f7fu) << "a failed Run must launch nothing";
  }

  std::unique_ptr<Backend> cuda_;
  std::unique_ptr<Stream> stream_;
  Problem problem_;
  size_t ws_bytes_ = 0;
  DeviceBuffer hidden_, weight_, targets_, loss_, count_, ws_;
  Arguments args_;
};

TEST_F(CudaBackendErrorTest, BadShapesAreInvalidArgument) {
  for (auto mutate : std::vector<void (*)(Problem&)>{
           [](Problem& p) { p.n = 0; }, [](Problem& p) { p.d = 0; }, [](Problem& p) { p.v = -1; },
           [](Problem& p) { p.options.label_smoothing = 1.0f; },
           [](Problem& p) { p.options.softcap = -1.0f; },
           [](Problem& p) { p.options.z_loss = NAN; },
           [](Problem& p) { p.options.grad_scale = INFINITY; },
           [](Problem& p) { p.v = int64_t{1} << 31; },
           // A bf16 problem takes no faster precision; no problem takes one out of the enum.
           [](Problem& p) { p.precision = MatmulPrecision::kHigh; },
           [](Problem& p) { p.precision = MatmulPrecision::kMedium; },
           [](Problem& p) {
             p.dtype = DType::kFP32;
             p.precision = static_cast<MatmulPrecision>(7);
           }}) {
    Problem p = problem_;
    mutate(p);
    EXPECT_EQ(cuda_->CanImplement(p).code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(cuda_->WorkspaceBytes(p, kGiB).status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(cuda_->Run(p, args_, *stream_).code(), absl::StatusCode::kInvalidArgument);
  }
  ExpectUntouched();
}

TEST_F(CudaBackendErrorTest, NullPointersAreInvalidArgument) {
  for (auto mutate : std::vector<void (*)(Arguments&)>{
           [](Arguments& a) { a.hidden = nullptr; }, [](Arguments& a) { a.weight = nullptr; },
           [](Arguments& a) { a.targets = nullptr; }, [](Arguments& a) { a.loss_sum = nullptr; },
           [](Arguments& a) { a.token_count = nullptr; },
           [](Arguments& a) { a.workspace = nullptr; }}) {
    Arguments a = args_;
    mutate(a);
    EXPECT_EQ(cuda_->Run(problem_, a, *stream_).code(), absl::StatusCode::kInvalidArgument);
  }
  ExpectUntouched();
}

TEST_F(CudaBackendErrorTest, WorkspaceTooSmall) {
  EXPECT_EQ(cuda_->WorkspaceBytes(problem_, kMiB).status().code(),
            absl::StatusCode::kResourceExhausted);
  Arguments a = args_;
  a.workspace_bytes = 4096;
  EXPECT_EQ(cuda_->Run(problem_, a, *stream_).code(), absl::StatusCode::kInvalidArgument);
  ExpectUntouched();
}

// A top-k output with top_k outside [1, min(kMaxTopK, V)] is INVALID_ARGUMENT naming top_k, and
// launches nothing (the distribution outputs' values: cuda_distribution_test.cc).
TEST_F(CudaBackendErrorTest, BadTopKIsInvalidArgument) {
  auto outputs = cuda_->Allocate(16 * (kMaxTopK + 1) * sizeof(float));
  ASSERT_TRUE(outputs.ok());
  ASSERT_OK(cuda_->Memset(outputs->data(), 0x7f, 16 * (kMaxTopK + 1) * sizeof(float), *stream_));
  for (int32_t top_k : {0, -1, kMaxTopK + 1}) {
    for (bool ids : {true, false}) {
      Arguments a = args_;
      a.per_token_entropy = outputs->as<float>();
      a.top_k = top_k;
      if (ids) {
        a.top_k_ids = outputs->as<int32_t>();
      } else {
        a.top_k_logprobs = outputs->as<float>();
      }
      const absl::Status status = cuda_->Run(problem_, a, *stream_);
      EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
      EXPECT_NE(status.message().find("top_k"), std::string::npos) << status;
    }
  }
  // top_k > V.
  Problem narrow = problem_;
  narrow.v = 10;
  Arguments a = args_;
  a.top_k = 11;
  a.top_k_ids = outputs->as<int32_t>();
  EXPECT_EQ(cuda_->Run(narrow, a, *stream_).code(), absl::StatusCode::kInvalidArgument);
  ExpectUntouched();
  std::vector<uint32_t> bits(16 * (kMaxTopK + 1));
  ASSERT_OK(cuda_->CopyToHost(bits.data(), outputs->data(), bits.size() * 4, *stream_));
  ASSERT_OK(stream_->Synchronize());
  EXPECT_EQ(bits, std::vector<uint32_t>(bits.size(), 0x7f7f7f7fu));
}

// Every distribution output alone is computed (no longer refused): a call asking for one writes
// it, whatever the others.
TEST_F(CudaBackendErrorTest, EachDistributionOutputAloneRuns) {
  auto outputs = cuda_->Allocate(16 * kMaxTopK * sizeof(float));
  ASSERT_TRUE(outputs.ok());
  void* out = outputs->data();
  // Zero logits: every output has a value unlike the poison.
  ASSERT_OK(cuda_->Memset(hidden_.data(), 0, 16 * 64 * 2, *stream_));
  ASSERT_OK(cuda_->Memset(weight_.data(), 0, 1001 * 64 * 2, *stream_));
  const std::vector<void (*)(Arguments&, void*)> asks = {
      [](Arguments& a, void* p) { a.per_token_logprob = static_cast<float*>(p); },
      [](Arguments& a, void* p) { a.per_token_entropy = static_cast<float*>(p); },
      [](Arguments& a, void* p) { a.per_token_argmax = static_cast<int32_t*>(p); },
      [](Arguments& a, void* p) { a.correct_count = static_cast<int64_t*>(p); },
      [](Arguments& a, void* p) {
        a.top_k = 2;
        a.top_k_ids = static_cast<int32_t*>(p);
      },
      [](Arguments& a, void* p) {
        a.top_k = kMaxTopK;
        a.top_k_logprobs = static_cast<float*>(p);
      }};
  for (const auto& ask : asks) {
    ASSERT_OK(cuda_->Memset(out, 0x7f, 16 * kMaxTopK * sizeof(float), *stream_));
    Arguments a = args_;
    ask(a, out);
    ASSERT_OK(cuda_->Run(problem_, a, *stream_));
    uint32_t first = 0;
    ASSERT_OK(cuda_->CopyToHost(&first, out, 4, *stream_));
    ASSERT_OK(stream_->Synchronize());
    EXPECT_NE(first, 0x7f7f7f7fu);
  }
}

// The model options and loss terms beyond the plain loss (problem.h) are computed
// (cuda_loss_terms_test.cc): CanImplement and WorkspaceBytes accept each, and the workspace does
// not depend on them.
TEST_F(CudaBackendErrorTest, LossTermsAreAccepted) {
  const absl::StatusOr<size_t> plain = cuda_->WorkspaceBytes(problem_, kGiB);
  ASSERT_TRUE(plain.ok()) << plain.status();
  const std::vector<void (*)(LossOptions&)> options = {
      [](LossOptions& o) { o.logit_scale = 0.5f; }, [](LossOptions& o) { o.entropy_coef = -0.01f; },
      [](LossOptions& o) { o.kind = LossKind::kPolicyGradient; }};
  for (const auto& set : options) {
    Problem p = problem_;
    set(p.options);
    EXPECT_TRUE(cuda_->CanImplement(p).ok()) << cuda_->CanImplement(p);
    const absl::StatusOr<size_t> bytes = cuda_->WorkspaceBytes(p, kGiB);
    ASSERT_TRUE(bytes.ok()) << bytes.status();
    EXPECT_EQ(*bytes, *plain);
  }
}

TEST_F(CudaBackendErrorTest, ForeignStreamIsInvalidArgument) {
  std::unique_ptr<Backend> cpu = CreateCpuBackend(1);
  auto cpu_stream = cpu->CreateStream();
  ASSERT_TRUE(cpu_stream.ok());
  EXPECT_EQ(cuda_->Run(problem_, args_, **cpu_stream).code(), absl::StatusCode::kInvalidArgument);
  ExpectUntouched();
}

TEST_F(CudaBackendErrorTest, WorkspaceIsBoundedIndependentlyOfN) {
  Problem big = problem_;
  big.v = 128256;
  big.d = 4096;
  big.n = 16384;
  auto a = cuda_->WorkspaceBytes(big, kGiB);
  big.n = 1 << 20;
  auto b = cuda_->WorkspaceBytes(big, kGiB);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(*a, *b);
  EXPECT_LE(*a, kGiB);
}

TEST(CudaBackendFactoryTest, DescribesDeviceAndRejectsMissingOne) {
  if (CudaDeviceCount() == 0) {
    EXPECT_EQ(CreateCudaBackend(0).status().code(), absl::StatusCode::kUnavailable);
    GTEST_SKIP() << "no CUDA device visible: only the UNAVAILABLE path was checked";
  }
  EXPECT_EQ(CreateCudaBackend(CudaDeviceCount()).status().code(), absl::StatusCode::kUnavailable);
  auto b = CreateCudaBackend(0);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ((*b)->name(), "cuda");
  EXPECT_EQ((*b)->device_description().rfind("cuda:0 (", 0), 0u) << (*b)->device_description();
  const MemoryInfo m = (*b)->memory_info();
  EXPECT_GT(m.total_bytes, 0u);
  EXPECT_LE(m.free_bytes, m.total_bytes);
}

}  // namespace
}  // namespace losshead::kernels
