// The shared loss formula (kernels/common/loss_math.h) evaluated on a CUDA device against the
// same functions evaluated on the host and against the independent long-double evaluation, and
// the CUDA reductions (kernels/cuda/reduce.cuh) against the host's row statistics: CPU and CUDA
// agree through the one formula. Skips without a GPU.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/common/loss_math.h"
#include "tests/kernels/loss_formula.h"
#include "tests/kernels/loss_formula_device.h"

namespace losshead::kernels {
namespace {

using testing::DeviceFormula;
using testing::DeviceRowStats;
using testing::EvaluateFormula;
using testing::FormulaCase;
using testing::FormulaResult;
using testing::Independent;
using testing::IndependentResult;
using testing::RandomFormulaCases;

#define LOSSHEAD_NEED_GPU()               \
  if (testing::VisibleCudaDevices() == 0) \
  GTEST_SKIP() << "no CUDA device visible: the CUDA suite needs a GPU"

double Scale(const IndependentResult& want, const FormulaCase& c) {
  const double lse = std::fabs(static_cast<double>(want.lse));
  return (1.0 + lse) * (1.0 + 2.0 * c.options.z_loss * lse);
}

// Device and host evaluations of one precision, and each against the independent one. The
// device's fp32 exp is __expf (a few ulps more than the host's expf), its fp64 exp and log are
// within an ulp of the host's and it may fuse a * b + c: agreement to the precision's level.
template <typename T>
void ExpectAgree(const FormulaCase& c, const FormulaResult<T>& device,
                 const std::vector<T>& device_grad, double rel) {
  std::vector<T> host_grad(c.x.size());
  const FormulaResult<T> host = EvaluateFormula<T>(c.x.data(), static_cast<int>(c.x.size()),
                                                   c.target, c.options, host_grad.data());
  const IndependentResult want = Independent(c);
  const double scale = Scale(want, c);
  EXPECT_NEAR(device.lse, host.lse, rel * scale);
  EXPECT_NEAR(device.loss, host.loss, rel * scale * scale);
  EXPECT_NEAR(device.lse, static_cast<double>(want.lse), rel * scale);
  EXPECT_NEAR(device.loss, static_cast<double>(want.loss), rel * scale * scale);
  ASSERT_EQ(device_grad.size(), host_grad.size());
  for (size_t j = 0; j < host_grad.size(); ++j) {
    ASSERT_NEAR(device_grad[j], host_grad[j], rel * scale) << "class " << j;
    ASSERT_NEAR(device_grad[j], static_cast<double>(want.grad[j]), rel * scale) << "class " << j;
  }
}

TEST(LossFormulaCudaTest, DeviceAgreesWithHostAndIndependentEvaluation) {
  LOSSHEAD_NEED_GPU();
  std::vector<FormulaCase> cases = RandomFormulaCases(300, 201);
  // Each option alone on one row, and a single class.
  const std::vector<float> row = {-7.0f, 0.25f, 12.0f, -0.5f, 31.0f, 2.0f, -40.0f};
  cases.push_back({row, 6, {0.1f, 0.0f, 0.0f}});
  cases.push_back({row, 0, {0.0f, 1e-2f, 0.0f}});
  cases.push_back({row, 3, {0.0f, 0.0f, 15.0f}});
  cases.push_back({{3.5f}, 0, {0.3f, 1e-3f, 2.0f}});
  std::vector<DeviceFormula> device;
  const std::string error = testing::EvaluateFormulaOnDevice(cases, &device);
  ASSERT_EQ(error, "");
  ASSERT_EQ(device.size(), cases.size());
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE(i);
    ExpectAgree<float>(cases[i], device[i].fp32, device[i].grad_fp32, 5e-5);
    ExpectAgree<double>(cases[i], device[i].fp64, device[i].grad_fp64, 1e-12);
  }
}

TEST(LossFormulaCudaTest, BlockReductionGivesTheRowsStatistics) {
  LOSSHEAD_NEED_GPU();
  const std::vector<FormulaCase> cases = RandomFormulaCases(200, 202);
  std::vector<DeviceRowStats> device;
  const std::string error = testing::ReduceRowsOnDevice(cases, &device);
  ASSERT_EQ(error, "");
  ASSERT_EQ(device.size(), cases.size());
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE(i);
    const FormulaCase& c = cases[i];
    const IndependentResult want = Independent(c);
    const loss::Softcap cap = loss::Softcap::Of(c.options.softcap);
    float max = -INFINITY;
    double sum_z = 0.0, sum_abs_z = 0.0;
    for (float x : c.x) {
      max = std::max(max, cap(x));
      sum_z += cap(x);
      sum_abs_z += std::fabs(cap(x));
    }
    // The max and the target's z are single z values: the device's tanhf is within a few ulps of
    // the host's (exact without the soft-cap). The sums are fp32 over up to 300 terms.
    EXPECT_NEAR(device[i].max, max, 1e-6 * std::fabs(max));
    const float z_target = cap(c.x[c.target]);
    EXPECT_NEAR(device[i].z_target, z_target, 1e-6 * std::fabs(z_target));
    EXPECT_NEAR(device[i].sum_z, sum_z, 1e-5 * sum_abs_z + 1e-6);
    const double lse = device[i].max + std::log(static_cast<double>(device[i].sum_exp));
    EXPECT_NEAR(lse, static_cast<double>(want.lse), 1e-5 * Scale(want, c));
  }
}

}  // namespace
}  // namespace losshead::kernels
