// The CUDA backend's vocabulary-shard calls (shard_problem.h) against the CPU backend's fused Run.
// k shards of one head run on one GPU, each with its own backend and stream; the test plays the
// collectives: the AllGather of the statistics as device copies between the shards' buffers, the
// AllReduce of the dH partials on the host in rank order. Tolerances as for the fused call
// (tests/cuda/tolerance.h); bf16 problems round the logits to bf16 unless the case turns
// CudaBackendOptions::bf16_logits off.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/cuda/cuda_backend.h"
#include "losshead/kernels/backend.h"
#include "losshead/kernels/collective.h"
#include "losshead/kernels/dtype_convert.h"
#include "losshead/kernels/problem.h"
#include "losshead/kernels/shard_problem.h"
#include "tests/cuda/tolerance.h"
#include "tests/kernels/backend_runner.h"
#include "tests/kernels/shard_runner.h"

namespace losshead::kernels {
namespace {

constexpr size_t kMiB = size_t{1} << 20;
constexpr size_t kGiB = size_t{1} << 30;
constexpr int kPoison = 0xff;  // NaN in every dtype: an output a call forgets shows up

#define SKIP_WITHOUT_GPU() \
  if (!CudaAvailable()) GTEST_SKIP() << "no CUDA device visible: the shard suite needs a GPU"

#define ASSERT_OK(expr)                          \
  do {                                           \
    const absl::Status s_ = (expr);              \
    ASSERT_TRUE(s_.ok()) << #expr << ": " << s_; \
  } while (0)

#define RETURN_IF_ERROR(expr)       \
  do {                              \
    const absl::Status s_ = (expr); \
    if (!s_.ok()) return s_;        \
  } while (0)

#define RETURN_IF_CUDA_ERROR(expr)                                                   \
  do {                                                                               \
    const cudaError_t e_ = (expr);                                                   \
    if (e_ != cudaSuccess) {                                                         \
      return absl::InternalError(absl::StrCat(#expr, ": ", cudaGetErrorString(e_))); \
    }                                                                                \
  } while (0)

struct ShardCase {
  std::string name;
  DType dtype = DType::kBF16;
  int64_t n = 0, v = 0, d = 0;
  int k = 2;
  LossOptions options;
  double ignore_fraction = 0.1;
  int64_t budget_rows = 0;     // 0: 1 GiB, one chunk for every token; else a budget for ~this many
  bool ignored_chunk = false;  // every target of the second chunk is ignore_index
  bool forward_only = false;   // no dW, no dH partials
  bool bf16_logits = true;     // the backend's default; applies to bf16 problems only
  MatmulPrecision precision = MatmulPrecision::kHighest;
};

// Whether the case's logits are stored in bf16.
bool NarrowLogits(const ShardCase& c) { return c.bf16_logits && c.dtype == DType::kBF16; }

CudaBackendOptions OptionsFor(const ShardCase& c) {
  CudaBackendOptions o;
  o.bf16_logits = c.bf16_logits;
  return o;
}

Problem ProblemFor(const ShardCase& c) {
  Problem p;
  p.n = c.n;
  p.v = c.v;
  p.d = c.d;
  p.dtype = c.dtype;
  p.options = c.options;
  p.precision = c.precision;
  return p;
}

ShardProblem ShardOf(const Problem& problem, int k, int rank) {
  const Shard rows = ShardRange(problem.v, k, rank);
  ShardProblem s;
  s.problem = problem;
  s.row_begin = rows.begin;
  s.rows = rows.size();
  s.shards = k;
  s.rank = rank;
  return s;
}

// A budget that gives chunks of about `rows` tokens (before PlanShard rounds to 256) on the
// widest shard: the logits row, its row loss, the statistics and the dH partial.
size_t BudgetFor(const ShardCase& c) {
  if (c.budget_rows == 0) return kGiB;
  const int64_t widest = (c.v + c.k - 1) / c.k;
  const size_t logits_elem = NarrowLogits(c) ? 2 : 4;
  const size_t per_row = logits_elem * ((widest + 15) / 16 * 16) + 4 * (1 + 4 * c.k + c.d);
  const CudaBackendOptions o;
  return o.cublas_workspace_bytes + o.handle_reserve_bytes + 4096 + c.budget_rows * per_row;
}

std::unique_ptr<Backend> MakeCuda(const CudaBackendOptions& options = {}) {
  absl::StatusOr<std::unique_ptr<Backend>> b = CreateCudaBackend(0, options);
  EXPECT_TRUE(b.ok()) << b.status();
  return b.ok() ? std::move(*b) : nullptr;
}

// The chunk every shard can take: the smallest of the shards' plans (as the engine does).
absl::StatusOr<int64_t> CommonChunkRows(Backend& backend, const Problem& problem, int k,
                                        size_t budget) {
  int64_t rows = std::numeric_limits<int64_t>::max();
  for (int r = 0; r < k; ++r) {
    absl::StatusOr<ShardPlan> plan = backend.PlanShard(ShardOf(problem, k, r), budget);
    if (!plan.ok()) return plan.status();
    rows = std::min(rows, plan->chunk_rows);
  }
  return rows;
}

struct ShardOutputs {
  int64_t chunk_rows = 0;
  std::vector<float> loss_sum;                                    // per shard
  std::vector<int64_t> token_count;                               // per shard
  std::vector<std::vector<float>> per_token_loss, per_token_lse;  // per shard, N each
  std::vector<uint8_t> grad_hidden_raw;                           // N x D, dtype
  std::vector<double> grad_hidden;                                // decoded
  std::vector<float> grad_weight;  // V x D: every shard's rows in place
};

struct ShardState {
  std::unique_ptr<Backend> backend;
  std::unique_ptr<Stream> stream;
  ShardProblem shard;
  ShardPlan plan;
  DeviceBuffer hidden, weight, targets, grad_weight, stats, partial, loss, count, ptl, lse, ws;
  ShardArguments args;
};

// Runs the whole shard sequence of shard_problem.h for `in` over k shards, each with its own
// backend on device 0. dW starts at `dw_init` (V x D).
absl::StatusOr<ShardOutputs> RunShards(const testing::Inputs& in, int k, size_t budget,
                                       const std::vector<float>& dw_init, bool forward_only,
                                       const CudaBackendOptions& options = {}) {
  const Problem& p = in.problem;
  const size_t el = DTypeSize(p.dtype);
  const int64_t n = p.n, d = p.d;
  std::vector<ShardState> s(k);
  int64_t chunk_rows = std::numeric_limits<int64_t>::max();
  for (int r = 0; r < k; ++r) {
    absl::StatusOr<std::unique_ptr<Backend>> b = CreateCudaBackend(0, options);
    if (!b.ok()) return b.status();
    s[r].backend = std::move(*b);
    absl::StatusOr<std::unique_ptr<Stream>> st = s[r].backend->CreateStream();
    if (!st.ok()) return st.status();
    s[r].stream = std::move(*st);
    s[r].shard = ShardOf(p, k, r);
    absl::StatusOr<ShardPlan> plan = s[r].backend->PlanShard(s[r].shard, budget);
    if (!plan.ok()) return plan.status();
    s[r].plan = *plan;
    chunk_rows = std::min(chunk_rows, plan->chunk_rows);
  }
  const int64_t stats_floats = int64_t{k} * kShardStats * chunk_rows;
  DeviceBuffer grad_hidden;
  for (int r = 0; r < k; ++r) {
    ShardState& x = s[r];
    Backend& b = *x.backend;
    Stream& stream = *x.stream;
    const int64_t rows = x.shard.rows;
    absl::Status status;
    auto alloc = [&](DeviceBuffer* buf, size_t bytes) {
      if (!status.ok()) return;
      absl::StatusOr<DeviceBuffer> got = b.Allocate(bytes);
      if (!got.ok()) {
        status = got.status();
        return;
      }
      *buf = std::move(*got);
    };
    alloc(&x.hidden, n * d * el);
    alloc(&x.weight, rows * d * el);
    alloc(&x.targets, n * 4);
    alloc(&x.grad_weight, rows * d * 4);
    alloc(&x.stats, stats_floats * 4);
    alloc(&x.partial, chunk_rows * d * 4);
    alloc(&x.loss, 4);
    alloc(&x.count, 8);
    alloc(&x.ptl, n * 4);
    alloc(&x.lse, n * 4);
    alloc(&x.ws, x.plan.workspace_bytes);
    if (r == 0) alloc(&grad_hidden, n * d * el);
    RETURN_IF_ERROR(status);
    RETURN_IF_ERROR(b.CopyToDevice(x.hidden.data(), in.hidden_bytes.data(), n * d * el, stream));
    RETURN_IF_ERROR(b.CopyToDevice(x.weight.data(),
                                   in.weight_bytes.data() + x.shard.row_begin * d * el,
                                   rows * d * el, stream));
    RETURN_IF_ERROR(b.CopyToDevice(x.targets.data(), in.targets.data(), n * 4, stream));
    RETURN_IF_ERROR(b.CopyToDevice(x.grad_weight.data(), dw_init.data() + x.shard.row_begin * d,
                                   rows * d * 4, stream));
    for (const DeviceBuffer* buf :
         {&x.stats, &x.partial, &x.loss, &x.count, &x.ptl, &x.lse, &x.ws}) {
      RETURN_IF_ERROR(b.Memset(buf->data(), kPoison, buf->bytes(), stream));
    }
    if (r == 0) RETURN_IF_ERROR(b.Memset(grad_hidden.data(), kPoison, n * d * el, stream));
    ShardArguments& a = x.args;
    a.hidden = x.hidden.data();
    a.weight = x.weight.data();
    a.targets = x.targets.as<int32_t>();
    a.grad_weight = forward_only ? nullptr : x.grad_weight.as<float>();
    a.grad_hidden_partial = forward_only ? nullptr : x.partial.as<float>();
    a.stats = x.stats.as<float>();
    a.stats_chunk_rows = chunk_rows;
    a.loss_sum = x.loss.as<float>();
    a.token_count = x.count.as<int64_t>();
    a.per_token_loss = x.ptl.as<float>();
    a.per_token_lse = x.lse.as<float>();
    a.workspace = x.ws.data();
    a.workspace_bytes = x.plan.workspace_bytes;
    RETURN_IF_ERROR(b.ShardBegin(x.shard, a, stream));
  }

  std::vector<float> partial(chunk_rows * d);
  std::vector<double> sum(chunk_rows * d);
  for (int64_t t0 = 0; t0 < n; t0 += chunk_rows) {
    const ShardChunk chunk{t0, std::min(chunk_rows, n - t0)};
    for (ShardState& x : s)
      RETURN_IF_ERROR(x.backend->ShardForward(x.shard, x.args, chunk, *x.stream));
    // AllGather: slice r of shard r's stats into every other shard's, once the forwards are done;
    // a device-to-device cudaMemcpy may return before its copy is, hence the device sync after.
    for (ShardState& x : s) RETURN_IF_ERROR(x.stream->Synchronize());
    const size_t slice = size_t{kShardStats} * chunk_rows;
    for (int r = 0; r < k; ++r) {
      for (int j = 0; j < k; ++j) {
        if (j == r) continue;
        RETURN_IF_CUDA_ERROR(cudaMemcpy(s[j].args.stats + r * slice, s[r].args.stats + r * slice,
                                        slice * 4, cudaMemcpyDeviceToDevice));
      }
    }
    RETURN_IF_CUDA_ERROR(cudaDeviceSynchronize());
    for (ShardState& x : s) {
      RETURN_IF_ERROR(x.backend->ShardBackward(x.shard, x.args, chunk, *x.stream));
    }
    if (forward_only) continue;
    // AllReduce(kSum) of the partials, in rank order in double, into shard 0's buffer.
    const size_t count = chunk.size * d;
    std::fill(sum.begin(), sum.end(), 0.0);
    for (ShardState& x : s) {
      RETURN_IF_ERROR(
          x.backend->CopyToHost(partial.data(), x.partial.data(), count * 4, *x.stream));
      RETURN_IF_ERROR(x.stream->Synchronize());
      for (size_t i = 0; i < count; ++i) sum[i] += partial[i];
    }
    for (size_t i = 0; i < count; ++i) partial[i] = static_cast<float>(sum[i]);
    ShardState& s0 = s[0];
    RETURN_IF_ERROR(
        s0.backend->CopyToDevice(s0.partial.data(), partial.data(), count * 4, *s0.stream));
    RETURN_IF_ERROR(s0.backend->ShardStoreGradHidden(s0.shard, s0.partial.as<float>(), chunk,
                                                     grad_hidden.data(), *s0.stream));
    RETURN_IF_ERROR(s0.stream->Synchronize());  // `partial` is reused by the next chunk
  }

  ShardOutputs out;
  out.chunk_rows = chunk_rows;
  out.loss_sum.resize(k);
  out.token_count.resize(k);
  out.per_token_loss.assign(k, std::vector<float>(n));
  out.per_token_lse.assign(k, std::vector<float>(n));
  out.grad_weight.resize(p.v * d);
  for (int r = 0; r < k; ++r) {
    ShardState& x = s[r];
    Backend& b = *x.backend;
    Stream& stream = *x.stream;
    RETURN_IF_ERROR(b.CopyToHost(&out.loss_sum[r], x.loss.data(), 4, stream));
    RETURN_IF_ERROR(b.CopyToHost(&out.token_count[r], x.count.data(), 8, stream));
    RETURN_IF_ERROR(b.CopyToHost(out.per_token_loss[r].data(), x.ptl.data(), n * 4, stream));
    RETURN_IF_ERROR(b.CopyToHost(out.per_token_lse[r].data(), x.lse.data(), n * 4, stream));
    RETURN_IF_ERROR(b.CopyToHost(out.grad_weight.data() + x.shard.row_begin * d,
                                 x.grad_weight.data(), x.shard.rows * d * 4, stream));
    if (r == 0 && !forward_only) {
      out.grad_hidden_raw.resize(n * d * el);
      RETURN_IF_ERROR(
          b.CopyToHost(out.grad_hidden_raw.data(), grad_hidden.data(), n * d * el, stream));
    }
    RETURN_IF_ERROR(stream.Synchronize());
  }
  if (!forward_only) {
    std::vector<float> f(n * d);
    ToFloat(p.dtype, out.grad_hidden_raw.data(), f.data(), f.size());
    out.grad_hidden.assign(f.begin(), f.end());
  }
  return out;
}

// ||a - b|| / ||b|| in fp64, each less `base` where given; a non-finite `a` gives +inf.
template <typename A, typename B>
double RelErr(const std::vector<A>& a, const std::vector<B>& b,
              const std::vector<float>* base = nullptr) {
  if (a.size() != b.size()) return std::numeric_limits<double>::infinity();
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    double x = a[i], y = b[i];
    if (base != nullptr) {
      x -= (*base)[i];
      y -= (*base)[i];
    }
    if (!std::isfinite(x)) return std::numeric_limits<double>::infinity();
    num += (x - y) * (x - y);
    den += y * y;
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

std::vector<float> RandomGradWeight(const Problem& p, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1e-3f);
  std::vector<float> dw(p.v * p.d);
  for (float& x : dw) x = normal(rng);
  return dw;
}

// Uniform inputs with logits of a few units: W ~ U(-w, w) with w = 9 / sqrt(D) gives h . w a
// standard deviation of about 3 for H ~ U(-1, 1).
testing::Inputs MakeInputs(const ShardCase& c, uint64_t seed) {
  testing::InputSpec spec;
  spec.weight_scale = 9.0 / std::sqrt(static_cast<double>(c.d));
  spec.ignore_fraction = c.ignore_fraction;
  return testing::MakeRandomInputs(ProblemFor(c), seed, spec);
}

class ShardCudaVsCpuTest : public ::testing::TestWithParam<ShardCase> {};

TEST_P(ShardCudaVsCpuTest, MatchesCpuFusedRun) {
  SKIP_WITHOUT_GPU();
  const ShardCase& c = GetParam();
  const Problem problem = ProblemFor(c);
  const size_t budget = BudgetFor(c);
  std::unique_ptr<Backend> cuda = MakeCuda(OptionsFor(c));
  ASSERT_NE(cuda, nullptr);
  absl::StatusOr<int64_t> chunk_rows = CommonChunkRows(*cuda, problem, c.k, budget);
  ASSERT_TRUE(chunk_rows.ok()) << chunk_rows.status();
  if (c.budget_rows == 0) {
    EXPECT_EQ(*chunk_rows, c.n) << "a 1 GiB budget holds every token in one chunk";
  } else {
    EXPECT_LT(*chunk_rows, c.n) << "the small budget should split the micro-batch";
  }

  testing::Inputs in = MakeInputs(c, 0x5a4d0000u + std::hash<std::string>()(c.name));
  if (c.ignored_chunk) {
    ASSERT_LT(*chunk_rows, c.n);
    const int64_t end = std::min(c.n, 2 * *chunk_rows);
    for (int64_t t = *chunk_rows; t < end; ++t) {
      in.targets[t] = static_cast<int32_t>(c.options.ignore_index);
    }
  }
  const std::vector<float> dw_init = RandomGradWeight(problem, 99);

  absl::StatusOr<ShardOutputs> got =
      RunShards(in, c.k, budget, dw_init, c.forward_only, OptionsFor(c));
  ASSERT_TRUE(got.ok()) << got.status();
  absl::StatusOr<std::unique_ptr<Backend>> cpu = CreateBackend(BackendKind::kCpu);
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  testing::RunOptions ro;
  ro.workspace_budget = 256 * kMiB;
  ro.grad_hidden = ro.grad_weight = !c.forward_only;
  ro.initial_grad_weight = dw_init;
  absl::StatusOr<testing::Outputs> want = testing::RunOnBackend(**cpu, in, ro);
  ASSERT_TRUE(want.ok()) << want.status();

  const Tolerance tol = ToleranceFor(c.dtype, NarrowLogits(c), c.precision);
  for (int r = 0; r < c.k; ++r) {
    SCOPED_TRACE(absl::StrCat("shard ", r));
    EXPECT_EQ(got->token_count[r], want->token_count);
    // Every shard combines the same gathered statistics: the same bits.
    EXPECT_EQ(std::memcmp(&got->loss_sum[r], &got->loss_sum[0], 4), 0);
    EXPECT_EQ(std::memcmp(got->per_token_loss[r].data(), got->per_token_loss[0].data(), c.n * 4),
              0);
    EXPECT_EQ(std::memcmp(got->per_token_lse[r].data(), got->per_token_lse[0].data(), c.n * 4), 0);
  }
  const double loss_err = std::abs(static_cast<double>(got->loss_sum[0]) - want->loss_sum) /
                          std::max(1e-30, std::abs(static_cast<double>(want->loss_sum)));
  EXPECT_LE(loss_err, tol.loss) << "loss_sum " << got->loss_sum[0] << " vs " << want->loss_sum;
  EXPECT_LE(RelErr(got->per_token_loss[0], want->per_token_loss), tol.loss) << "per-token loss";
  EXPECT_LE(RelErr(got->per_token_lse[0], want->per_token_lse), tol.loss) << "per-token lse";
  if (c.ignored_chunk) {
    for (int64_t t = *chunk_rows; t < std::min(c.n, 2 * *chunk_rows); ++t) {
      ASSERT_EQ(got->per_token_loss[0][t], 0.0f) << "ignored token " << t;
      ASSERT_TRUE(std::isfinite(got->per_token_lse[0][t])) << "ignored token " << t;
      for (int64_t j = 0; j < c.d; ++j) ASSERT_EQ(got->grad_hidden[t * c.d + j], 0.0) << t;
    }
  }
  if (c.forward_only) {
    // No dW was passed: the shards' accumulators keep their starting values.
    EXPECT_EQ(std::memcmp(got->grad_weight.data(), dw_init.data(), dw_init.size() * 4), 0);
    return;
  }
  EXPECT_LE(RelErr(got->grad_hidden, want->grad_hidden), tol.dh) << "dH";
  // dW: what the calls added, not the random starting values that would hide it.
  EXPECT_LE(RelErr(got->grad_weight, want->grad_weight, &dw_init), tol.dw) << "dW";
}

std::vector<ShardCase> Cases() {
  std::vector<ShardCase> cases;
  auto add = [&](std::string name, DType dtype, int k, int64_t n, int64_t v, int64_t d,
                 Reduction reduction, auto tweak) {
    ShardCase c;
    c.dtype = dtype;
    c.k = k;
    c.n = n;
    c.v = v;
    c.d = d;
    c.options.reduction = reduction;
    tweak(c);
    c.name = absl::StrCat(DTypeName(dtype), "_k", k, "_N", n, "_V", v, "_D", d, "_", name);
    cases.push_back(c);
  };
  auto chunked = [](ShardCase& c) { c.budget_rows = 300; };
  auto whole = [](ShardCase&) {};
  add("mean_chunked", DType::kBF16, 2, 700, 1000, 64, Reduction::kMean, chunked);
  add("mean_chunked", DType::kBF16, 3, 700, 4099, 256, Reduction::kMean, chunked);
  add("sum_chunked", DType::kFP32, 3, 700, 4099, 64, Reduction::kSum, chunked);
  add("sum_chunked", DType::kFP32, 2, 600, 1000, 256, Reduction::kSum, chunked);
  add("mean_whole", DType::kBF16, 3, 300, 4099, 256, Reduction::kMean, whole);
  add("mean_whole", DType::kFP32, 2, 500, 1000, 64, Reduction::kMean, whole);
  add("sum_whole", DType::kFP16, 2, 400, 4099, 64, Reduction::kSum, whole);
  // Shards of 6 and 7 rows: the GEMMs' tail alone (head_gemms.h); and of 2048 rows: no tail.
  add("mean_tailonly", DType::kBF16, 2, 700, 13, 256, Reduction::kMean, chunked);
  add("sum_aligned", DType::kBF16, 2, 700, 4096, 256, Reduction::kSum, chunked);
  add("gradscale_sum_chunked", DType::kBF16, 2, 650, 1000, 64, Reduction::kSum, [](ShardCase& c) {
    c.budget_rows = 300;
    c.options.grad_scale = 0.37f;
  });
  // Label smoothing, z-loss and the soft-cap together; a real class id as ignore_index; the
  // second chunk wholly ignored.
  add("all_options_ignored_chunk", DType::kFP32, 3, 700, 4099, 64, Reduction::kMean,
      [](ShardCase& c) {
        c.budget_rows = 300;
        c.options.label_smoothing = 0.1f;
        c.options.z_loss = 1e-3f;
        c.options.softcap = 15.0f;
        c.options.ignore_index = 7;
        c.ignored_chunk = true;
      });
  add("all_options_ignored_chunk", DType::kBF16, 2, 600, 1000, 256, Reduction::kSum,
      [](ShardCase& c) {
        c.budget_rows = 300;
        c.options.label_smoothing = 0.05f;
        c.options.z_loss = 1e-4f;
        c.options.softcap = 30.0f;
        c.ignored_chunk = true;
        c.ignore_fraction = 0.25;
      });
  // bf16 problems with the logits kept in fp32 (CudaBackendOptions::bf16_logits off).
  add("fp32_logits_mean_chunked", DType::kBF16, 3, 700, 4099, 256, Reduction::kMean,
      [](ShardCase& c) {
        c.budget_rows = 300;
        c.bf16_logits = false;
      });
  add("fp32_logits_all_options", DType::kBF16, 2, 600, 1000, 64, Reduction::kSum, [](ShardCase& c) {
    c.budget_rows = 300;
    c.bf16_logits = false;
    c.options.label_smoothing = 0.1f;
    c.options.z_loss = 1e-3f;
    c.options.softcap = 15.0f;
  });
  add("all_ignored", DType::kBF16, 2, 300, 1000, 64, Reduction::kMean,
      [](ShardCase& c) { c.ignore_fraction = 1.0; });
  add("forward_only", DType::kBF16, 3, 700, 4099, 64, Reduction::kMean, [](ShardCase& c) {
    c.budget_rows = 300;
    c.forward_only = true;
    c.options.label_smoothing = 0.1f;
  });
  add("forward_only", DType::kFP32, 2, 500, 1000, 256, Reduction::kSum, [](ShardCase& c) {
    c.forward_only = true;
    c.options.softcap = 20.0f;
    c.options.z_loss = 1e-3f;
  });
  // fp32 shards on the tensor cores (MatmulPrecision), with a tail in every shard's width.
  add("high_mean_chunked", DType::kFP32, 3, 700, 4099, 256, Reduction::kMean, [](ShardCase& c) {
    c.budget_rows = 300;
    c.precision = MatmulPrecision::kHigh;
  });
  add("medium_sum", DType::kFP32, 2, 500, 1003, 64, Reduction::kSum,
      [](ShardCase& c) { c.precision = MatmulPrecision::kMedium; });
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Shards, ShardCudaVsCpuTest, ::testing::ValuesIn(Cases()),
                         [](const auto& info) { return info.param.name; });

TEST(ShardCudaTest, RerunIsBitIdentical) {
  SKIP_WITHOUT_GPU();
  for (auto [dtype, bf16_logits] :
       {std::pair{DType::kBF16, true}, {DType::kBF16, false}, {DType::kFP32, true}}) {
    ShardCase c;
    c.dtype = dtype;
    c.bf16_logits = bf16_logits;
    c.k = 3;
    c.n = 700;
    c.v = 4099;
    c.d = 256;
    c.budget_rows = 300;
    c.options.label_smoothing = 0.1f;
    c.options.z_loss = 1e-4f;
    c.options.softcap = 30.0f;
    const testing::Inputs in = MakeInputs(c, 4242);
    const std::vector<float> dw_init = RandomGradWeight(in.problem, 7);
    absl::StatusOr<ShardOutputs> a =
        RunShards(in, c.k, BudgetFor(c), dw_init, false, OptionsFor(c));
    absl::StatusOr<ShardOutputs> b =
        RunShards(in, c.k, BudgetFor(c), dw_init, false, OptionsFor(c));
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_TRUE(b.ok()) << b.status();
    ASSERT_LT(a->chunk_rows, c.n);
    SCOPED_TRACE(absl::StrCat(DTypeName(dtype), bf16_logits ? "" : ", fp32 logits"));
    EXPECT_EQ(std::memcmp(a->loss_sum.data(), b->loss_sum.data(), c.k * 4), 0);
    EXPECT_EQ(std::memcmp(a->per_token_loss[0].data(), b->per_token_loss[0].data(), c.n * 4), 0);
    EXPECT_EQ(std::memcmp(a->per_token_lse[0].data(), b->per_token_lse[0].data(), c.n * 4), 0);
    EXPECT_EQ(a->grad_hidden_raw, b->grad_hidden_raw);
    EXPECT_EQ(std::memcmp(a->grad_weight.data(), b->grad_weight.data(), a->grad_weight.size() * 4),
              0);
  }
}

// The project's shared shard runner (tests/kernels/shard_runner.h: host exchange, outputs on
// shard 0 only, so the other shards run with null loss and per-token outputs) gives the bits of
// the runner above: the same calls on the same data.
TEST(ShardCudaTest, SharedRunnerGivesTheSameBits) {
  SKIP_WITHOUT_GPU();
  ShardCase c;
  c.dtype = DType::kBF16;
  c.k = 3;
  c.n = 700;
  c.v = 4099;
  c.d = 256;
  c.budget_rows = 300;
  c.options.label_smoothing = 0.1f;
  const testing::Inputs in = MakeInputs(c, 777);
  const std::vector<float> dw_init = RandomGradWeight(in.problem, 8);
  absl::StatusOr<ShardOutputs> mine = RunShards(in, c.k, BudgetFor(c), dw_init, false);
  ASSERT_TRUE(mine.ok()) << mine.status();
  std::vector<std::unique_ptr<Backend>> owned;
  std::vector<Backend*> shards;
  for (int r = 0; r < c.k; ++r) {
    owned.push_back(MakeCuda());
    ASSERT_NE(owned.back(), nullptr);
    shards.push_back(owned.back().get());
  }
  testing::RunOptions ro;
  ro.workspace_budget = BudgetFor(c);
  ro.initial_grad_weight = dw_init;
  absl::StatusOr<testing::Outputs> shared = testing::RunSharded(shards, nullptr, in, ro);
  ASSERT_TRUE(shared.ok()) << shared.status();
  EXPECT_EQ(shared->token_count, mine->token_count[0]);
  EXPECT_EQ(std::memcmp(&shared->loss_sum, &mine->loss_sum[0], 4), 0);
  EXPECT_EQ(std::memcmp(shared->per_token_loss.data(), mine->per_token_loss[0].data(), c.n * 4), 0);
  EXPECT_EQ(std::memcmp(shared->per_token_lse.data(), mine->per_token_lse[0].data(), c.n * 4), 0);
  EXPECT_TRUE(shared->grad_hidden == mine->grad_hidden) << "dH differs";
  EXPECT_EQ(std::memcmp(shared->grad_weight.data(), mine->grad_weight.data(),
                        mine->grad_weight.size() * 4),
            0);
}

TEST(ShardCudaTest, PlanFitsTheBudgetAndIgnoresRank) {
  SKIP_WITHOUT_GPU();
  std::unique_ptr<Backend> cuda = MakeCuda();
  ASSERT_NE(cuda, nullptr);
  Problem p;
  p.n = 8192;
  p.v = 128257;  // 3 shards of 42752, 42752 and 42753 rows
  p.d = 4096;
  p.dtype = DType::kBF16;
  const size_t budget = 512 * kMiB;
  std::vector<ShardPlan> plans;
  for (int r = 0; r < 3; ++r) {
    absl::StatusOr<ShardPlan> plan = cuda->PlanShard(ShardOf(p, 3, r), budget);
    ASSERT_TRUE(plan.ok()) << plan.status();
    EXPECT_LT(plan->chunk_rows, p.n);
    EXPECT_EQ(plan->chunk_rows % 256, 0) << plan->chunk_rows;
    EXPECT_EQ(plan->stats_floats, 3 * kShardStats * plan->chunk_rows);
    EXPECT_EQ(plan->partial_floats, plan->chunk_rows * p.d);
    // The stream's reserve stays out of the budget, as for WorkspaceBytes.
    EXPECT_LE(plan->workspace_bytes + 4 * (plan->stats_floats + plan->partial_floats) +
                  CudaBackendOptions().handle_reserve_bytes,
              budget);
    plans.push_back(*plan);
  }
  // Ranks 0 and 1 have the same rows at different places: the same plan.
  EXPECT_EQ(plans[0].chunk_rows, plans[1].chunk_rows);
  EXPECT_EQ(plans[0].workspace_bytes, plans[1].workspace_bytes);
  // bf16 logits (the default) take half the bytes per logit: more tokens per chunk than fp32.
  CudaBackendOptions fp32_logits;
  fp32_logits.bf16_logits = false;
  std::unique_ptr<Backend> wide = MakeCuda(fp32_logits);
  ASSERT_NE(wide, nullptr);
  absl::StatusOr<ShardPlan> wide_plan = wide->PlanShard(ShardOf(p, 3, 0), budget);
  ASSERT_TRUE(wide_plan.ok()) << wide_plan.status();
  EXPECT_GT(plans[0].chunk_rows, wide_plan->chunk_rows);
  EXPECT_LE(wide_plan->workspace_bytes + 4 * (wide_plan->stats_floats + wide_plan->partial_floats) +
                CudaBackendOptions().handle_reserve_bytes,
            budget);
  // With room for every token, shards one row apart agree on one chunk of n.
  p.n = 512;
  for (int r = 0; r < 3; ++r) {
    absl::StatusOr<ShardPlan> plan = cuda->PlanShard(ShardOf(p, 3, r), 4 * kGiB);
    ASSERT_TRUE(plan.ok()) << plan.status();
    EXPECT_EQ(plan->chunk_rows, p.n);
  }
  // Not even one row: RESOURCE_EXHAUSTED.
  EXPECT_EQ(cuda->PlanShard(ShardOf(p, 3, 0), kMiB).status().code(),
            absl::StatusCode::kResourceExhausted);
}

// Error paths: exact codes, and nothing launched (the sentinels stay).
class ShardCudaErrorTest : public ::testing::Test {
 protected:
  static constexpr int64_t kN = 16;
  void SetUp() override {
    SKIP_WITHOUT_GPU();
    cuda_ = MakeCuda();
    ASSERT_NE(cuda_, nullptr);
    Problem p;
    p.n = kN;
    p.v = 1001;
    p.d = 64;
    shard_ = ShardOf(p, 2, 0);
    auto stream = cuda_->CreateStream();
    ASSERT_TRUE(stream.ok());
    stream_ = std::move(*stream);
    auto plan = cuda_->PlanShard(shard_, kGiB);
    ASSERT_TRUE(plan.ok()) << plan.status();
    ASSERT_EQ(plan->chunk_rows, kN);
    for (auto [buf, bytes] : {std::pair{&hidden_, size_t{kN * 64 * 2}},
                              {&weight_, size_t(shard_.rows) * 64 * 2},
                              {&targets_, kN * 4},
                              {&stats_, size_t(plan->stats_floats) * 4},
                              {&partial_, size_t(plan->partial_floats) * 4},
                              {&grad_hidden_, kN * 64 * 2},
                              {&loss_, 4},
                              {&ws_, plan->workspace_bytes}}) {
      auto b = cuda_->Allocate(bytes);
      ASSERT_TRUE(b.ok());
      *buf = std::move(*b);
    }
    std::vector<int32_t> t(kN, 3);
    ASSERT_OK(cuda_->CopyToDevice(targets_.data(), t.data(), kN * 4, *stream_));
    ASSERT_OK(cuda_->Memset(loss_.data(), 0x7f, 4, *stream_));
    ASSERT_OK(cuda_->Memset(stats_.data(), 0x7f, stats_.bytes(), *stream_));
    ASSERT_OK(cuda_->Memset(grad_hidden_.data(), 0x7f, grad_hidden_.bytes(), *stream_));
    ASSERT_OK(stream_->Synchronize());
    args_.hidden = hidden_.data();
    args_.weight = weight_.data();
    args_.targets = targets_.as<int32_t>();
    args_.stats = stats_.as<float>();
    args_.stats_chunk_rows = plan->chunk_rows;
    args_.grad_hidden_partial = partial_.as<float>();
    args_.loss_sum = loss_.as<float>();
    args_.workspace = ws_.data();
    args_.workspace_bytes = plan->workspace_bytes;
  }

  // Every call of the sequence with these arguments: each must be INVALID_ARGUMENT.
  void ExpectAllInvalid(const ShardProblem& shard, const ShardArguments& args, ShardChunk chunk,
                        const std::string& what) {
    SCOPED_TRACE(what);
    EXPECT_EQ(cuda_->ShardBegin(shard, args, *stream_).code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(cuda_->ShardForward(shard, args, chunk, *stream_).code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(cuda_->ShardBackward(shard, args, chunk, *stream_).code(),
              absl::StatusCode::kInvalidArgument);
  }

  void ExpectUntouched() {
    uint32_t loss = 0, stat = 0;
    uint16_t dh = 0;
    ASSERT_OK(cuda_->CopyToHost(&loss, loss_.data(), 4, *stream_));
    ASSERT_OK(cuda_->CopyToHost(&stat, stats_.data(), 4, *stream_));
    ASSERT_OK(cuda_->CopyToHost(&dh, grad_hidden_.data(), 2, *stream_));
    ASSERT_OK(stream_->Synchronize());
    EXPECT_EQ(loss, 0x7f7f7f7fu) << "a rejected call must launch nothing";
    EXPECT_EQ(stat, 0x7f7f7f7fu) << "a rejected call must launch nothing";
    EXPECT_EQ(dh, 0x7f7fu) << "a rejected call must launch nothing";
  }

  std::unique_ptr<Backend> cuda_;
  std::unique_ptr<Stream> stream_;
  ShardProblem shard_;
  DeviceBuffer hidden_, weight_, targets_, stats_, partial_, grad_hidden_, loss_, ws_;
  ShardArguments args_;
};

TEST_F(ShardCudaErrorTest, ChunkLargerThanStatsRows) {
  ShardArguments a = args_;
  a.stats_chunk_rows = kN / 2;
  EXPECT_EQ(cuda_->ShardForward(shard_, a, {0, kN}, *stream_).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cuda_->ShardBackward(shard_, a, {0, kN}, *stream_).code(),
            absl::StatusCode::kInvalidArgument);
  ExpectUntouched();
}

TEST_F(ShardCudaErrorTest, RankOutsideShards) {
  ShardProblem s = shard_;
  s.rank = 2;
  ExpectAllInvalid(s, args_, {0, kN}, "rank 2 of 2");
  EXPECT_EQ(cuda_->PlanShard(s, kGiB).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      cuda_->ShardStoreGradHidden(s, partial_.as<float>(), {0, kN}, grad_hidden_.data(), *stream_)
          .code(),
      absl::StatusCode::kInvalidArgument);
  ExpectUntouched();
}

TEST_F(ShardCudaErrorTest, NullPointers) {
  for (auto mutate :
       std::vector<void (*)(ShardArguments&)>{[](ShardArguments& a) { a.stats = nullptr; },
                                              [](ShardArguments& a) { a.hidden = nullptr; },
                                              [](ShardArguments& a) { a.weight = nullptr; },
                                              [](ShardArguments& a) { a.targets = nullptr; },
                                              [](ShardArguments& a) { a.workspace = nullptr; }}) {
    ShardArguments a = args_;
    mutate(a);
    ExpectAllInvalid(shard_, a, {0, kN}, "null pointer");
  }
  EXPECT_EQ(
      cuda_->ShardStoreGradHidden(shard_, nullptr, {0, kN}, grad_hidden_.data(), *stream_).code(),
      absl::StatusCode::kInvalidArgument);
  ExpectUntouched();
}

TEST_F(ShardCudaErrorTest, ChunkOutsideTokensOrWorkspaceTooSmall) {
  for (ShardChunk chunk : {ShardChunk{0, 0}, ShardChunk{-1, 4}, ShardChunk{kN - 4, 8}}) {
    EXPECT_EQ(cuda_->ShardForward(shard_, args_, chunk, *stream_).code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(cuda_->ShardBackward(shard_, args_, chunk, *stream_).code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(cuda_
                  ->ShardStoreGradHidden(shard_, partial_.as<float>(), chunk, grad_hidden_.data(),
                                         *stream_)
                  .code(),
              absl::StatusCode::kInvalidArgument);
  }
  ShardArguments a = args_;
  a.workspace_bytes = 4096;
  ExpectAllInvalid(shard_, a, {0, kN}, "small workspace");
  a = args_;
  a.workspace = static_cast<char*>(ws_.data()) + 16;
  ExpectAllInvalid(shard_, a, {0, kN}, "unaligned workspace");
  ExpectUntouched();
}

TEST_F(ShardCudaErrorTest, ForeignStream) {
  std::unique_ptr<Backend> cpu = CreateBackend(BackendKind::kCpu).value();
  auto cpu_stream = cpu->CreateStream();
  ASSERT_TRUE(cpu_stream.ok());
  EXPECT_EQ(cuda_->ShardForward(shard_, args_, {0, kN}, **cpu_stream).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cuda_
                ->ShardStoreGradHidden(shard_, partial_.as<float>(), {0, kN}, grad_hidden_.data(),
                                       **cpu_stream)
                .code(),
            absl::StatusCode::kInvalidArgument);
  ExpectUntouched();
}

}  // namespace
}  // namespace losshead::kernels
