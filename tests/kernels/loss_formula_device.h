// The shared loss formula and reductions evaluated on a CUDA device, for loss_formula_cuda_test.cc:
// plain host entry points, so that the test itself is an ordinary C++ file.
#ifndef LOSSHEAD_TESTS_KERNELS_LOSS_FORMULA_DEVICE_H_
#define LOSSHEAD_TESTS_KERNELS_LOSS_FORMULA_DEVICE_H_

#include <string>
#include <vector>

#include "tests/kernels/loss_formula.h"

namespace losshead::kernels::testing {

// CUDA devices this process sees (0 when the runtime finds none or fails).
int VisibleCudaDevices();

// One case's evaluation on the device: EvaluateFormula<float> and EvaluateFormula<double>, one
// thread per case.
struct DeviceFormula {
  FormulaResult<float> fp32;
  FormulaResult<double> fp64;
  std::vector<float> grad_fp32;
  std::vector<double> grad_fp64;
};

// One case's row statistics from the CUDA reductions (reduce.cuh): one block of 256 threads per
// case, each thread taking every 256th logit into a SoftmaxState<true> (kVec-wide where it can),
// the block's states combined as the row kernels combine them.
struct DeviceRowStats {
  float max = 0.0f;
  float sum_exp = 0.0f;  // sum of exp(z - max)
  float sum_z = 0.0f;
  float z_target = 0.0f;
};

// Fills `out` with one entry per case; returns "" or what failed.
std::string EvaluateFormulaOnDevice(const std::vector<FormulaCase>& cases,
                                    std::vector<DeviceFormula>* out);
std::string ReduceRowsOnDevice(const std::vector<FormulaCase>& cases,
                               std::vector<DeviceRowStats>* out);

}  // namespace losshead::kernels::testing

#endif  // LOSSHEAD_TESTS_KERNELS_LOSS_FORMULA_DEVICE_H_
