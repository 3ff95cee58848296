#include "server/rpc/step_assembler.h"

#include <cstring>
#include <limits>
#include <optional>
#include <string>

#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "losshead/kernels/dtype_convert.h"
#include "server/engine/pinned_pool.h"
#include "tests/server/test_util.h"

namespace losshead::server {
namespace {

v1::StepRequest Request(bool header, std::string hidden, std::string targets, bool last) {
  v1::StepRequest r;
  if (header) {
    r.mutable_header()->set_head("h");
    r.mutable_header()->set_sequence(9);
  }
  r.set_hidden(std::move(hidden));
  r.set_targets(std::move(targets));
  r.set_last(last);
  return r;
}

TEST(StepAssemblerTest, OneMessageMicroBatch) {
  StepAssembler a(1 << 20);
  auto r = Request(true, "abcd", "tt", true);
  auto got = a.Add(r, absl::Now());
  ASSERT_TRUE(got.ok());
  ASSERT_TRUE(got->has_value());
  EXPECT_EQ((*got)->microbatch.hidden, "abcd");
  EXPECT_EQ((*got)->microbatch.targets, "tt");
  EXPECT_EQ((*got)->microbatch.header.sequence(), 9u);
  EXPECT_FALSE(a.open());
}

TEST(StepAssemblerTest, PiecesAreAppendedInOrder) {
  StepAssembler a(1 << 20);
  auto r1 = Request(true, "ab", "", false);
  auto r2 = Request(false, "cd", "t1", false);
  auto r3 = Request(false, "", "t2", true);
  EXPECT_FALSE(a.Add(r1, absl::Now())->has_value());
  EXPECT_TRUE(a.open());
  EXPECT_FALSE(a.Add(r2, absl::Now())->has_value());
  auto got = a.Add(r3, absl::Now());
  ASSERT_TRUE(got.ok() && got->has_value());
  EXPECT_EQ((*got)->microbatch.hidden, "abcd");
  EXPECT_EQ((*got)->microbatch.targets, "t1t2");
}

TEST(StepAssemblerTest, DataOutsideAMicroBatchIsMalformed) {
  StepAssembler a(1 << 20);
  auto r = Request(false, "ab", "", true);
  EXPECT_EQ(a.Add(r, absl::Now()).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(StepAssemblerTest, HeaderInsideAMicroBatchIsMalformed) {
  StepAssembler a(1 << 20);
  auto r1 = Request(true, "ab", "", false);
  auto r2 = Request(true, "cd", "", true);
  ASSERT_TRUE(a.Add(r1, absl::Now()).ok());
  EXPECT_EQ(a.Add(r2, absl::Now()).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(StepAssemblerTest, OversizeIsHandedBackAtOnceAndItsRestIsSkipped) {
  StepAssembler a(10);
  auto r1 = Request(true, "12345678", "", false);
  auto r2 = Request(false, "12345678", "", false);
  auto r3 = Request(false, "", "tt", true);
  ASSERT_FALSE(a.Add(r1, absl::Now())->has_value());
  auto got = a.Add(r2, absl::Now());  // passes the limit: answered now, not at its last message
  ASSERT_TRUE(got.ok() && got->has_value());
  EXPECT_TRUE((*got)->oversize);
  EXPECT_EQ((*got)->received_bytes, 16u);
  EXPECT_TRUE((*got)->microbatch.hidden.empty());
  EXPECT_TRUE((*got)->microbatch.targets.empty());
  EXPECT_FALSE(a.open());
  EXPECT_TRUE(a.skipping());
  auto rest = a.Add(r3, absl::Now());  // skipped, framing kept: the next header opens anew
  ASSERT_TRUE(rest.ok());
  EXPECT_FALSE(rest->has_value());
  EXPECT_FALSE(a.skipping());
  auto next = Request(true, "ab", "t", true);
  auto ok = a.Add(next, absl::Now());
  ASSERT_TRUE(ok.ok() && ok->has_value());
  EXPECT_EQ((*ok)->microbatch.hidden, "ab");
}

TEST(StepAssemblerTest, RefusedIsHandedBackAtOnceAndItsRestMayBeLeftOut) {
  StepAssembler a(1 << 20);
  auto r1 = Request(true, "abcd", "", false);
  ASSERT_FALSE(a.Add(r1, absl::Now())->has_value());
  AssembledMicroBatch refused = a.Refuse(absl::ResourceExhaustedError("busy"));
  EXPECT_EQ(refused.refused.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(refused.microbatch.hidden.empty());
  EXPECT_FALSE(a.open());  // the stream may end here
  // Its remaining pieces are dropped while they come...
  auto piece = Request(false, "efgh", "", false);
  auto skipped = a.Add(piece, absl::Now());
  ASSERT_TRUE(skipped.ok());
  EXPECT_FALSE(skipped->has_value());
  EXPECT_TRUE(a.skipping());
  // ... and a header ends them: the client need not send the rest of a refused micro-batch.
  auto next = Request(true, "xy", "t", true);
  auto got = a.Add(next, absl::Now());
  ASSERT_TRUE(got.ok() && got->has_value());
  EXPECT_EQ((*got)->microbatch.hidden, "xy");
  EXPECT_FALSE(a.skipping());
}

// Digests over the bytes in order, whatever the pieces: a retry sent in other pieces matches.
TEST(StepAssemblerTest, KeyedMicroBatchIsDigestedPieceByPiece) {
  const std::string hidden = "0123456789abcdefghij";
  const std::string targets = "TTTTuuuu";
  for (size_t piece : {size_t{1}, size_t{3}, size_t{7}, hidden.size()}) {
    StepAssembler a(1 << 20);
    std::optional<AssembledMicroBatch> got;
    for (size_t at = 0; at < hidden.size(); at += piece) {
      const bool last = at + piece >= hidden.size();
      auto r = Request(at == 0, hidden.substr(at, piece), last ? targets : "", last);
      if (at == 0) r.mutable_header()->set_client_id("c");
      auto added = a.Add(r, absl::Now());
      ASSERT_TRUE(added.ok());
      if (added->has_value()) got = std::move(**added);
    }
    ASSERT_TRUE(got.has_value());
    EXPECT_EQ(got->microbatch.hidden, hidden);
    EXPECT_EQ(got->microbatch.hidden_digest, ByteDigest::Of(hidden)) << piece;
    EXPECT_EQ(got->microbatch.targets_digest, ByteDigest::Of(targets)) << piece;
  }
  // Keys that are never remembered cost no digest.
  StepAssembler a(1 << 20);
  auto anonymous = Request(true, hidden, targets, true);
  auto got = a.Add(anonymous, absl::Now());
  ASSERT_TRUE(got.ok() && got->has_value());
  EXPECT_FALSE((*got)->microbatch.hidden_digest.has_value());
  auto forward = Request(true, hidden, targets, true);
  forward.mutable_header()->set_client_id("c");
  forward.mutable_header()->mutable_options()->set_forward_only(true);
  got = a.Add(forward, absl::Now());
  ASSERT_TRUE(got.ok() && got->has_value());
  EXPECT_FALSE((*got)->microbatch.hidden_digest.has_value());
}

// Feeds `hidden` in pieces of `piece` bytes (the first with a bf16 header); ReserveHidden after
// the first, as the reactor does for a micro-batch of several messages.
std::optional<AssembledMicroBatch> Assemble(StepAssembler& a, const std::string& hidden,
                                            size_t piece, size_t announced) {
  std::optional<AssembledMicroBatch> got;
  for (size_t at = 0; at < hidden.size(); at += piece) {
    const bool last = at + piece >= hidden.size();
    auto r = Request(at == 0, hidden.substr(at, piece), last ? "tt" : "", last);
    if (at == 0) r.mutable_header()->set_hidden_dtype(v1::DTYPE_BF16);
    auto added = a.Add(r, absl::Now());
    EXPECT_TRUE(added.ok()) << added.status();
    if (added.ok() && added->has_value()) got = std::move(**added);
    if (at == 0 && a.open()) a.ReserveHidden(announced);
  }
  return got;
}

std::string RandomBf16(size_t count, uint32_t seed) {
  std::string out(2 * count, '\0');
  uint32_t x = seed;
  for (size_t i = 0; i < count; ++i) {
    x = x * 1664525u + 1013904223u;
    // Exponent bits never all ones: finite values only.
    const uint16_t v = static_cast<uint16_t>(((x >> 16) & 0x807f) | (((x >> 8) % 0xfe) << 7));
    std::memcpy(out.data() + 2 * i, &v, 2);
  }
  return out;
}

TEST(StepAssemblerTest, SeveralMessagesAreAssembledInPageLockedMemory) {
  const std::string hidden = RandomBf16(3000, 1);
  StepAssembler a(1 << 20, testing::HeapPinnedPool());
  auto got = Assemble(a, hidden, 1001, hidden.size());
  ASSERT_TRUE(got.has_value());
  ASSERT_NE(got->microbatch.pinned_hidden, nullptr);
  EXPECT_TRUE(got->microbatch.hidden.empty());
  EXPECT_EQ(got->microbatch.hidden_bytes(), hidden);
  EXPECT_EQ(got->microbatch.targets, "tt");
  EXPECT_EQ(got->microbatch.hidden_max_abs,
            kernels::MaxAbs(kernels::DType::kBF16, hidden.data(), hidden.size() / 2));
  // More than announced: the rest goes on in ordinary memory, every byte in order.
  StepAssembler b(4 << 20, testing::HeapPinnedPool());
  const std::string more = RandomBf16(700'000, 2);  // 1.4 MB: past the 1 MiB buffer
  auto over = Assemble(b, more, 100'000, 1000);
  ASSERT_TRUE(over.has_value());
  EXPECT_EQ(over->microbatch.pinned_hidden, nullptr);
  EXPECT_EQ(over->microbatch.hidden, more);
  EXPECT_EQ(over->microbatch.hidden_max_abs,
            kernels::MaxAbs(kernels::DType::kBF16, more.data(), more.size() / 2));
  // Without a pool, as before: ordinary memory.
  StepAssembler c(1 << 20);
  auto plain = Assemble(c, hidden, 1001, hidden.size());
  ASSERT_TRUE(plain.has_value());
  EXPECT_EQ(plain->microbatch.pinned_hidden, nullptr);
  EXPECT_EQ(plain->microbatch.hidden, hidden);
}

// The receiver's NaN/Inf check agrees with a whole pass, wherever the pieces split an element.
TEST(StepAssemblerTest, NonFiniteValuesAreFoundPieceByPiece) {
  const uint16_t nan = 0x7fc0, inf = 0xff80;
  for (uint16_t bad : {nan, inf}) {
    for (size_t at : {size_t{0}, size_t{777}, size_t{2999}}) {
      std::string hidden = RandomBf16(3000, 3);
      std::memcpy(hidden.data() + 2 * at, &bad, 2);
      ASSERT_TRUE(kernels::HasNonFinite(kernels::DType::kBF16, hidden.data(), 3000));
      for (size_t piece : {size_t{1}, size_t{333}, hidden.size()}) {
        for (bool pinned : {false, true}) {
          StepAssembler a(1 << 20, pinned ? testing::HeapPinnedPool() : nullptr);
          auto got = Assemble(a, hidden, piece, hidden.size());
          ASSERT_TRUE(got.has_value());
          EXPECT_EQ(got->microbatch.hidden_max_abs, std::numeric_limits<float>::infinity())
              << "element " << at << ", pieces of " << piece << ", pinned " << pinned;
        }
      }
    }
  }
  // A trailing partial element: the check does not vouch for the whole (Head::Step refuses the
  // size itself); a dtype that is not a float type: unchecked.
  StepAssembler a(1 << 20);
  auto odd = Assemble(a, RandomBf16(10, 4) + "x", 7, 21);
  ASSERT_TRUE(odd.has_value());
  EXPECT_FALSE(odd->microbatch.hidden_max_abs.has_value());
  auto r = Request(true, RandomBf16(10, 5), "tt", true);
  r.mutable_header()->set_hidden_dtype(v1::DTYPE_INT32);
  auto got = a.Add(r, absl::Now());
  ASSERT_TRUE(got.ok() && got->has_value());
  EXPECT_FALSE((*got)->microbatch.hidden_max_abs.has_value());
}

TEST(StepResponsesTest, ErrorIsOneLastMessage) {
  v1::StepHeader h;
  h.set_client_id("c");
  h.set_sequence(3);
  auto out = BuildStepResponses(h, absl::NotFoundError("no head"), false, 64);
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].error().code(), static_cast<int>(absl::StatusCode::kNotFound));
  EXPECT_EQ(out[0].client_id(), "c");
  EXPECT_EQ(out[0].sequence(), 3u);
  EXPECT_TRUE(out[0].last());
}

TEST(StepResponsesTest, ResultThenChunksBelowTheLimit) {
  auto o = std::make_shared<StepOutcome>();
  o->grad_hidden = std::string(100, 'g');
  o->per_token_loss = std::string(40, 'p');
  o->loss = 1.5;
  auto out = BuildStepResponses(v1::StepHeader(), o, true, 64);
  ASSERT_EQ(out.size(), 4u);  // result, 64 g, 36 g + 28 p, 12 p
  EXPECT_TRUE(out[0].has_result());
  EXPECT_TRUE(out[0].result().replayed());
  EXPECT_EQ(out[0].result().grad_hidden_bytes(), 100u);
  EXPECT_EQ(out[0].result().per_token_loss_bytes(), 40u);
  std::string g, p;
  for (size_t i = 0; i < out.size(); ++i) {
    EXPECT_LE(out[i].grad_hidden().size() + out[i].per_token_loss().size(), 64u);
    EXPECT_EQ(out[i].last(), i + 1 == out.size());
    g += out[i].grad_hidden();
    p += out[i].per_token_loss();
  }
  EXPECT_EQ(g, o->grad_hidden);
  EXPECT_EQ(p, o->per_token_loss);
}

TEST(StepResponsesTest, NoPayloadIsOneMessage) {
  auto o = std::make_shared<StepOutcome>();
  auto out = BuildStepResponses(v1::StepHeader(), o, false, 64);
  ASSERT_EQ(out.size(), 1u);
  EXPECT_TRUE(out[0].has_result());
  EXPECT_TRUE(out[0].last());
}

TEST(StepResponsesTest, ChunkPayloadLeavesRoom) {
  EXPECT_EQ(ChunkPayloadBytes(4 << 20), (4u << 20) - 1024);
  EXPECT_LT(ChunkPayloadBytes(4096), 4096u);
}

}  // namespace
}  // namespace losshead::server
