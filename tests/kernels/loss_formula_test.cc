// The shared loss formula (kernels/common/loss_math.h) against an independent long-double
// evaluation of problem.h's definition, on fresh random rows: in double (as the CPU backend and
// the shard combination evaluate it) to double precision, in fp32 (as the CUDA row kernel does)
// to fp32 precision. The independent gradient is itself checked against central differences of
// the independent loss, so the oracle's derivative is not taken on trust either.
#include "tests/kernels/loss_formula.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/common/loss_math.h"

namespace losshead::kernels {
namespace {

using testing::EvaluateFormula;
using testing::FormulaCase;
using testing::Independent;
using testing::IndependentLoss;
using testing::IndependentResult;
using testing::RandomFormulaCases;

// The scale a token's terms live at: errors in lse of a few ulps grow with lse and with z_loss.
double Scale(const IndependentResult& want, const FormulaCase& c) {
  const double lse = std::fabs(static_cast<double>(want.lse));
  return (1.0 + lse) * (1.0 + 2.0 * c.options.z_loss * lse);
}

template <typename T>
void ExpectMatchesIndependent(const FormulaCase& c, double rel) {
  std::vector<T> grad(c.x.size());
  const testing::FormulaResult<T> got = EvaluateFormula<T>(c.x.data(), static_cast<int>(c.x.size()),
                                                           c.target, c.options, grad.data());
  const IndependentResult want = Independent(c);
  const double scale = Scale(want, c);
  EXPECT_NEAR(got.lse, static_cast<double>(want.lse), rel * scale);
  EXPECT_NEAR(got.loss, static_cast<double>(want.loss), rel * scale * scale);
  for (size_t j = 0; j < grad.size(); ++j) {
    ASSERT_NEAR(grad[j], static_cast<double>(want.grad[j]), rel * scale) << "class " << j;
  }
}

TEST(LossFormulaTest, DoubleMatchesTheIndependentEvaluation) {
  const std::vector<FormulaCase> cases = RandomFormulaCases(400, 101);
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE(i);
    ExpectMatchesIndependent<double>(cases[i], 1e-13);
  }
}

TEST(LossFormulaTest, Fp32MatchesTheIndependentEvaluation) {
  const std::vector<FormulaCase> cases = RandomFormulaCases(400, 102);
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE(i);
    // lse is a sum of up to 300 fp32 exps, rounded once more for the loss: a few 1e-6.
    ExpectMatchesIndependent<float>(cases[i], 2e-5);
  }
}

TEST(LossFormulaTest, EveryOptionAloneAndTheEdgesOfTheRow) {
  // One class; the target at either end; each option by itself; all of them at once.
  std::vector<FormulaCase> cases;
  cases.push_back({{3.5f}, 0, {0.0f, 0.0f, 0.0f}});
  cases.push_back({{3.5f}, 0, {0.3f, 1e-3f, 2.0f}});
  const std::vector<float> row = {-7.0f, 0.25f, 12.0f, -0.5f, 31.0f, 2.0f, -40.0f};
  for (int target : {0, 6}) {
    cases.push_back({row, target, {0.0f, 0.0f, 0.0f}});
    cases.push_back({row, target, {0.1f, 0.0f, 0.0f}});
    cases.push_back({row, target, {0.0f, 1e-2f, 0.0f}});
    cases.push_back({row, target, {0.0f, 0.0f, 15.0f}});
    cases.push_back({row, target, {0.2f, 1e-2f, 15.0f}});
  }
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE(i);
    ExpectMatchesIndependent<double>(cases[i], 1e-13);
    ExpectMatchesIndependent<float>(cases[i], 2e-5);
  }
}

TEST(LossFormulaTest, IndependentGradientIsTheDerivativeOfTheIndependentLoss) {
  const std::vector<FormulaCase> cases = RandomFormulaCases(40, 103);
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE(i);
    const FormulaCase& c = cases[i];
    const IndependentResult want = Independent(c);
    std::vector<long double> x(c.x.begin(), c.x.end());
    for (size_t j = 0; j < x.size(); ++j) {
      const long double h = 1e-5L * std::max(1.0L, std::fabs(x[j]));
      const long double keep = x[j];
      x[j] = keep + h;
      const long double up = IndependentLoss(x, c);
      x[j] = keep - h;
      const long double down = IndependentLoss(x, c);
      x[j] = keep;
      ASSERT_NEAR(static_cast<double>((up - down) / (2 * h)), static_cast<double>(want.grad[j]),
                  1e-7 * Scale(want, c))
          << "class " << j;
    }
  }
}

TEST(LossFormulaTest, OnlineCombineOfPartsGivesTheWholeRowsLse) {
  // The shard combination and the CUDA reductions rescale partial sums to a common max
  // (loss::Rescaled): any split of the row gives the whole row's lse.
  const std::vector<FormulaCase> cases = RandomFormulaCases(100, 104);
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE(i);
    const FormulaCase& c = cases[i];
    const IndependentResult want = Independent(c);
    const loss::BasicSoftcap<double> cap = loss::BasicSoftcap<double>::Of(c.options.softcap);
    const size_t parts = 1 + i % 5;
    std::vector<double> part_max(parts, -INFINITY), part_sum(parts, 0.0);
    for (size_t j = 0; j < c.x.size(); ++j) {
      const size_t r = j % parts;
      part_max[r] = std::max(part_max[r], cap(static_cast<double>(c.x[j])));
    }
    for (size_t j = 0; j < c.x.size(); ++j) {
      const size_t r = j % parts;
      part_sum[r] += loss::Exp(cap(static_cast<double>(c.x[j])) - part_max[r]);
    }
    double max = -INFINITY, sum = 0.0;
    for (size_t r = 0; r < parts; ++r) max = std::max(max, part_max[r]);
    for (size_t r = 0; r < parts; ++r) {
      if (part_sum[r] > 0.0) sum += loss::Rescaled(part_sum[r], part_max[r], max);
    }
    EXPECT_NEAR(loss::Lse(max, sum), static_cast<double>(want.lse), 1e-13 * Scale(want, c));
  }
}

TEST(LossFormulaTest, DistributionTermsWholeAndCombinedFromParts) {
  // The distribution outputs (problem.h's Arguments) from their loss_math.h terms, over the whole
  // row and over any split of it combined as shards would (RescaledShiftedZ, ArgmaxBeats with the
  // parts visited last to first), against -sum p log p, z_y - lse and the first max in long
  // double. Every other case rounds its logits to integers: exact ties, which the lowest id wins.
  const std::vector<FormulaCase> cases = RandomFormulaCases(200, 105);
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE(i);
    FormulaCase c = cases[i];
    if (i % 2 == 1) {
      for (float& x : c.x) x = std::round(x);
    }
    const loss::BasicSoftcap<double> cap = loss::BasicSoftcap<double>::Of(c.options.softcap);
    std::vector<double> z(c.x.size());
    for (size_t j = 0; j < z.size(); ++j) z[j] = cap(static_cast<double>(c.x[j]));
    long double z_max = -INFINITY, sum = 0.0L;
    size_t first_max = 0;
    for (size_t j = 0; j < z.size(); ++j) {
      if (z[j] > z_max) first_max = j;
      z_max = std::max(z_max, static_cast<long double>(z[j]));
    }
    for (double zj : z) sum += std::exp(zj - z_max);
    const long double lse = z_max + std::log(sum);
    long double entropy = 0.0L;
    for (double zj : z) entropy -= std::exp(zj - lse) * (zj - lse);

    const size_t parts = 1 + i % 5;
    std::vector<double> part_max(parts, -INFINITY), part_sum(parts, 0.0), part_s(parts, 0.0);
    std::vector<int64_t> part_argmax(parts, -1);
    for (size_t j = 0; j < z.size(); ++j) {
      const size_t r = j % parts;
      if (part_argmax[r] < 0 ||
          loss::ArgmaxBeats(z[j], static_cast<int64_t>(j), part_max[r], part_argmax[r])) {
        part_argmax[r] = static_cast<int64_t>(j);
      }
      part_max[r] = std::max(part_max[r], z[j]);
    }
    for (size_t j = 0; j < z.size(); ++j) {
      const size_t r = j % parts;
      const double e = loss::Exp(z[j] - part_max[r]);
      part_sum[r] += e;
      part_s[r] += loss::ShiftedZTerm(e, z[j] - part_max[r]);
    }
    double max = -INFINITY, sum_exp = 0.0, s = 0.0;
    int64_t argmax = -1;
    for (size_t r = parts; r-- > 0;) {
      if (part_argmax[r] < 0) continue;  // a part past the row's end
      if (argmax < 0 || loss::ArgmaxBeats(part_max[r], part_argmax[r], max, argmax)) {
        argmax = part_argmax[r];
      }
      max = std::max(max, part_max[r]);
    }
    for (size_t r = 0; r < parts; ++r) {
      if (part_argmax[r] < 0) continue;
      sum_exp += loss::Rescaled(part_sum[r], part_max[r], max);
      s += loss::RescaledShiftedZ(part_s[r], part_sum[r], part_max[r], max);
    }
    const double scale = 1.0 + std::fabs(static_cast<double>(lse));
    EXPECT_EQ(argmax, static_cast<int64_t>(first_max));
    EXPECT_NEAR(loss::Entropy(sum_exp, s), static_cast<double>(entropy), 1e-13 * scale);
    EXPECT_NEAR(loss::TargetLogProb(loss::Lse(max, sum_exp), z[c.target]),
                static_cast<double>(z[c.target] - lse), 1e-13 * scale);
  }
}

}  // namespace
}  // namespace losshead::kernels
