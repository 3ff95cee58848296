// Step streams driven message by message from the proto, for the tests of what the server does
// with clients that misbehave (stall, trickle, never read, send junk): a stream of the generated
// stub whose answers are read on a thread of its own only when the test says so, and the messages
// such tests send.
#ifndef LOSSHEAD_TESTS_SERVICE_RAW_STEP_STREAM_H_
#define LOSSHEAD_TESTS_SERVICE_RAW_STEP_STREAM_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "losshead/v1/losshead.grpc.pb.h"
#include "tests/service/host_tensors.h"

namespace losshead::testing {

// One Step call on a connection of its own (so that answers it leaves unread hold up no other
// stream) whose receive window does not grow past 64 KiB, with a 60 s deadline.
class RawStream {
 public:
  // With `bearer_token`, the call carries it (`authorization: Bearer <token>`).
  explicit RawStream(const std::string& target, const std::string& bearer_token = "");
  ~RawStream();

  bool Write(const v1::StepRequest& r) { return stream_->Write(r); }
  void WritesDone() { stream_->WritesDone(); }
  // Reads every response until the server ends the call, then its status; with `pause`, waits
  // that long before each read (a client slow to take its answers).
  void ReadInBackground(absl::Duration pause = absl::ZeroDuration());
  // Waits until a response came or the call ended; true for a response.
  bool AwaitResponseOrEnd(absl::Duration timeout);
  // The call's status once it ended (joins the reader).
  grpc::Status Ended();
  std::vector<v1::StepResponse> responses();
  absl::Time ended_at();

 private:
  grpc::ClientContext context_;
  std::unique_ptr<v1::LossHead::Stub> stub_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::StepRequest, v1::StepResponse>> stream_;
  std::thread reader_;
  absl::Mutex mu_;
  std::vector<v1::StepResponse> responses_ ABSL_GUARDED_BY(mu_);
  std::optional<grpc::Status> status_ ABSL_GUARDED_BY(mu_);
  absl::Time ended_ ABSL_GUARDED_BY(mu_);
};

// A header of an fp32 micro-batch with int32 targets, without data and not last.
v1::StepRequest Header(const std::string& head, const std::string& client, uint64_t sequence,
                       int64_t tokens);
// The whole of `batch` (fp32, int32 targets) in one message: header, hidden, targets, last.
v1::StepRequest WholeMicrobatch(const std::string& head, const std::string& client,
                                uint64_t sequence, const HostBatch& batch);

// One micro-batch's answer as a client reassembles it from the responses.
struct ReadAnswer {
  v1::StepResponse first;  // the result or the error
  std::string grad_hidden;
  std::string per_token_loss;
  bool complete = false;  // its last message was among the responses
};
// The answers in `responses`, in order (an unfinished last one has complete = false).
std::vector<ReadAnswer> Answers(const std::vector<v1::StepResponse>& responses);

}  // namespace losshead::testing

#endif  // LOSSHEAD_TESTS_SERVICE_RAW_STEP_STREAM_H_
