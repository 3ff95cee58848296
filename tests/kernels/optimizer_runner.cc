#include "tests/kernels/optimizer_runner.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>

#include "absl/strings/str_cat.h"
#include "losshead/kernels/dtype_convert.h"

namespace losshead::kernels::testing {

OptimizerInputs MakeOptimizerInputs(const OptimizerCase& c, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  OptimizerInputs in;
  in.param.resize(c.count());
  for (float& x : in.param) x = normal(rng) * 0.5f;
  // A raw accumulator: a sum over tokens, larger than the scaled gradient by 1 / grad_scale.
  in.grads.resize(c.steps);
  for (std::vector<float>& g : in.grads) {
    g.resize(c.count());
    for (float& x : g) x = normal(rng) * 20.0f;
  }
  return in;
}

absl::Status RunOptimizerSteps(Backend& backend, const OptimizerCase& c,
                               const OptimizerInputs& inputs, OptimizerOutputs* out,
                               int64_t offset) {
  const int64_t n = c.count();
  const size_t el = DTypeSize(c.dtype);
  const bool fp32 = c.dtype == DType::kFP32;
  absl::StatusOr<std::unique_ptr<Stream>> stream_or = backend.CreateStream();
  if (!stream_or.ok()) return stream_or.status();
  Stream& stream = **stream_or;
  auto weight = backend.Allocate((n + offset) * el), master = backend.Allocate((n + offset) * 4),
       grad = backend.Allocate((n + offset) * 4), state_a = backend.Allocate((n + offset) * 4),
       state_b = backend.Allocate((n + offset) * 4);
  for (auto* b : {&weight, &master, &grad, &state_a, &state_b}) {
    if (!b->ok()) return b->status();
  }
  OptimizerTensors t;
  t.weight = static_cast<char*>(weight->data()) + offset * el;
  t.master = fp32 ? nullptr : master->as<float>() + offset;
  t.grad = grad->as<float>() + offset;
  const OptimizerKind kind = KindOf(c.options);
  float* a = state_a->as<float>() + offset;
  float* b = state_b->as<float>() + offset;
  (kind == OptimizerKind::kSgd ? t.momentum_buffer : t.exp_avg) = a;
  if (kind == OptimizerKind::kAdamW) t.exp_avg_sq = b;

  std::vector<uint8_t> weight_bytes(n * el);
  FromFloat(c.dtype, inputs.param.data(), weight_bytes.data(), n);
  absl::Status s;
  auto chk = [&](absl::Status st) {
    if (s.ok()) s = st;
  };
  chk(backend.CopyToDevice(t.weight, weight_bytes.data(), n * el, stream));
  if (!fp32) chk(backend.CopyToDevice(t.master, inputs.param.data(), n * 4, stream));
  chk(backend.Memset(a, 0, n * 4, stream));
  chk(backend.Memset(b, 0, n * 4, stream));
  for (int step = 1; step <= c.steps && s.ok(); ++step) {
    OptimizerProblem problem;
    problem.count = n;
    problem.dtype = c.dtype;
    problem.options = c.options;
    if (auto* sgd = std::get_if<SgdOptions>(&problem.options)) {
      sgd->init_momentum_buffer = step == 1;
    }
    problem.grad_scale = c.grad_scale;
    problem.step = step;
    chk(backend.CopyToDevice(t.grad, inputs.grads[step - 1].data(), n * 4, stream));
    chk(backend.OptimizerStep(problem, t, stream));
  }
  out->param.resize(n);
  out->weight.resize(n * el);
  out->grad.resize(n);
  out->state_a.resize(n);
  out->state_b.resize(n);
  const void* param = fp32 ? t.weight : t.master;
  chk(backend.CopyToHost(out->param.data(), param, n * 4, stream));
  chk(backend.CopyToHost(out->weight.data(), t.weight, n * el, stream));
  chk(backend.CopyToHost(out->grad.data(), t.grad, n * 4, stream));
  chk(backend.CopyToHost(out->state_a.data(), a, n * 4, stream));
  chk(backend.CopyToHost(out->state_b.data(), b, n * 4, stream));
  chk(stream.Synchronize());
  return s;
}

std::vector<OptimizerCase> StandardOptimizerCases() {
  struct Variant {
    std::string name;
    OptimizerOptions options;
  };
  const std::vector<Variant> variants = {
      {"AdamW", AdamWOptions{.lr = 1e-2f, .weight_decay = 0.1f}},
      // beta1 < 0.5: torch's lerp takes its other form (weight 1 - beta1 >= 0.5).
      {"AdamWLowBeta1",
       AdamWOptions{
           .lr = 1e-2f, .beta1 = 0.3f, .beta2 = 0.95f, .eps = 1e-6f, .weight_decay = 0.0f}},
      {"Sgd", SgdOptions{.lr = 1e-2f}},
      {"SgdWeightDecay", SgdOptions{.lr = 1e-2f, .weight_decay = 1e-2f}},
      {"SgdMomentumDampening",
       SgdOptions{.lr = 1e-2f, .momentum = 0.9f, .dampening = 0.1f, .weight_decay = 1e-2f}},
      {"SgdNesterov",
       SgdOptions{.lr = 1e-2f, .momentum = 0.9f, .nesterov = true, .weight_decay = 1e-2f}},
      {"Lion", LionOptions{.lr = 1e-3f, .weight_decay = 0.1f}},
  };
  struct Shape {
    int64_t rows, cols;
  };
  // 257 x 95: an odd element count (a scalar tail after the vectors); 64 x 128: whole vectors.
  const std::vector<Shape> shapes = {{257, 95}, {64, 128}};
  std::vector<OptimizerCase> cases;
  for (const Variant& v : variants) {
    for (DType dtype : {DType::kFP32, DType::kBF16, DType::kFP16}) {
      for (const Shape& shape : shapes) {
        OptimizerCase c;
        c.name = absl::StrCat(v.name, "_", DTypeName(dtype), "_", shape.rows, "x", shape.cols);
        c.options = v.options;
        c.dtype = dtype;
        c.rows = shape.rows;
        c.cols = shape.cols;
        // Lion moves every parameter by exactly lr each step, and each move rounds p once: 20
        // roundings that never average out as AdamW's and SGD's varied steps do.
        if (KindOf(v.options) == OptimizerKind::kLion) c.tolerance = 2e-6;
        cases.push_back(c);
      }
    }
  }
  return cases;
}

std::vector<float> RandomGradient(int64_t count, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<float> g(count);
  for (float& x : g) x = normal(rng);
  return g;
}

absl::StatusOr<double> SquaredNormOn(Backend& backend, const std::vector<float>& values,
                                     int64_t offset) {
  absl::StatusOr<std::unique_ptr<Stream>> stream = backend.CreateStream();
  if (!stream.ok()) return stream.status();
  absl::StatusOr<DeviceBuffer> data = backend.Allocate((values.size() + offset) * sizeof(float));
  absl::StatusOr<DeviceBuffer> result = backend.Allocate(sizeof(double));
  if (!data.ok()) return data.status();
  if (!result.ok()) return result.status();
  float* d = data->as<float>() + offset;
  absl::Status s = backend.CopyToDevice(d, values.data(), values.size() * sizeof(float), **stream);
  if (s.ok()) s = backend.SquaredNorm(d, values.size(), result->as<double>(), **stream);
  double out = 0.0;
  if (s.ok()) s = backend.CopyToHost(&out, result->data(), sizeof(double), **stream);
  if (s.ok()) s = (*stream)->Synchronize();
  if (!s.ok()) return s;
  return out;
}

uint64_t DoubleBits(double x) {
  uint64_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return bits;
}

double ScaledMaxError(const std::vector<float>& actual, const std::vector<double>& expected) {
  double worst = 0.0, scale = 0.0;
  for (size_t i = 0; i < expected.size(); ++i) {
    if (!std::isfinite(actual[i])) return INFINITY;
    worst = std::max(worst, std::abs(actual[i] - expected[i]));
    scale = std::max(scale, std::abs(expected[i]));
  }
  return scale > 0.0 ? worst / scale : worst;
}

}  // namespace losshead::kernels::testing
