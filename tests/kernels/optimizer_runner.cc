#include "tests/kernels/optimizer_runner.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <utility>

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

absl::StatusOr<StepBuffersOn> StepBuffersOn::Allocate(Backend& backend, OptimizerKind kind,
                                                      DType dtype, int64_t count, int64_t offset) {
  StepBuffersOn b(backend, dtype, count);
  const size_t el = DTypeSize(dtype);
  const size_t n = static_cast<size_t>(count + offset);
  for (auto [buffer, bytes] :
       {std::pair{&b.weight_, n * el}, std::pair{&b.master_, n * 4}, std::pair{&b.grad_, n * 4},
        std::pair{&b.a_, n * 4}, std::pair{&b.b_, n * 4}}) {
    absl::StatusOr<DeviceBuffer> allocated = backend.Allocate(bytes);
    if (!allocated.ok()) return allocated.status();
    *buffer = std::move(*allocated);
  }
  OptimizerTensors& t = b.tensors;
  t.weight = static_cast<char*>(b.weight_.data()) + offset * el;
  t.master = dtype == DType::kFP32 ? nullptr : b.master_.as<float>() + offset;
  t.grad = b.grad_.as<float>() + offset;
  b.state_a = b.a_.as<float>() + offset;
  b.state_b = b.b_.as<float>() + offset;
  (kind == OptimizerKind::kSgd ? t.momentum_buffer : t.exp_avg) = b.state_a;
  if (kind == OptimizerKind::kAdamW) t.exp_avg_sq = b.state_b;
  return b;
}

absl::Status StepBuffersOn::Upload(const std::vector<float>& param, const std::vector<float>& grad,
                                   const std::vector<float>& a, const std::vector<float>& b,
                                   Stream& stream) {
  const size_t n = static_cast<size_t>(count_);
  const size_t el = DTypeSize(dtype_);
  std::vector<uint8_t> weight_bytes(n * el);
  FromFloat(dtype_, param.data(), weight_bytes.data(), n);
  absl::Status s = backend_->CopyToDevice(tensors.weight, weight_bytes.data(), n * el, stream);
  if (s.ok() && tensors.master != nullptr) {
    s = backend_->CopyToDevice(tensors.master, param.data(), n * 4, stream);
  }
  for (auto [dst, src] :
       {std::pair{tensors.grad, &grad}, std::pair{state_a, &a}, std::pair{state_b, &b}}) {
    if (!s.ok()) break;
    s = src->empty() ? backend_->Memset(dst, 0, n * 4, stream)
                     : backend_->CopyToDevice(dst, src->data(), n * 4, stream);
  }
  // The host vectors must outlive the copies.
  return s.ok() ? stream.Synchronize() : s;
}

absl::Status StepBuffersOn::Download(OptimizerOutputs* out, Stream& stream) {
  const size_t n = static_cast<size_t>(count_);
  const size_t el = DTypeSize(dtype_);
  out->param.resize(n);
  out->weight.resize(n * el);
  out->grad.resize(n);
  out->state_a.resize(n);
  out->state_b.resize(n);
  const void* param = tensors.master != nullptr ? tensors.master : tensors.weight;
  absl::Status s = backend_->CopyToHost(out->param.data(), param, n * 4, stream);
  if (s.ok()) s = backend_->CopyToHost(out->weight.data(), tensors.weight, n * el, stream);
  if (s.ok()) s = backend_->CopyToHost(out->grad.data(), tensors.grad, n * 4, stream);
  if (s.ok()) s = backend_->CopyToHost(out->state_a.data(), state_a, n * 4, stream);
  if (s.ok()) s = backend_->CopyToHost(out->state_b.data(), state_b, n * 4, stream);
  return s.ok() ? stream.Synchronize() : s;
}

absl::Status RunOptimizerSteps(Backend& backend, const OptimizerCase& c,
                               const OptimizerInputs& inputs, OptimizerOutputs* out,
                               int64_t offset) {
  absl::StatusOr<std::unique_ptr<Stream>> stream = backend.CreateStream();
  if (!stream.ok()) return stream.status();
  absl::StatusOr<StepBuffersOn> buffers =
      StepBuffersOn::Allocate(backend, KindOf(c.options), c.dtype, c.count(), offset);
  if (!buffers.ok()) return buffers.status();
  absl::Status s = buffers->Upload(inputs.param, {}, {}, {}, **stream);
  for (int step = 1; step <= c.steps && s.ok(); ++step) {
    OptimizerProblem problem;
    problem.count = c.count();
    problem.dtype = c.dtype;
    problem.options = c.options;
    if (auto* sgd = std::get_if<SgdOptions>(&problem.options)) {
      sgd->init_momentum_buffer = step == 1;
    }
    problem.grad_scale = c.grad_scale;
    problem.step = step;
    s = backend.CopyToDevice(buffers->tensors.grad, inputs.grads[step - 1].data(), c.count() * 4,
                             **stream);
    if (s.ok()) s = backend.OptimizerStep(problem, buffers->tensors, **stream);
  }
  return s.ok() ? buffers->Download(out, **stream) : s;
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
