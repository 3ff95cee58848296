#include "tests/recovery/optimizer_trainer.h"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <utility>

#include "absl/strings/str_cat.h"

namespace losshead::testing {
namespace {

// The trunk's squared gradient norm at `step`: it varies, so that some applies clip and some
// do not, and the coefficient depends on the server adding it to the head's norm.
double TrunkSquaredNorm(int step) { return 0.002 * (1 + step % 3); }

}  // namespace

OptimizerTrainer::OptimizerTrainer(const OptimizerTrainConfig& config)
    : config_(config), sender_(config.run) {}

double OptimizerTrainer::LearningRate(int step) const {
  // Warm-up, then cosine down to a tenth of the peak (what torch's LinearLR + CosineAnnealingLR
  // would hand the optimizer's param group).
  if (step < config_.warmup_steps) return config_.peak_lr * (step + 1) / config_.warmup_steps;
  const double span = std::max(1, config_.run.steps - config_.warmup_steps);
  const double t = (step - config_.warmup_steps) / span;
  return config_.peak_lr * (0.1 + 0.9 * 0.5 * (1 + std::cos(std::numbers::pi * t)));
}

v1::ApplyOptimizerRequest OptimizerTrainer::Request(int step) const {
  v1::ApplyOptimizerRequest r;
  r.set_head(kTrainHead);
  r.set_client_id(kApplyClientId);
  r.set_step_key(static_cast<uint64_t>(step) + 1);
  v1::OptimizerHyperParams& p = *r.mutable_params();
  p.set_lr(LearningRate(step));
  p.set_weight_decay(config_.weight_decay);
  p.set_beta1(config_.beta1);
  p.set_beta2(config_.beta2);
  p.set_eps(config_.eps);
  r.set_max_norm(config_.max_norm);
  r.set_trunk_grad_sq_norm(TrunkSquaredNorm(step));
  r.set_expected_weights_version(static_cast<uint64_t>(step) + 2);
  return r;
}

absl::Status OptimizerTrainer::EnsureHead(client::Client& client, v1::HeadInfo* info) {
  absl::StatusOr<v1::HeadInfo> got = client.GetHead(kTrainHead);
  if (absl::IsNotFound(got.status())) {
    // Nothing of the head was checkpointed before a crash: start over, as a trainer would.
    v1::HeadSpec spec;
    spec.set_name(kTrainHead);
    spec.set_vocab_size(config_.run.vocab);
    spec.set_hidden_size(config_.run.hidden);
    spec.set_weight_dtype(config_.run.dtype);
    *spec.mutable_placement() = config_.run.placement;
    spec.mutable_optimizer()->set_kind(v1::OPTIMIZER_ADAMW);
    got = client.CreateHead(spec);
  }
  if (!got.ok()) return got.status();
  *info = *got;
  return absl::OkStatus();
}

absl::Status OptimizerTrainer::Apply(client::Client& client, int step, const Hook& hook) {
  const v1::ApplyOptimizerRequest request = Request(step);
  const uint64_t key = request.step_key();
  if (absl::Status s = hook({TrainEvent::kApplying, step, 0, key}); !s.ok()) return s;
  (apply_sent_[key]++ == 0 ? apply_sends_ : apply_resends_) += 1;
  absl::StatusOr<v1::ApplyOptimizerResponse> r = client.ApplyOptimizer(request);
  if (!r.ok()) return r.status();
  if (absl::Status s = hook({TrainEvent::kApplyAnswered, step, 0, key}); !s.ok()) return s;
  if (r->replayed()) ++apply_replays_;
  r->set_replayed(false);
  auto [it, first] = applies_.emplace(key, *r);
  if (!first) {
    if (it->second.SerializeAsString() != r->SerializeAsString()) ++mismatched_applies_;
    later_applies_.emplace_back(key, *r);
  }
  last_answered_key_ = key;
  // Each apply steps exactly once, over exactly its step's micro-batches.
  if (r->optimizer_step() != key || r->weights_version() != key + 2 ||
      r->window().microbatch_count() != static_cast<uint64_t>(config_.run.per_step)) {
    return absl::InternalError(absl::StrCat("apply ", key, " answered ", r->ShortDebugString()));
  }
  return hook({TrainEvent::kApplied, step, 0, key});
}

absl::Status OptimizerTrainer::Run(client::Client& client, const Hook& hook) {
  bool first_round = true;
  while (true) {
    v1::HeadInfo info;
    if (absl::Status s = EnsureHead(client, &info); !s.ok()) return s;
    const uint64_t version = info.weights_version();
    if (version == 1) {
      const client::Bytes w = Encode(
          RandomValues(config_.run.vocab * config_.run.hidden, 0.1, config_.run.dtype, /*seed=*/7),
          config_.run.dtype);
      absl::StatusOr<uint64_t> pushed = client.PushWeights({.head = kTrainHead,
                                                            .dtype = config_.run.dtype,
                                                            .data = w,
                                                            .expected_weights_version = 1});
      // FAILED_PRECONDITION: an earlier attempt of this push landed; the next round sees it.
      if (!pushed.ok() && !absl::IsFailedPrecondition(pushed.status())) return pushed.status();
      continue;
    }
    const uint64_t done = info.optimizer_step();
    // Only this run moves the head: the push made version 2, each apply one more.
    if (version != done + 2) {
      return absl::InternalError(
          absl::StrCat("weights version ", version, " after ", done, " applies"));
    }
    if (first_round) {
      first_round = false;
      if (last_answered_key_ > done) {
        lost_applies_ += static_cast<int>(last_answered_key_ - done);
        last_answered_key_ = done;
      }
    }
    if (done > 0 && !applies_.contains(done)) {
      // The last apply landed but its answer never came: ask again with its key.
      if (absl::Status s = Apply(client, static_cast<int>(done) - 1, hook); !s.ok()) return s;
      continue;
    }
    absl::StatusOr<v1::ClientProgress> progress = client.GetClientProgress(kTrainHead, kClientId);
    if (!progress.ok()) return progress.status();
    const uint64_t acknowledged =
        progress->has_acknowledged_sequence() ? progress->acknowledged_sequence() : 0;
    const int step = static_cast<int>(done);
    if (absl::Status s = sender_.SendFrom(client, step, acknowledged, hook); !s.ok()) return s;
    if (step == config_.run.steps) return absl::OkStatus();
    if (absl::Status s = Apply(client, step, hook); !s.ok()) return s;
  }
}

}  // namespace losshead::testing
