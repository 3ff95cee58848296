// The CPU backend's row math, shared by the whole-vocabulary row (row_loss.cc) and a vocabulary
// shard's rows (shard_rows.cc): the soft-cap of a row in place, its max and sums, and its logit
// gradient. The formula itself is loss_math.h's; this header only walks a row with it, in index
// order, so that a row's sums come out the same whichever path computes them.
#ifndef LOSSHEAD_KERNELS_CPU_ROW_MATH_H_
#define LOSSHEAD_KERNELS_CPU_ROW_MATH_H_

#include <algorithm>
#include <cstdint>
#include <limits>

#include "kernels/common/loss_math.h"

namespace losshead::kernels::cpu {

// Overwrites x_j with z_j = softcap(x_j); nothing when the soft-cap is off.
inline void SoftcapRow(float* row, int64_t n, const loss::Softcap& cap) {
  if (!cap.on()) return;
  for (int64_t j = 0; j < n; ++j) row[j] = cap.Apply(row[j]);
}

// A row's max z (fp32), sum of z and sum of exp(z - max) (both summed in double, in index order,
// exp evaluated in fp32). n >= 1.
struct RowSums {
  float max_z = -std::numeric_limits<float>::infinity();
  double sum_z = 0.0;
  double sum_exp = 0.0;
};

inline RowSums SumRow(const float* z, int64_t n) {
  RowSums sums;
  for (int64_t j = 0; j < n; ++j) {
    sums.max_z = std::max(sums.max_z, z[j]);
    sums.sum_z += z[j];
  }
  for (int64_t j = 0; j < n; ++j) sums.sum_exp += loss::Exp(z[j] - sums.max_z);
  return sums;
}

// SumRow's statistics and, for the distribution outputs, s = sum_j ShiftedZTerm(e_j, z_j - max)
// (loss_math.h's Entropy, summed in double in index order) and the argmax (the lowest index of the
// max). The statistics SumRow computes come out bit for bit as SumRow computes them: the same
// operations on the same values in the same order, the extra sums beside them.
struct RowDistributionSums {
  RowSums sums;
  double sum_shifted_z = 0.0;
  int64_t argmax = 0;
};

inline RowDistributionSums SumRowDistribution(const float* z, int64_t n) {
  RowDistributionSums out;
  RowSums& sums = out.sums;
  float best = z[0];
  for (int64_t j = 0; j < n; ++j) {
    sums.max_z = std::max(sums.max_z, z[j]);
    sums.sum_z += z[j];
    if (loss::ArgmaxBeats(z[j], j, best, out.argmax)) {
      best = z[j];
      out.argmax = j;
    }
  }
  for (int64_t j = 0; j < n; ++j) {
    const float shifted = z[j] - sums.max_z;
    const float e = loss::Exp(shifted);
    sums.sum_exp += e;
    out.sum_shifted_z += loss::ShiftedZTerm(static_cast<double>(e), static_cast<double>(shifted));
  }
  return out;
}

// The top k of a row of z (k in [1, kMaxTopK]) in ArgmaxBeats's order (larger z first, then the
// lower id), ids counted from id_offset: a sorted list of at most k candidates, a new one inserted
// only when it beats the last. `count` = min(k, n) entries are filled. Also merges candidate
// lists (shards'): Offer each candidate; the result does not depend on the order of the offers.
struct RowTopK {
  int k = 0;
  int count = 0;
  float z[kMaxTopK];
  int64_t id[kMaxTopK];

  void Offer(float zj, int64_t idj) {
    if (count == k && !loss::ArgmaxBeats(zj, idj, z[k - 1], id[k - 1])) return;
    int pos = count < k ? count++ : k - 1;
    while (pos > 0 && loss::ArgmaxBeats(zj, idj, z[pos - 1], id[pos - 1])) {
      z[pos] = z[pos - 1];
      id[pos] = id[pos - 1];
      --pos;
    }
    z[pos] = zj;
    id[pos] = idj;
  }
};

inline RowTopK TopKRow(const float* z, int64_t n, int k, int64_t id_offset) {
  RowTopK top;
  top.k = k;
  for (int64_t j = 0; j < n; ++j) top.Offer(z[j], id_offset + j);
  return top;
}

// How z / cap is formed for the soft-cap's slope: the whole-vocabulary row multiplies by 1 / cap
// (as the CUDA kernels do); a shard's row has always divided, and keeps its bits.
enum class CapRatio { kTimesInverse, kDivided };

// Overwrites a row of z with dloss/dx_j: loss::LogitGrad of e = exp(z_j - shift) with the target
// at column `target` (none when outside [0, n)), times the soft-cap's slope when it is on.
template <CapRatio kRatio>
inline void WriteRowGradient(float* z, int64_t n, int64_t target, float shift,
                             const loss::GradFactors& f, const loss::Softcap& cap) {
  if (cap.on()) {
    for (int64_t j = 0; j < n; ++j) {
      const float ratio = kRatio == CapRatio::kDivided ? z[j] / cap.cap : z[j] * cap.inv_cap;
      const float g = loss::LogitGrad(f, loss::Exp(z[j] - shift), j == target);
      z[j] = g * loss::SoftcapSlope(ratio);
    }
  } else {
    for (int64_t j = 0; j < n; ++j) z[j] = loss::LogitGrad(f, loss::Exp(z[j] - shift), j == target);
  }
}

// Overwrites u_j = h . w_j with x_j = loss::ScaledLogit(u_j, scale, bias_j): only the parts that
// are on (scale != 1, a bias), so a row without either is left as it is.
inline void ScaleBiasRow(float* row, int64_t n, float scale, const float* bias) {
  if (bias != nullptr && scale != 1.0f) {
    for (int64_t j = 0; j < n; ++j) row[j] = loss::ScaledLogit(row[j], scale, bias[j]);
  } else if (bias != nullptr) {
    for (int64_t j = 0; j < n; ++j) row[j] += bias[j];
  } else if (scale != 1.0f) {
    for (int64_t j = 0; j < n; ++j) row[j] *= scale;
  }
}

// WriteRowGradient (kTimesInverse) with the entropy term's gradient added to each class's.
inline void WriteRowGradientWithEntropy(float* z, int64_t n, int64_t target, float shift,
                                        const loss::GradFactors& f, const loss::EntropyGrad& h,
                                        const loss::Softcap& cap) {
  for (int64_t j = 0; j < n; ++j) {
    const float shifted = z[j] - shift;
    const float e = loss::Exp(shifted);
    const float g = loss::LogitGrad(f, e, j == target) + loss::EntropyLogitGrad(h, e, shifted);
    z[j] = cap.on() ? g * loss::SoftcapSlope(z[j] * cap.inv_cap) : g;
  }
}

}  // namespace losshead::kernels::cpu

#endif  // LOSSHEAD_KERNELS_CPU_ROW_MATH_H_
