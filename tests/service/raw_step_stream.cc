#include "tests/service/raw_step_stream.h"

#include <chrono>
#include <utility>

#include "absl/time/clock.h"

namespace losshead::testing {

RawStream::RawStream(const std::string& target, const std::string& bearer_token) {
  grpc::ChannelArguments args;
  // A connection of its own: unread answers fill this stream's flow-control windows only. Those
  // stay at gRPC's initial 64 KiB (no bandwidth probing, which may grow them to many MiB), so that
  // an answer left unread stays with the server instead of being taken in by this process.
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  args.SetMaxReceiveMessageSize(-1);
  stub_ = v1::LossHead::NewStub(
      grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args));
  context_.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  if (!bearer_token.empty()) context_.AddMetadata("authorization", "Bearer " + bearer_token);
  stream_ = stub_->Step(&context_);
}

RawStream::~RawStream() {
  if (reader_.joinable()) reader_.join();
}

void RawStream::ReadInBackground(absl::Duration pause) {
  reader_ = std::thread([this, pause] {
    v1::StepResponse r;
    for (;;) {
      if (pause > absl::ZeroDuration()) absl::SleepFor(pause);
      if (!stream_->Read(&r)) break;
      absl::MutexLock lock(&mu_);
      responses_.push_back(r);
    }
    grpc::Status status = stream_->Finish();
    absl::MutexLock lock(&mu_);
    status_ = status;
    ended_ = absl::Now();
  });
}

bool RawStream::AwaitResponseOrEnd(absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  mu_.AwaitWithTimeout(absl::Condition(
                           +[](RawStream* s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s->mu_) {
                             return !s->responses_.empty() || s->status_.has_value();
                           },
                           this),
                       timeout);
  return !responses_.empty();
}

grpc::Status RawStream::Ended() {
  if (reader_.joinable()) reader_.join();
  absl::MutexLock lock(&mu_);
  return status_.value_or(grpc::Status(grpc::StatusCode::UNKNOWN, "never ended"));
}

std::vector<v1::StepResponse> RawStream::responses() {
  absl::MutexLock lock(&mu_);
  return responses_;
}

absl::Time RawStream::ended_at() {
  absl::MutexLock lock(&mu_);
  return ended_;
}

v1::StepRequest Header(const std::string& head, const std::string& client, uint64_t sequence,
                       int64_t tokens) {
  v1::StepRequest r;
  v1::StepHeader* h = r.mutable_header();
  h->set_head(head);
  h->set_client_id(client);
  h->set_sequence(sequence);
  h->set_num_tokens(tokens);
  h->set_hidden_dtype(v1::DTYPE_FP32);
  h->set_target_dtype(v1::DTYPE_INT32);
  return r;
}

v1::StepRequest WholeMicrobatch(const std::string& head, const std::string& client,
                                uint64_t sequence, const HostBatch& batch) {
  v1::StepRequest r = Header(head, client, sequence, batch.n);
  r.set_hidden(reinterpret_cast<const char*>(batch.hidden_bytes.data()), batch.hidden_bytes.size());
  r.set_targets(reinterpret_cast<const char*>(batch.target_bytes.data()),
                batch.target_bytes.size());
  r.set_last(true);
  return r;
}

std::vector<ReadAnswer> Answers(const std::vector<v1::StepResponse>& responses) {
  std::vector<ReadAnswer> answers;
  bool open = false;
  for (const v1::StepResponse& r : responses) {
    if (!open) {
      answers.emplace_back().first = r;
      open = true;
    }
    ReadAnswer& a = answers.back();
    a.grad_hidden += r.grad_hidden();
    a.per_token_loss += r.per_token_loss();
    if (r.last()) {
      a.complete = true;
      open = false;
    }
  }
  return answers;
}

}  // namespace losshead::testing
