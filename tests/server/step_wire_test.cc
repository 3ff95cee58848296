#include "server/rpc/step_wire.h"

#include <memory>
#include <string>
#include <vector>

#include "google/protobuf/util/message_differencer.h"
#include "grpcpp/impl/codegen/proto_utils.h"
#include "gtest/gtest.h"
#include "server/engine/result_pool.h"
#include "server/rpc/step_assembler.h"

namespace losshead::server {
namespace {

std::vector<v1::StepResponse> Parse(std::vector<grpc::ByteBuffer> buffers) {
  std::vector<v1::StepResponse> out;
  for (grpc::ByteBuffer& b : buffers) {
    EXPECT_TRUE(
        grpc::SerializationTraits<v1::StepResponse>::Deserialize(&b, &out.emplace_back()).ok());
  }
  return out;
}

// The raw responses parse to exactly the messages BuildStepResponses makes.
void ExpectSameAsTyped(const v1::StepHeader& header,
                       const absl::StatusOr<std::shared_ptr<const StepOutcome>>& outcome,
                       bool replayed, size_t chunk_bytes) {
  const std::vector<v1::StepResponse> typed =
      BuildStepResponses(header, outcome, replayed, chunk_bytes);
  const std::vector<v1::StepResponse> raw =
      Parse(EncodeStepResponses(header, outcome, replayed, chunk_bytes));
  ASSERT_EQ(raw.size(), typed.size());
  for (size_t i = 0; i < raw.size(); ++i) {
    EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(raw[i], typed[i]))
        << i << ": " << raw[i].ShortDebugString() << " vs " << typed[i].ShortDebugString();
  }
}

v1::StepHeader Header() {
  v1::StepHeader h;
  h.set_client_id("client-7");
  h.set_sequence(300);  // a two-byte varint
  return h;
}

TEST(StepWireTest, ChunksMatchTypedMessages) {
  auto o = std::make_shared<StepOutcome>();
  for (int i = 0; i < 1000; ++i) o->grad_hidden.push_back(static_cast<char>(i * 7));
  o->per_token_loss = std::string(40, 'p');
  o->loss = 1.5;
  o->token_count = 10;
  for (size_t chunk : {8, 64, 200, 1000, 1040, 1 << 20}) {
    ExpectSameAsTyped(Header(), o, chunk == 64, chunk);
    ExpectSameAsTyped(v1::StepHeader(), o, false, chunk);
  }
}

// Token outputs follow dH and the per-token losses, each whole and in order, chunked as they are.
TEST(StepWireTest, TokenOutputsFollowInOrderAndMatchTypedMessages) {
  auto o = std::make_shared<StepOutcome>();
  o->grad_hidden = std::string(100, 'g');
  o->per_token_loss = std::string(40, 'p');
  o->token_outputs[static_cast<int>(TokenOutput::kLogprob)] = std::string(40, 'l');
  o->token_outputs[static_cast<int>(TokenOutput::kArgmax)] = std::string(40, 'a');
  o->correct_count = 3;
  for (size_t chunk : {8, 36, 64, 220, 1 << 20}) {
    SCOPED_TRACE(chunk);
    ExpectSameAsTyped(Header(), o, false, chunk);
    const std::vector<v1::StepResponse> typed = BuildStepResponses(Header(), o, false, chunk);
    ASSERT_TRUE(typed[0].has_result());
    EXPECT_EQ(typed[0].result().correct_count(), 3);
    EXPECT_EQ(typed[0].result().per_token_logprob_bytes(), 40u);
    EXPECT_EQ(typed[0].result().per_token_entropy_bytes(), 0u);
    EXPECT_EQ(typed[0].result().per_token_argmax_bytes(), 40u);
    std::string g, p, l, a;
    for (size_t i = 1; i < typed.size(); ++i) {
      const v1::StepResponse& r = typed[i];
      EXPECT_LE(r.grad_hidden().size() + r.per_token_loss().size() + r.per_token_logprob().size() +
                    r.per_token_argmax().size(),
                chunk);
      EXPECT_TRUE(r.per_token_entropy().empty() && r.per_token_lse().empty());
      g += r.grad_hidden();
      p += r.per_token_loss();
      l += r.per_token_logprob();
      a += r.per_token_argmax();
      EXPECT_EQ(r.last(), i + 1 == typed.size());
    }
    EXPECT_EQ(g, o->grad_hidden);
    EXPECT_EQ(p, o->per_token_loss);
    EXPECT_EQ(l, std::string(40, 'l'));
    EXPECT_EQ(a, std::string(40, 'a'));
  }
  auto without = std::make_shared<StepOutcome>();
  EXPECT_FALSE(BuildStepResponses(Header(), without, false, 64)[0].result().has_correct_count());
}

TEST(StepWireTest, ErrorsAndEmptyOutcomesMatchTypedMessages) {
  ExpectSameAsTyped(Header(), absl::ResourceExhaustedError("busy"), false, 64);
  ExpectSameAsTyped(Header(), std::make_shared<StepOutcome>(), true, 64);
  auto only_losses = std::make_shared<StepOutcome>();
  only_losses->per_token_loss = std::string(100, 'q');
  ExpectSameAsTyped(Header(), only_losses, false, 64);
}

TEST(StepWireTest, ResponsesKeepTheOutcomeAlive) {
  auto o = std::make_shared<StepOutcome>();
  o->grad_hidden = std::string(300, 'g');
  std::vector<grpc::ByteBuffer> buffers = EncodeStepResponses(Header(), o, false, 64);
  std::weak_ptr<StepOutcome> weak = o;
  o.reset();
  EXPECT_FALSE(weak.expired());
  std::string g;
  for (const v1::StepResponse& r : Parse(std::move(buffers))) g += r.grad_hidden();
  EXPECT_EQ(g, std::string(300, 'g'));
  EXPECT_TRUE(weak.expired());
}

TEST(ResultPoolTest, OutcomesGiveTheirBufferBack) {
  auto pool = std::make_shared<ResultPool>(size_t{8} << 20, /*min_bytes=*/1024);
  std::string first = pool->Take(4096);
  ASSERT_EQ(first.size(), 4096u);
  const char* storage = first.data();
  {
    StepOutcome o;
    o.grad_hidden = std::move(first);
    o.pool = pool;
  }
  EXPECT_GE(pool->idle_bytes(), 4096u);
  std::string again = pool->Take(4000);  // fits: recycled, not allocated
  EXPECT_EQ(again.data(), storage);
  EXPECT_EQ(again.size(), 4000u);
  EXPECT_EQ(pool->idle_bytes(), 0u);
}

TEST(ResultPoolTest, KeepsNeitherSmallNorTooManyBuffers) {
  ResultPool pool(/*max_idle_bytes=*/8192, /*min_bytes=*/1024);
  pool.Give(std::string(100, 'x'));
  EXPECT_EQ(pool.idle_bytes(), 0u);
  pool.Give(std::string(5000, 'x'));
  const size_t kept = pool.idle_bytes();
  EXPECT_GE(kept, 5000u);
  pool.Give(std::string(5000, 'x'));  // over the limit: freed
  EXPECT_EQ(pool.idle_bytes(), kept);
  // A much smaller request does not take the large buffer.
  EXPECT_EQ(pool.Take(1024).size(), 1024u);
  EXPECT_EQ(pool.idle_bytes(), kept);
}

}  // namespace
}  // namespace losshead::server
