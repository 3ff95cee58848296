// A faulted run against the fault-free one: bit for bit where dW is accumulated directly on one
// device, within summation order with deferred dW (see DwAccumulation) or over several devices
// (a replicated head sums its replicas' dW, a sharded one combines its shards' statistics).
#ifndef LOSSHEAD_TESTS_RECOVERY_RUN_COMPARISON_H_
#define LOSSHEAD_TESTS_RECOVERY_RUN_COMPARISON_H_

#include <string>

#include "losshead/client/client.h"
#include "losshead/v1/losshead.pb.h"
#include "tests/recovery/recovery_process.h"

namespace losshead::testing {

// max |got - want| over the elements as a fraction of max |want|: 0 when equal, infinite when the
// sizes differ or only `got` is nonzero.
double RelativeDeviation(const client::Bytes& got, const client::Bytes& want, v1::DType dtype);

// Each call adds a gtest failure when `got` is not close enough to `want`, and keeps the largest
// deviation seen for the test's figures.
//
// The bound where not exact: each tensor within ToleranceFor(dtype) of its largest magnitude (fp32:
// 1e-4, bf16: 1e-2), which covers fp32 rounding and, for a bf16 head, W elements tipped to the
// neighbouring bf16 value; losses and norms within the dtype's relative loss tolerance. A
// micro-batch lost or counted twice moves a step's dW by a share of its micro-batches, far beyond
// that, and the counters, which every caller compares exactly, catch it as well.
class RunComparison {
 public:
  explicit RunComparison(DwAccumulation accumulation, bool one_device = true)
      : exact_(accumulation == DwAccumulation::kDirect && one_device) {}

  void Tensor(const client::Bytes& got, const client::Bytes& want, v1::DType dtype,
              const std::string& what);
  // Loss and dH of one micro-batch of a `dtype` head.
  void Answer(const client::StepResult& got, const client::StepResult& want, v1::DType dtype,
              const std::string& what);
  // A sum over the window (a loss, a norm), computed in fp32 or fp64 from dtype inputs.
  void Sum(double got, double want, v1::DType dtype, const std::string& what);

  bool exact() const { return exact_; }
  // The largest deviation seen, as a fraction of the compared value's magnitude.
  double worst() const { return worst_; }

 private:
  const bool exact_;
  double worst_ = 0;
};

}  // namespace losshead::testing

#endif  // LOSSHEAD_TESTS_RECOVERY_RUN_COMPARISON_H_
