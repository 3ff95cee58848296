// Step requests read out of gRPC's slices (wire::ParseWithoutData) and assembled from there: the
// same message and bytes as a typed parse, whatever the slices' boundaries.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "google/protobuf/util/message_differencer.h"
#include "grpcpp/impl/codegen/proto_utils.h"
#include "gtest/gtest.h"
#include "losshead/kernels/dtype_convert.h"
#include "transport/slice_message.h"
#include "transport/wire_format.h"
#include "server/engine/request_fingerprint.h"
#include "server/rpc/step_assembler.h"
#include "tests/server/test_util.h"

namespace losshead::server {
namespace {

constexpr uint32_t kHiddenField = 2;

// `bytes` as a byte buffer cut into slices at `cuts` (offsets, ascending).
grpc::ByteBuffer Sliced(const std::string& bytes, const std::vector<size_t>& cuts) {
  std::vector<grpc::Slice> slices;
  size_t at = 0;
  for (size_t cut : cuts) {
    slices.emplace_back(bytes.data() + at, cut - at);
    at = cut;
  }
  slices.emplace_back(bytes.data() + at, bytes.size() - at);
  return grpc::ByteBuffer(slices.data(), slices.size());
}

std::vector<size_t> RandomCuts(size_t size, int count, std::mt19937& rng) {
  std::vector<size_t> cuts;
  for (int i = 0; i < count; ++i)
    cuts.push_back(std::uniform_int_distribution<size_t>(0, size)(rng));
  std::sort(cuts.begin(), cuts.end());
  return cuts;
}

std::string Joined(const transport::wire::DataPieces& pieces) {
  std::string out(pieces.size, '\0');
  pieces.CopyTo(reinterpret_cast<std::byte*>(out.data()));
  return out;
}

std::string RandomBytes(size_t n, std::mt19937& rng) {
  std::string out(n, '\0');
  for (char& c : out) c = static_cast<char>(rng());
  return out;
}

// Every field of the request but `hidden` parses as protobuf parses it, and `hidden` is what
// protobuf keeps (the last occurrence), wherever the slices are cut.
TEST(StepMessageTest, ParsesAsATypedRequestWhereverTheSlicesAreCut) {
  std::mt19937 rng(11);
  for (int round = 0; round < 50; ++round) {
    v1::StepRequest first;
    first.mutable_header()->set_head("h");
    first.mutable_header()->set_client_id("c");
    first.mutable_header()->set_sequence(round);
    first.set_hidden(RandomBytes(std::uniform_int_distribution<size_t>(0, 5000)(rng), rng));
    first.set_targets(RandomBytes(64, rng));
    // A second serialized message appended: protobuf merges the header, keeps the last hidden
    // and targets, and the last `last`.
    v1::StepRequest second;
    second.mutable_header()->set_num_tokens(round + 1);
    if (round % 2 == 0) second.set_hidden(RandomBytes(round * 37, rng));
    second.set_last(round % 3 == 0);
    const std::string bytes = first.SerializeAsString() + second.SerializeAsString();

    grpc::ByteBuffer typed_buffer = Sliced(bytes, {});
    v1::StepRequest typed;
    ASSERT_TRUE(
        grpc::SerializationTraits<v1::StepRequest>::Deserialize(&typed_buffer, &typed).ok());

    grpc::ByteBuffer buffer = Sliced(bytes, RandomCuts(bytes.size(), round % 7, rng));
    v1::StepRequest parsed;
    transport::wire::DataPieces hidden;
    ASSERT_TRUE(transport::wire::ParseWithoutData(buffer, kHiddenField, &parsed, &hidden).ok());
    EXPECT_EQ(Joined(hidden), typed.hidden()) << round;
    EXPECT_EQ(hidden.size, typed.hidden().size());
    EXPECT_TRUE(parsed.hidden().empty());
    typed.clear_hidden();
    EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(parsed, typed))
        << parsed.ShortDebugString() << " vs " << typed.ShortDebugString();
  }
}

TEST(StepMessageTest, TruncatedOrMalformedMessagesAreRefused) {
  v1::StepRequest r;
  r.mutable_header()->set_head("h");
  r.set_hidden(std::string(1000, 'x'));
  r.set_last(true);
  const std::string bytes = r.SerializeAsString();
  for (size_t keep : {size_t{1}, size_t{4}, bytes.size() - 600, bytes.size() - 1}) {
    grpc::ByteBuffer buffer = Sliced(bytes.substr(0, keep), {keep / 2});
    v1::StepRequest parsed;
    transport::wire::DataPieces hidden;
    EXPECT_FALSE(transport::wire::ParseWithoutData(buffer, kHiddenField, &parsed, &hidden).ok()) << keep;
  }
  // A tag whose varint runs past 64 bits (its lost high bits would leave the hidden field's tag),
  // which protobuf refuses.
  {
    const std::string overlong = std::string("\x92\x80\x80\x80\x80\x80\x80\x80\x80\x02", 10) +
                                 std::string("\x03", 1) + "abc";
    grpc::ByteBuffer buffer = Sliced(overlong, {});
    v1::StepRequest parsed;
    transport::wire::DataPieces hidden;
    EXPECT_FALSE(transport::wire::ParseWithoutData(buffer, kHiddenField, &parsed, &hidden).ok());
    EXPECT_FALSE(parsed.ParseFromString(overlong));
  }
  // A tag in more than 5 bytes (here 7, the value small), and the hidden field's length in more
  // than 5 (here 6, the value 4): protobuf refuses both, so nothing may pass for hidden states.
  for (const std::string& overlong :
       {std::string("\x81\x81\x81\x81\x81\x80\x00", 7) + std::string(8, 'x'),
        std::string("\x12\x84\x80\x80\x80\x80\x00", 7) + "abcd"}) {
    grpc::ByteBuffer buffer = Sliced(overlong, {3});
    v1::StepRequest parsed;
    transport::wire::DataPieces hidden;
    EXPECT_FALSE(parsed.ParseFromString(overlong));
    EXPECT_FALSE(transport::wire::ParseWithoutData(buffer, kHiddenField, &parsed, &hidden).ok());
  }
  // A group (wire type 3) has no place in a StepRequest.
  std::string group;
  transport::wire::AppendTag(group, 9, 3);
  grpc::ByteBuffer buffer = Sliced(bytes + group, {});
  v1::StepRequest parsed;
  transport::wire::DataPieces hidden;
  EXPECT_FALSE(transport::wire::ParseWithoutData(buffer, kHiddenField, &parsed, &hidden).ok());
}

std::string RandomBf16(size_t count, std::mt19937& rng) {
  std::string out(2 * count, '\0');
  for (size_t i = 0; i < count; ++i) {
    // Exponent bits never all ones: finite values only.
    const uint32_t x = rng();
    const uint16_t v = static_cast<uint16_t>((x & 0x807f) | (((x >> 8) % 0xfe) << 7));
    std::memcpy(out.data() + 2 * i, &v, 2);
  }
  return out;
}

// A micro-batch of several messages, each cut into slices, assembled straight from the slices:
// the bytes, their digest and the NaN/Inf check equal a whole pass over the concatenation, also
// where an element straddles a slice or the assembler's cache-sized steps (256 KiB).
TEST(StepMessageTest, MicroBatchesAreAssembledFromTheSlices) {
  std::mt19937 rng(12);
  const size_t count = 700'001;  // 1.4 MB of bf16: several cache steps per message
  const std::string clean = RandomBf16(count, rng);
  const std::string targets = RandomBytes(4096, rng);
  const uint16_t nan = 0x7fc0;
  for (std::optional<size_t> bad :
       {std::optional<size_t>(), std::optional<size_t>(0),
        std::optional<size_t>((size_t{256} << 10) / 2), std::optional<size_t>(count - 1)}) {
    std::string hidden = clean;
    if (bad.has_value()) std::memcpy(hidden.data() + 2 * *bad, &nan, 2);
    for (bool pinned : {false, true}) {
      StepAssembler a(8 << 20, pinned ? testing::HeapPinnedPool() : nullptr);
      std::optional<AssembledMicroBatch> got;
      const size_t piece = 600'001;  // odd: messages split elements
      for (size_t at = 0; at < hidden.size(); at += piece) {
        const bool last = at + piece >= hidden.size();
        v1::StepRequest r;
        if (at == 0) {
          r.mutable_header()->set_head("h");
          r.mutable_header()->set_client_id("c");
          r.mutable_header()->set_hidden_dtype(v1::DTYPE_BF16);
        }
        r.set_hidden(hidden.substr(at, piece));
        if (last) r.set_targets(targets);
        r.set_last(last);
        const std::string bytes = r.SerializeAsString();
        grpc::ByteBuffer buffer = Sliced(bytes, RandomCuts(bytes.size(), 5, rng));
        StepMessage message;
        transport::wire::DataPieces slices;
        ASSERT_TRUE(
            transport::wire::ParseWithoutData(buffer, kHiddenField, &message.request, &slices).ok());
        message.hidden = slices.pieces;
        message.hidden_bytes = slices.size;
        auto added = a.Add(message, absl::Now(), at == 0 ? hidden.size() : 0);
        ASSERT_TRUE(added.ok()) << added.status();
        if (added->has_value()) got = std::move(**added);
      }
      ASSERT_TRUE(got.has_value());
      EXPECT_EQ(got->microbatch.pinned_hidden != nullptr, pinned);
      EXPECT_TRUE(got->microbatch.hidden_bytes() == hidden);
      EXPECT_EQ(got->microbatch.targets, targets);
      EXPECT_EQ(got->received_bytes, hidden.size() + targets.size());
      EXPECT_EQ(got->microbatch.hidden_digest, ByteDigest::Of(hidden));
      EXPECT_EQ(got->microbatch.targets_digest, ByteDigest::Of(targets));
      EXPECT_EQ(got->microbatch.hidden_max_abs,
                kernels::MaxAbs(kernels::DType::kBF16, hidden.data(), count))
          << "pinned " << pinned;
      EXPECT_EQ(std::isinf(*got->microbatch.hidden_max_abs), bad.has_value());
    }
  }
}

}  // namespace
}  // namespace losshead::server
