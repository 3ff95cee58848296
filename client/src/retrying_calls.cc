// The public Client methods: each single attempt (the *Once methods) wrapped in the retry policy,
// and StepMany, which re-sends micro-batches under their idempotency keys. See retry.h.
#include <algorithm>
#include <deque>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/time/clock.h"
#include "losshead/client/client.h"
#include "losshead/client/retry.h"

namespace losshead::client {

absl::Status Client::RunWithRetry(absl::FunctionRef<absl::Status()> attempt) {
  const int max_attempts = std::max(1, options_.retry.max_attempts);
  absl::Status status;
  for (int i = 1;; ++i) {
    status = attempt();
    if (status.ok() || !IsRetryable(status) || i >= max_attempts) return status;
    Backoff(i, status);
  }
}

template <typename T>
absl::StatusOr<T> Client::RetryCall(absl::FunctionRef<absl::StatusOr<T>()> attempt) {
  absl::StatusOr<T> result = absl::UnknownError("not attempted");
  const absl::Status status = RunWithRetry([&] {
    result = attempt();
    return result.status();
  });
  if (!status.ok()) return status;
  return result;
}

void Client::Backoff(int attempt, const absl::Status& status) {
  retries_.fetch_add(1);
  absl::SleepFor(BackoffDelay(options_.retry, attempt, status));
}

absl::StatusOr<v1::HeadInfo> Client::CreateHead(const v1::HeadSpec& spec) {
  return RetryCall<v1::HeadInfo>([&] { return CreateHeadOnce(spec); });
}

absl::StatusOr<v1::HeadInfo> Client::GetHead(const std::string& name) {
  return RetryCall<v1::HeadInfo>([&] { return GetHeadOnce(name); });
}

absl::StatusOr<std::vector<v1::HeadInfo>> Client::ListHeads() {
  return RetryCall<std::vector<v1::HeadInfo>>([&] { return ListHeadsOnce(); });
}

absl::Status Client::DeleteHead(const std::string& name) {
  return RunWithRetry([&] { return DeleteHeadOnce(name); });
}

absl::StatusOr<v1::HeadInfo> Client::SetLossOptions(const std::string& name,
                                                    const v1::LossOptions& default_options) {
  return RetryCall<v1::HeadInfo>([&] { return SetLossOptionsOnce(name, default_options); });
}

absl::StatusOr<v1::Stats> Client::GetStats() {
  return RetryCall<v1::Stats>([&] { return GetStatsOnce(); });
}

absl::StatusOr<uint64_t> Client::PushWeights(const PushRequest& request) {
  if (request.mode == v1::PUSH_MODE_ADD && !request.expected_weights_version.has_value()) {
    // A delta that landed but whose answer was lost would be added twice by a repeat.
    return PushWeightsOnce(request);
  }
  return RetryCall<uint64_t>([&] { return PushWeightsOnce(request); });
}

absl::StatusOr<DownloadedWeights> Client::DownloadWeights(const std::string& head,
                                                          v1::DType dtype) {
  Bytes data;
  Bytes bias;
  absl::StatusOr<DownloadedWeights> weights = RetryCall<DownloadedWeights>([&] {
    return DownloadWeightsOnce(head, dtype, {.owned = &data}, Destination{.owned = &bias});
  });
  if (weights.ok()) {
    weights->data = std::move(data);
    if (weights->has_bias) weights->bias = std::move(bias);
  }
  return weights;
}

absl::StatusOr<DownloadedWeights> Client::DownloadWeightsInto(const std::string& head,
                                                              v1::DType dtype,
                                                              std::span<std::byte> out) {
  return RetryCall<DownloadedWeights>(
      [&] { return DownloadWeightsOnce(head, dtype, {.data = out}, std::nullopt); });
}

absl::StatusOr<DownloadedWeights> Client::DownloadWeightsInto(const std::string& head,
                                                              v1::DType dtype,
                                                              std::span<std::byte> out,
                                                              std::span<std::byte> bias_out) {
  return RetryCall<DownloadedWeights>([&] {
    return DownloadWeightsOnce(head, dtype, {.data = out}, Destination{.data = bias_out});
  });
}

absl::StatusOr<PulledGradient> Client::PullGradient(const std::string& head, v1::DType dtype,
                                                    bool reset) {
  PulledGradient gradient;
  absl::StatusOr<v1::GradientSummary> summary = PullGradientWithRetry(
      head, dtype, reset, {.owned = &gradient.data}, Destination{.owned = &gradient.bias});
  if (!summary.ok()) return summary.status();
  gradient.summary = *std::move(summary);
  return gradient;
}

absl::StatusOr<v1::GradientSummary> Client::PullGradientInto(const std::string& head,
                                                             v1::DType dtype, bool reset,
                                                             std::span<std::byte> out) {
  return PullGradientWithRetry(head, dtype, reset, {.data = out}, std::nullopt);
}

absl::StatusOr<v1::GradientSummary> Client::PullGradientInto(const std::string& head,
                                                             v1::DType dtype, bool reset,
                                                             std::span<std::byte> out,
                                                             std::span<std::byte> bias_out) {
  return PullGradientWithRetry(head, dtype, reset, {.data = out}, Destination{.data = bias_out});
}

absl::StatusOr<v1::GradientSummary> Client::PullGradientWithRetry(const std::string& head,
                                                                  v1::DType dtype, bool reset,
                                                                  Destination out,
                                                                  std::optional<Destination> bias) {
  if (!reset) {
    return RetryCall<v1::GradientSummary>(
        [&] { return PullGradientOnce(head, dtype, reset, out, bias); });
  }
  // Never re-sent (see retry.h): only the wait for the server is retried, before sending.
  WaitForServer();
  return PullGradientOnce(head, dtype, reset, out, bias);
}

void Client::WaitForServer() {
  const int max_attempts = std::max(1, options_.retry.max_attempts);
  for (int i = 1; i < max_attempts; ++i) {
    const absl::Duration wait = BackoffDelay(options_.retry, i, absl::OkStatus());
    const absl::Time start = absl::Now();
    absl::StatusOr<ServingStatus> probe = HealthCheck("", wait, /*wait_for_ready=*/true);
    // NOT_SERVING: draining, its calls are refused. Any other answer, even an error such as a
    // missing health service, comes from a live server.
    if (probe.ok()
            ? *probe != ServingStatus::kNotServing
            : !absl::IsDeadlineExceeded(probe.status()) && !absl::IsUnavailable(probe.status())) {
      return;
    }
    retries_.fetch_add(1);
    absl::SleepFor(wait - (absl::Now() - start));
  }
}

absl::StatusOr<StepResult> Client::Step(const Microbatch& microbatch) {
  if (Client* home = KnownHome(microbatch.client_id); home != nullptr) {
    return home->Step(microbatch);
  }
  absl::StatusOr<StepResult> result = RetryCall<StepResult>([&] { return StepOnce(microbatch); });
  if (result.ok() || !options_.follow_home_redirect) return result;
  const std::optional<std::string> address = HomeRedirect(result.status());
  if (!address.has_value()) return result;
  Client* home = FollowHome(microbatch.client_id, *address);
  if (home == nullptr) return result;
  return home->Step(microbatch);
}

std::vector<absl::StatusOr<StepResult>> Client::StepMany(std::span<const Microbatch> microbatches,
                                                         size_t pipeline_depth) {
  const size_t depth = std::max<size_t>(1, pipeline_depth);
  const int max_attempts = std::max(1, options_.retry.max_attempts);
  std::vector<std::optional<absl::StatusOr<StepResult>>> answers(microbatches.size());
  std::vector<int> attempts(microbatches.size(), 0);
  // Micro-batches to send, in order, with the earliest time each may be (re)sent.
  std::deque<std::pair<size_t, absl::Time>> todo;
  for (size_t i = 0; i < microbatches.size(); ++i) todo.emplace_back(i, absl::InfinitePast());

  std::unique_ptr<StepStream> stream;
  std::deque<size_t> sent;  // on `stream`, not yet received
  // Micro-batches whose client id's home is another process (known before sending, or learnt
  // from their refusal, which counted nothing), sent there at the end.
  std::map<Client*, std::vector<size_t>> at_home;
  auto settle = [&](size_t i, absl::StatusOr<StepResult> answer) {
    if (!answer.ok() && options_.follow_home_redirect) {
      if (const std::optional<std::string> address = HomeRedirect(answer.status());
          address.has_value()) {
        if (Client* home = FollowHome(microbatches[i].client_id, *address); home != nullptr) {
          at_home[home].push_back(i);
          return;
        }
      }
    }
    if (!answer.ok() && IsRetryable(answer.status()) && attempts[i] < max_attempts) {
      retries_.fetch_add(1);
      todo.emplace_back(i,
                        absl::Now() + BackoffDelay(options_.retry, attempts[i], answer.status()));
      return;
    }
    answers[i] = std::move(answer);
  };
  while (!todo.empty() || !sent.empty()) {
    // Fill the pipeline with micro-batches whose backoff has passed.
    while (sent.size() < depth && !todo.empty() && todo.front().second <= absl::Now()) {
      const size_t i = todo.front().first;
      todo.pop_front();
      if (Client* home = KnownHome(microbatches[i].client_id); home != nullptr) {
        at_home[home].push_back(i);
        continue;
      }
      if (stream == nullptr) {
        auto opened = TakeStepStream();
        if (!opened.ok()) {
          ++attempts[i];
          settle(i, opened.status());
          continue;
        }
        stream = std::move(*opened);
      }
      ++attempts[i];
      absl::Status status = stream->Send(microbatches[i]);
      // A refused Send means the call is over: the micro-batch is still expected by the stream,
      // which answers it (and the others outstanding) with the call's status.
      sent.push_back(i);
      if (!status.ok()) break;
    }
    if (sent.empty()) {
      if (!todo.empty()) {
        // Everything left is backing off: sleep until the earliest may go.
        absl::Time earliest = absl::InfiniteFuture();
        for (const auto& t : todo) earliest = std::min(earliest, t.second);
        absl::SleepFor(std::max(absl::ZeroDuration(), earliest - absl::Now()));
      }
      continue;
    }
    const size_t i = sent.front();
    sent.pop_front();
    absl::StatusOr<StepResult> answer = stream->Receive();
    const bool stream_lost = !answer.ok() && !absl::IsResourceExhausted(answer.status());
    settle(i, std::move(answer));
    if (stream_lost) {
      // Most likely the call itself ended (server restart, drain, dropped connection): collect
      // the other answers it still owes (each its own, or the call's status), then start over on
      // a new stream. Re-sent micro-batches keep their keys, so any that did land are replayed.
      while (!sent.empty()) {
        const size_t j = sent.front();
        sent.pop_front();
        settle(j, stream->Receive());
      }
      stream.reset();
    }
  }
  if (stream != nullptr) ReturnStepStream(std::move(stream));
  for (auto& [home, indices] : at_home) {
    // In the given order (a refusal may have been learnt after a later micro-batch was deferred).
    std::sort(indices.begin(), indices.end());
    std::vector<Microbatch> batch;
    batch.reserve(indices.size());
    for (size_t i : indices) batch.push_back(microbatches[i]);
    std::vector<absl::StatusOr<StepResult>> answered = home->StepMany(batch, depth);
    for (size_t k = 0; k < indices.size(); ++k) answers[indices[k]] = std::move(answered[k]);
  }
  std::vector<absl::StatusOr<StepResult>> out;
  out.reserve(answers.size());
  for (auto& a : answers) out.push_back(std::move(*a));
  return out;
}

}  // namespace losshead::client
