// --step_trace: one line per answered micro-batch, its phases in the order they happen, and the
// line format itself (escaping of the client's text).
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <map>
#include <regex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "server/observability/step_trace.h"
#include "tests/service/host_tensors.h"
#include "tests/service/test_server.h"

namespace losshead::testing {
namespace {

// A trace line's numeric and boolean fields by name (the string fields are checked by Format's
// own test).
std::map<std::string, int64_t> Fields(const std::string& line) {
  std::map<std::string, int64_t> out;
  const std::regex field(R"re("([a-z_]+)":(-?[0-9]+|true|false))re");
  for (auto it = std::sregex_iterator(line.begin(), line.end(), field);
       it != std::sregex_iterator(); ++it) {
    const std::string value = (*it)[2];
    out[(*it)[1]] = value == "true" ? 1 : value == "false" ? 0 : std::stoll(value);
  }
  return out;
}

std::vector<std::string> Lines(const std::string& path) {
  std::ifstream in(path);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

std::string TracePath(const std::string& name) {
  return absl::StrCat(::testing::TempDir(), "/losshead-step-trace-", getpid(), "-", name, ".jsonl");
}

TEST(StepTraceTest, EachAnsweredMicrobatchIsOneLineWithItsPhasesInOrder) {
  const std::string path = TracePath("phases");
  std::remove(path.c_str());
  // Small messages: the second micro-batch arrives in several.
  server::ServerOptions options = TestServer::Options(size_t{64} << 10);
  options.step_trace_file = path;
  auto server = TestServer::StartWith(options);
  ASSERT_TRUE(server.ok()) << server.status();
  // The network path: the large micro-batch comes in several messages.
  auto client = (*server)->NewClient(0, /*same_node=*/false);
  constexpr int64_t d = 64, v = 53;
  auto head = CreateKnownHead(*client, "traced", v, d, v1::DTYPE_FP32, 3);
  ASSERT_TRUE(head.ok()) << head.status();

  const HostBatch small = MakeBatch(7, d, v, v1::DTYPE_FP32, 11);
  const HostBatch large = MakeBatch(700, d, v, v1::DTYPE_FP32, 12);  // 179 KB of hidden
  auto stream = client->OpenStepStream();
  ASSERT_TRUE(stream.ok());
  ASSERT_TRUE((*stream)->Send(ToMicrobatch(head->name, "t", 1, small)).ok());
  ASSERT_TRUE((*stream)->Send(ToMicrobatch(head->name, "t", 2, large)).ok());
  ASSERT_TRUE((*stream)->Send(ToMicrobatch(head->name, "t", 1, small)).ok());  // a replay
  client::Microbatch bad = ToMicrobatch(head->name, "t", 3, small);
  bad.num_tokens = 0;
  ASSERT_TRUE((*stream)->Send(bad).ok());
  for (int i = 0; i < 3; ++i) ASSERT_TRUE((*stream)->Receive().ok());
  EXPECT_EQ((*stream)->Receive().status().code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE((*stream)->Finish().ok());
  // A line is written when its last answer has been written, before the stream finishes; shutdown
  // waits for the stream.
  server->reset();

  const std::vector<std::string> lines = Lines(path);
  ASSERT_EQ(lines.size(), 4u);
  std::vector<std::map<std::string, int64_t>> f;
  for (const std::string& line : lines) {
    EXPECT_NE(line.find(R"("head":"traced")"), std::string::npos) << line;
    EXPECT_NE(line.find(R"("client_id":"t")"), std::string::npos) << line;
    f.push_back(Fields(line));
  }
  // In the order of the answers, which is the order sent on one stream.
  const std::vector<int64_t> sequences = {1, 2, 1, 3};
  const std::vector<int64_t> tokens = {7, 700, 7, 0};
  const std::vector<int64_t> codes = {0, 0, 0, static_cast<int>(absl::StatusCode::kInvalidArgument)};
  const std::vector<int64_t> replayed = {0, 0, 1, 0};
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(f[i]["sequence"], sequences[i]) << lines[i];
    EXPECT_EQ(f[i]["tokens"], tokens[i]) << lines[i];
    EXPECT_EQ(f[i]["code"], codes[i]) << lines[i];
    EXPECT_EQ(f[i]["replayed"], replayed[i]) << lines[i];
  }
  // Computed micro-batches went through every phase, in order.
  const std::vector<std::string> order = {
      "first_message_us", "last_message_us", "picked_us",   "stage_us",  "compute_us",
      "compute_end_us",   "finish_end_us",   "first_send_us", "sent_us"};
  for (size_t i : {0, 1}) {
    for (size_t k = 0; k < order.size(); ++k) {
      EXPECT_GT(f[i][order[k]], 0) << order[k] << " in " << lines[i];
      if (k > 0) EXPECT_LE(f[i][order[k - 1]], f[i][order[k]]) << order[k] << " in " << lines[i];
    }
  }
  // The large one arrived in several messages: its last came after its first.
  EXPECT_LT(f[1]["first_message_us"], f[1]["last_message_us"]) << lines[1];
  // The replay and the refused one never reached the device: those phases are 0.
  for (size_t i : {2, 3}) {
    EXPECT_GT(f[i]["picked_us"], 0) << lines[i];
    EXPECT_GT(f[i]["sent_us"], 0) << lines[i];
    for (const char* phase : {"stage_us", "compute_us", "compute_end_us", "finish_end_us"}) {
      EXPECT_EQ(f[i][phase], 0) << phase << " in " << lines[i];
    }
  }
  std::remove(path.c_str());
}

TEST(StepTraceTest, AFileThatCannotBeOpenedStopsTheServerFromStarting) {
  server::ServerOptions options = TestServer::Options();
  options.step_trace_file = TracePath("missing-dir") + "/no/such/dir/trace.jsonl";
  auto server = TestServer::StartWith(options);
  ASSERT_FALSE(server.ok());
  EXPECT_EQ(server.status().code(), absl::StatusCode::kNotFound) << server.status();
  EXPECT_NE(server.status().message().find("--step_trace"), std::string::npos) << server.status();
}

TEST(StepTraceTest, FormatEscapesTheClientsTextAndWritesUnreachedPhasesAsZero) {
  server::StepTraceRecord r;
  r.head = "h";
  r.client_id = "a\"b\\c\n\x01";
  r.sequence = 42;
  r.tokens = 5;
  r.code = 8;
  r.first_message = absl::FromUnixMicros(1700000000000001);
  const std::string line = server::StepTrace::Format(r);
  EXPECT_EQ(line,
            R"({"head":"h","client_id":"a\"b\\c\u000a\u0001","sequence":42,"tokens":5,)"
            R"("code":8,"replayed":false,"first_message_us":1700000000000001,)"
            R"("last_message_us":0,"picked_us":0,"stage_us":0,"compute_us":0,)"
            R"("compute_end_us":0,"finish_end_us":0,"first_send_us":0,"sent_us":0})");
}

}  // namespace
}  // namespace losshead::testing
