#include "tests/recovery/trainer.h"

#include <algorithm>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"

namespace losshead::testing {

MicrobatchSender::MicrobatchSender(const TrainConfig& config) : per_step_(config.per_step) {
  for (int s = 0; s <= config.steps; ++s) {
    for (int k = 0; k < config.per_step; ++k) {
      const uint64_t seq = Sequence(s, k);
      batches_.emplace(seq, MakeBatch(config.tokens, config.hidden, config.vocab, config.dtype,
                                      /*seed=*/1000 + seq, /*ignore_every=*/5));
    }
  }
}

absl::Status MicrobatchSender::SendFrom(client::Client& client, int step, uint64_t acknowledged,
                                        const Hook& hook) {
  absl::StatusOr<std::unique_ptr<client::StepStream>> stream = client.OpenStepStream();
  if (!stream.ok()) return stream.status();
  std::vector<std::pair<int, uint64_t>> pending;
  for (int k = 0; k < per_step_; ++k) {
    const uint64_t seq = Sequence(step, k);
    // In the server's state and answered: nothing to do. In its state but never answered (the
    // answer was lost with the connection): resend for the dH; the server replays it.
    if (seq <= acknowledged && answers_.contains(seq)) continue;
    if (absl::Status s = (*stream)->Send(ToMicrobatch(kTrainHead, kClientId, seq, batch(seq)));
        !s.ok()) {
      return s;
    }
    (sent_[seq]++ == 0 ? first_sends_ : resends_) += 1;
    pending.emplace_back(k, seq);
  }
  for (const auto& [k, seq] : pending) {
    absl::StatusOr<client::StepResult> r = (*stream)->Receive();
    if (!r.ok()) return r.status();
    if (r->sequence != seq) return absl::InternalError("answers out of order");
    if (r->replayed) ++replays_;
    auto [it, first] = answers_.emplace(seq, *r);
    if (!first) {
      if (it->second.loss_sum != r->loss_sum || it->second.loss != r->loss ||
          it->second.grad_hidden != r->grad_hidden) {
        ++mismatched_;
      }
      later_answers_.emplace_back(seq, *r);
    }
    max_answered_ = std::max(max_answered_, seq);
    if (absl::Status s = hook({TrainEvent::kAnswered, step, k, seq}); !s.ok()) {
      (*stream)->Cancel();
      return s;
    }
  }
  return (*stream)->Finish();
}

absl::StatusOr<FinalState> ReadFinal(client::Client& client) {
  FinalState f;
  absl::StatusOr<client::DownloadedWeights> w = client.DownloadWeights(kTrainHead);
  if (!w.ok()) return w.status();
  absl::StatusOr<client::PulledGradient> g =
      client.PullGradient(kTrainHead, v1::DTYPE_FP32, /*reset=*/false);
  if (!g.ok()) return g.status();
  absl::StatusOr<v1::HeadInfo> info = client.GetHead(kTrainHead);
  if (!info.ok()) return info.status();
  f.weights = std::move(w->data);
  f.gradient = std::move(g->data);
  f.weights_version = info->weights_version();
  f.tokens_total = info->tokens_total();
  f.microbatches_total = info->microbatches_total();
  f.tokens_since_pull = info->tokens_since_pull();
  f.optimizer_step = info->optimizer_step();
  return f;
}

Trainer::Trainer(const TrainConfig& config) : config_(config), sender_(config) {
  // Version 1 is the zero W of a new head; the trainer's first push makes version 2.
  master_[2] = RandomValues(static_cast<size_t>(config.vocab * config.hidden), 0.1, config.dtype,
                            /*seed=*/7);
}

absl::Status Trainer::EnsureHead(client::Client& client, v1::HeadInfo* info) {
  absl::StatusOr<v1::HeadInfo> got = client.GetHead(kTrainHead);
  if (absl::IsNotFound(got.status())) {
    // Nothing of the head was checkpointed before a crash: start over, as a trainer would.
    v1::HeadSpec spec;
    spec.set_name(kTrainHead);
    spec.set_vocab_size(config_.vocab);
    spec.set_hidden_size(config_.hidden);
    spec.set_weight_dtype(config_.dtype);
    *spec.mutable_placement() = config_.placement;
    got = client.CreateHead(spec);
  }
  if (!got.ok()) return got.status();
  *info = *got;
  return absl::OkStatus();
}

absl::Status Trainer::Run(client::Client& client, const Hook& hook) {
  while (true) {
    v1::HeadInfo info;
    if (absl::Status s = EnsureHead(client, &info); !s.ok()) return s;
    const uint64_t version = info.weights_version();
    if (version == 1) {
      const client::Bytes w = Encode(master_[2], config_.dtype);
      absl::StatusOr<uint64_t> pushed = client.PushWeights(
          {.head = kTrainHead, .dtype = config_.dtype, .data = w, .expected_weights_version = 1});
      if (!pushed.ok() && !absl::IsFailedPrecondition(pushed.status())) return pushed.status();
      continue;
    }
    const int step = static_cast<int>(version) - 2;
    absl::StatusOr<v1::ClientProgress> progress = client.GetClientProgress(kTrainHead, kClientId);
    if (!progress.ok()) return progress.status();
    const uint64_t acknowledged =
        progress->has_acknowledged_sequence() ? progress->acknowledged_sequence() : 0;
    if (step == config_.steps) return sender_.SendFrom(client, step, acknowledged, hook);

    const uint64_t last = Sequence(step, config_.per_step - 1);
    const bool reset_done = acknowledged >= last && info.microbatches_since_pull() == 0;
    if (!reset_done) {
      if (absl::Status s = sender_.SendFrom(client, step, acknowledged, hook); !s.ok()) return s;
      absl::StatusOr<client::PulledGradient> read =
          client.PullGradient(kTrainHead, v1::DTYPE_FP32, /*reset=*/false);
      if (!read.ok()) return read.status();
      if (read->summary.microbatch_count() != static_cast<uint64_t>(config_.per_step)) {
        return absl::InternalError(absl::StrCat("step ", step, ": dW covers ",
                                                read->summary.microbatch_count(),
                                                " micro-batches"));
      }
      pulled_[step] = std::move(read->data);
      if (absl::Status s = hook({TrainEvent::kPulled, step}); !s.ok()) return s;
      absl::StatusOr<client::PulledGradient> reset =
          client.PullGradient(kTrainHead, v1::DTYPE_FP32, /*reset=*/true);
      if (!reset.ok()) return reset.status();
      if (reset->data != pulled_[step]) return absl::InternalError("dW changed between pulls");
      if (absl::Status s = hook({TrainEvent::kReset, step}); !s.ok()) return s;
    }
    auto grad = pulled_.find(step);
    if (grad == pulled_.end()) return absl::InternalError("the dW of a step was lost");
    const std::vector<float>& w = master_.at(version);
    const std::vector<float> dw = Decode(grad->second, v1::DTYPE_FP32);
    std::vector<float> next(w.size());
    for (size_t i = 0; i < w.size(); ++i) next[i] = w[i] - config_.lr * dw[i];
    next = Decode(Encode(next, config_.dtype), config_.dtype);  // what the head will hold
    master_[version + 1] = next;
    const client::Bytes bytes = Encode(next, config_.dtype);
    absl::StatusOr<uint64_t> pushed =
        client.PushWeights({.head = kTrainHead,
                            .dtype = config_.dtype,
                            .data = bytes,
                            .expected_weights_version = version});
    // FAILED_PRECONDITION: an earlier attempt of this push landed; the next round sees it.
    if (!pushed.ok() && !absl::IsFailedPrecondition(pushed.status())) return pushed.status();
    if (absl::Status s = hook({TrainEvent::kPushed, step}); !s.ok()) return s;
  }
}

}  // namespace losshead::testing
