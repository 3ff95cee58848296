// Test helpers for the optimizer step: random starting weights and per-step gradients, and a run
// of several steps through the public Backend API with every buffer brought back to the host.
#ifndef LOSSHEAD_TESTS_KERNELS_OPTIMIZER_RUNNER_H_
#define LOSSHEAD_TESTS_KERNELS_OPTIMIZER_RUNNER_H_

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "losshead/kernels/backend.h"
#include "losshead/kernels/optimizer.h"

namespace losshead::kernels::testing {

// One optimizer, dtype and shape, run for `steps` steps from a fresh state.
struct OptimizerCase {
  std::string name;  // says optimizer, variant, dtype and shape
  OptimizerOptions options;
  DType dtype = DType::kFP32;
  int64_t rows = 0;  // V
  int64_t cols = 0;  // D
  float grad_scale = 0.04f;
  int steps = 20;
  // Against the float64 reference, relative to the tensor's largest value (ScaledMaxError).
  double tolerance = 1e-6;
  int64_t count() const { return rows * cols; }
};

inline void PrintTo(const OptimizerCase& c, std::ostream* os) { *os << c.name; }

// Starting fp32 parameters and one raw gradient per step, none of them zero.
struct OptimizerInputs {
  std::vector<float> param;
  std::vector<std::vector<float>> grads;
};

OptimizerInputs MakeOptimizerInputs(const OptimizerCase& c, uint64_t seed);

// Host copies of every buffer after the last step.
struct OptimizerOutputs {
  std::vector<float> param;     // the master (the weights themselves for fp32)
  std::vector<uint8_t> weight;  // raw weights in the case's dtype
  std::vector<float> grad;      // dW after the last step
  std::vector<float> state_a;   // exp_avg or momentum_buffer
  std::vector<float> state_b;   // exp_avg_sq
};

// One step's buffers in a backend's memory, each `offset` elements into its allocation (an
// offset of 1 misaligns them for vector loads), wired into `tensors` for an optimizer of `kind`
// over `count` weights of `dtype` (SGD's momentum buffer is state a, AdamW's exp_avg_sq state b).
class StepBuffersOn {
 public:
  static absl::StatusOr<StepBuffersOn> Allocate(Backend& backend, OptimizerKind kind, DType dtype,
                                                int64_t count, int64_t offset = 0);
  // The weights as `param` rounded to the dtype, the master (16-bit weights) as `param`, dW as
  // `grad` and the state as `a` and `b`; an empty vector leaves that buffer zero.
  absl::Status Upload(const std::vector<float>& param, const std::vector<float>& grad,
                      const std::vector<float>& a, const std::vector<float>& b, Stream& stream);
  // Every buffer to the host, then a synchronize.
  absl::Status Download(OptimizerOutputs* out, Stream& stream);

  OptimizerTensors tensors;
  float* state_a = nullptr;
  float* state_b = nullptr;

 private:
  StepBuffersOn(Backend& backend, DType dtype, int64_t count)
      : backend_(&backend), dtype_(dtype), count_(count) {}
  Backend* backend_;
  DType dtype_;
  int64_t count_;
  DeviceBuffer weight_, master_, grad_, a_, b_;
};

// Runs the case's steps on `backend`: the weights start as the parameters rounded to the dtype,
// the state at zero, and dW is overwritten with the step's gradient before each step. SGD sets
// init_momentum_buffer on step 1. Every buffer starts `offset` elements into its allocation (an
// offset of 1 makes the buffers misaligned for vector loads).
absl::Status RunOptimizerSteps(Backend& backend, const OptimizerCase& c,
                               const OptimizerInputs& inputs, OptimizerOutputs* out,
                               int64_t offset = 0);

// The cases both backends' suites run: every optimizer and variant, every dtype, two shapes.
std::vector<OptimizerCase> StandardOptimizerCases();

// `count` values ~ N(0, 3^2): a raw gradient accumulator for the norm's tests.
std::vector<float> RandomGradient(int64_t count, uint64_t seed);

// Backend::SquaredNorm of `values`, copied into the backend's memory `offset` floats into an
// allocation (an offset of 1 misaligns them for vector loads) and brought back to the host.
absl::StatusOr<double> SquaredNormOn(Backend& backend, const std::vector<float>& values,
                                     int64_t offset = 0);

// The bits of a double, to compare results exactly (NaN included).
uint64_t DoubleBits(double x);

// max |actual - expected| / max |expected|: relative to the tensor's scale, so that an element
// that passes through zero is not judged on its own tiny magnitude.
double ScaledMaxError(const std::vector<float>& actual, const std::vector<double>& expected);

}  // namespace losshead::kernels::testing

#endif  // LOSSHEAD_TESTS_KERNELS_OPTIMIZER_RUNNER_H_
