// Writes the fuzzer's seed corpus into the directory given as argv[1]: valid micro-batches for the
// target's head (V = 7, D = 4), in one piece and in several, with options, forward-only, and a
// malformed stream.
#include <cstdint>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "losshead/v1/losshead.pb.h"
#include "tests/fuzz/step_fuzz_format.h"

namespace {

using losshead::v1::StepRequest;

std::string Floats(int count, float base) {
  std::string out(count * 4, '\0');
  for (int i = 0; i < count; ++i) {
    const float x = base + 0.25f * static_cast<float>(i % 5);
    std::memcpy(out.data() + 4 * i, &x, 4);
  }
  return out;
}

std::string Ints(int count) {
  std::string out(count * 4, '\0');
  for (int i = 0; i < count; ++i) {
    const int32_t t = i % 3 == 2 ? -100 : i % 7;
    std::memcpy(out.data() + 4 * i, &t, 4);
  }
  return out;
}

std::vector<StepRequest> Microbatch(uint64_t sequence, int n, int pieces, bool options,
                                    bool forward_only = false) {
  const std::string hidden = Floats(n * 4, 0.5f);
  const std::string targets = Ints(n);
  std::vector<StepRequest> out(pieces);
  auto* h = out[0].mutable_header();
  h->set_head("fuzz");
  h->set_client_id("seed");
  h->set_sequence(sequence);
  h->set_num_tokens(n);
  h->set_hidden_dtype(losshead::v1::DTYPE_FP32);
  h->set_target_dtype(losshead::v1::DTYPE_INT32);
  if (options) {
    h->mutable_options()->set_return_per_token_loss(true);
    h->mutable_options()->set_reduction(losshead::v1::REDUCTION_SUM);
    h->mutable_loss_options()->set_label_smoothing(0.1f);
    h->mutable_loss_options()->set_z_loss(0.01f);
  }
  if (forward_only) h->mutable_options()->set_forward_only(true);
  const size_t hp = (hidden.size() + pieces - 1) / pieces;
  for (int i = 0; i < pieces; ++i) {
    const size_t b = std::min(hidden.size(), i * hp);
    out[i].set_hidden(hidden.substr(b, std::min(hidden.size(), b + hp) - b));
  }
  out.back().set_targets(targets);
  out.back().set_last(true);
  return out;
}

void Write(const std::string& dir, const std::string& name,
           const std::vector<std::vector<StepRequest>>& microbatches) {
  std::string data;
  for (const auto& mb : microbatches) {
    for (const auto& r : mb) losshead::fuzz::AppendRecord(data, r.SerializeAsString());
  }
  std::ofstream(dir + "/" + name, std::ios::binary) << data;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) return 2;
  const std::string dir = argv[1];
  Write(dir, "one_piece", {Microbatch(1, 3, 1, false)});
  Write(dir, "pieces", {Microbatch(1, 5, 3, false), Microbatch(2, 2, 1, true)});
  Write(dir, "replay", {Microbatch(1, 4, 2, true), Microbatch(1, 4, 1, true)});
  // Evaluation: a forward-only step, then a counted one reusing its sequence number.
  Write(dir, "forward_only",
        {Microbatch(1, 3, 1, false, /*forward_only=*/true), Microbatch(1, 3, 1, false)});
  auto malformed = Microbatch(3, 2, 2, false);
  malformed.push_back(malformed[0]);  // a header inside an open micro-batch
  Write(dir, "malformed", {malformed});
  return 0;
}
