// A malformed Step stream ends the call INVALID_ARGUMENT, but only after every micro-batch it sent
// whole before the bad message is answered: those were counted in dW, so their answers are owed.
// Each case sends three valid micro-batches and then the bad input at once, before reading.
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "losshead/v1/losshead.grpc.pb.h"
#include "tests/service/host_tensors.h"
#include "tests/service/raw_step_stream.h"
#include "tests/service/reference.h"
#include "tests/service/test_server.h"

namespace losshead::testing {
namespace {

constexpr int64_t kN = 16, kD = 8, kV = 19;

// A Step call with the generic stub: any bytes can be sent as a message.
class GenericStepCall {
 public:
  explicit GenericStepCall(const std::string& target)
      : stub_(grpc::CreateChannel(target, grpc::InsecureChannelCredentials())) {
    context_.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    call_ = stub_.PrepareCall(&context_, "/losshead.v1.LossHead/Step", &cq_);
    call_->StartCall(Tag(1));
    Next();
  }
  ~GenericStepCall() {
    cq_.Shutdown();
    void* tag;
    bool ok;
    while (cq_.Next(&tag, &ok)) {
    }
  }

  bool Write(const std::string& bytes) {
    grpc::Slice slice(bytes);
    grpc::ByteBuffer message(&slice, 1);
    call_->Write(message, Tag(2));
    return Next();
  }
  bool Write(const v1::StepRequest& request) { return Write(request.SerializeAsString()); }
  void WritesDone() {
    call_->WritesDone(Tag(3));
    Next();
  }
  // Every response until the server ends the call, then its status.
  grpc::Status ReadAll(std::vector<v1::StepResponse>* responses) {
    for (;;) {
      grpc::ByteBuffer buffer;
      call_->Read(&buffer, Tag(4));
      if (!Next()) break;
      std::vector<grpc::Slice> slices;
      EXPECT_TRUE(buffer.Dump(&slices).ok());
      std::string bytes;
      for (const grpc::Slice& s : slices) bytes.append(s.begin(), s.end());
      EXPECT_TRUE(responses->emplace_back().ParseFromString(bytes));
    }
    grpc::Status status;
    call_->Finish(&status, Tag(5));
    Next();
    return status;
  }

 private:
  static void* Tag(intptr_t n) { return reinterpret_cast<void*>(n); }
  bool Next() {
    void* tag;
    bool ok = false;
    EXPECT_TRUE(cq_.Next(&tag, &ok));
    return ok;
  }

  grpc::GenericStub stub_;
  grpc::ClientContext context_;
  grpc::CompletionQueue cq_;
  std::unique_ptr<grpc::GenericClientAsyncReaderWriter> call_;
};

class MalformedAfterCountedTest : public SharedServerTest<> {};

TEST_F(MalformedAfterCountedTest, MicrobatchesCountedBeforeTheBadMessageAreAnswered) {
  // What each case sends after the three valid micro-batches: serialized messages, where
  // "partial" stands for the header of a fourth micro-batch with some of its data (not last).
  struct Case {
    std::string name;
    std::vector<std::string> bad;
    bool writes_done;  // the client half-closes after them
    std::string message;
  };
  v1::StepRequest orphan;
  orphan.set_hidden("abcd");
  const std::vector<Case> cases = {
      {.name = "junk",
       .bad = {std::string("\xff\xff\xff", 3)},
       .writes_done = false,
       .message = "malformed Step stream: a message is not a StepRequest"},
      {.name = "orphan",
       .bad = {orphan.SerializeAsString()},
       .writes_done = false,
       .message = "malformed Step stream: a message without a header outside any micro-batch"},
      {.name = "header_inside",
       .bad = {"partial", "partial"},
       .writes_done = false,
       .message = "malformed Step stream: a header arrived inside an open micro-batch"},
      {.name = "ends_inside",
       .bad = {"partial"},
       .writes_done = true,
       .message = "malformed Step stream: it ended inside a micro-batch"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    auto head = CreateKnownHead(*client_, c.name, kV, kD, v1::DTYPE_FP32, 1);
    ASSERT_TRUE(head.ok()) << head.status();
    std::vector<HostBatch> batches;
    GenericStepCall call(server_->target());
    for (uint64_t seq = 1; seq <= 3; ++seq) {
      batches.push_back(MakeBatch(kN, kD, kV, v1::DTYPE_FP32, 100 + seq));
      ASSERT_TRUE(call.Write(WholeMicrobatch(c.name, "c", seq, batches.back())));
    }
    v1::StepRequest partial = Header(c.name, "c", 4, kN);
    partial.set_hidden(std::string(8, '\0'));
    for (const std::string& b : c.bad) call.Write(b == "partial" ? partial.SerializeAsString() : b);
    if (c.writes_done) call.WritesDone();
    std::vector<v1::StepResponse> responses;
    const grpc::Status status = call.ReadAll(&responses);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
    EXPECT_EQ(status.error_message(), c.message);

    // Every valid micro-batch is answered whole, in order, and matches the reference.
    const std::vector<ReadAnswer> answers = Answers(responses);
    EXPECT_EQ(answers.size(), 3u);
    if (answers.size() != 3u) continue;
    std::vector<double> want_dw(static_cast<size_t>(kV * kD), 0.0);
    for (size_t i = 0; i < answers.size(); ++i) {
      const ReadAnswer& a = answers[i];
      ASSERT_TRUE(a.complete);
      ASSERT_TRUE(a.first.has_result()) << a.first.error().message();
      EXPECT_EQ(a.first.sequence(), i + 1);
      const RefResult want =
          Reference(head->weight, batches[i].hidden, batches[i].targets, kN, kD, kV, RefOptions{});
      EXPECT_NEAR(a.first.result().loss(), want.loss,
                  ToleranceFor(v1::DTYPE_FP32).loss_rel * std::abs(want.loss));
      client::Bytes grad(a.grad_hidden.size());
      std::memcpy(grad.data(), a.grad_hidden.data(), grad.size());
      EXPECT_TRUE(AllClose(Decode(grad, v1::DTYPE_FP32), want.grad_hidden,
                           ToleranceFor(v1::DTYPE_FP32).grad));
      for (size_t k = 0; k < want_dw.size(); ++k) want_dw[k] += want.grad_weight[k];
    }

    // dW holds exactly those three; nothing of the bad input.
    auto info = client_->GetHead(c.name);
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->microbatches_total(), 3u);
    auto progress = client_->GetClientProgress(c.name, "c");
    ASSERT_TRUE(progress.ok()) << progress.status();
    EXPECT_EQ(progress->acknowledged_sequence(), 3u);
    auto pulled = client_->PullGradient(c.name, v1::DTYPE_FP32, false);
    ASSERT_TRUE(pulled.ok()) << pulled.status();
    EXPECT_TRUE(
        AllClose(Decode(pulled->data, v1::DTYPE_FP32), want_dw, ToleranceFor(v1::DTYPE_FP32).grad));
  }
}

}  // namespace
}  // namespace losshead::testing
