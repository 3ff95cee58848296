#include "server/engine/request_fingerprint.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_join.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "xxhash.h"

namespace losshead::server {
namespace {

// Deterministic serialization: the same fields give the same bytes, whatever the order they were
// set in, so that a fingerprint compares requests rather than their encoding.
std::string Canonical(const google::protobuf::MessageLite& message) {
  std::string out;
  {
    google::protobuf::io::StringOutputStream stream(&out);
    google::protobuf::io::CodedOutputStream coded(&stream);
    coded.SetSerializationDeterministic(true);
    message.SerializeToCodedStream(&coded);
  }
  return out;
}

bool SameBits(double a, double b) { return std::memcmp(&a, &b, sizeof(double)) == 0; }

}  // namespace

ByteDigest::ByteDigest() : state_(XXH3_createState()) { XXH3_64bits_reset(state_.get()); }
ByteDigest::~ByteDigest() = default;
ByteDigest::ByteDigest(ByteDigest&&) noexcept = default;
ByteDigest& ByteDigest::operator=(ByteDigest&&) noexcept = default;

void ByteDigest::Free::operator()(XXH3_state_s* state) const { XXH3_freeState(state); }

void ByteDigest::Update(absl::string_view bytes) {
  XXH3_64bits_update(state_.get(), bytes.data(), bytes.size());
}

uint64_t ByteDigest::Value() const { return XXH3_64bits_digest(state_.get()); }

uint64_t ByteDigest::Of(absl::string_view bytes) { return XXH3_64bits(bytes.data(), bytes.size()); }

std::string StepShape(const v1::StepHeader& header) {
  v1::StepHeader shape = header;
  shape.clear_head();
  shape.clear_client_id();
  shape.clear_sequence();
  // The order of the token outputs asked (or inputs named) changes no answer.
  auto* outputs = shape.mutable_options()->mutable_token_outputs();
  std::sort(outputs->begin(), outputs->end());
  auto* inputs = shape.mutable_token_inputs();
  std::sort(inputs->begin(), inputs->end());
  // An empty message sent means what one left out means: clients differ in which they do.
  if (shape.options().ByteSizeLong() == 0) shape.clear_options();
  if (shape.loss_options().ByteSizeLong() == 0) shape.clear_loss_options();
  return Canonical(shape);
}

std::string StepDifferences(const StepFingerprint& remembered, const StepFingerprint& repeat) {
  std::vector<std::string> differ;
  if (remembered.hidden != repeat.hidden) differ.push_back("hidden");
  if (remembered.targets != repeat.targets) {
    // The targets' digest covers the token inputs too (when the header names any).
    v1::StepHeader named;
    named.ParseFromString(repeat.shape);
    differ.push_back(named.token_inputs_size() > 0 ? "targets or token inputs" : "targets");
  }
  if (remembered.shape != repeat.shape) {
    v1::StepHeader a, b;
    a.ParseFromString(remembered.shape);
    b.ParseFromString(repeat.shape);
    const size_t before = differ.size();
    if (a.kind() != b.kind()) differ.push_back("kind");
    if (Canonical(a) != Canonical(b) && a.token_inputs_size() + b.token_inputs_size() > 0) {
      std::vector<int> ia(a.token_inputs().begin(), a.token_inputs().end());
      std::vector<int> ib(b.token_inputs().begin(), b.token_inputs().end());
      if (ia != ib) differ.push_back("token_inputs");
    }
    if (a.num_tokens() != b.num_tokens()) differ.push_back("num_tokens");
    if (a.hidden_dtype() != b.hidden_dtype()) differ.push_back("hidden_dtype");
    if (a.target_dtype() != b.target_dtype()) differ.push_back("target_dtype");
    if (Canonical(a.options()) != Canonical(b.options())) differ.push_back("options");
    if (Canonical(a.loss_options()) != Canonical(b.loss_options())) {
      differ.push_back("loss_options");
    }
    if (differ.size() == before) differ.push_back("header");  // fields this server does not know
  }
  return absl::StrJoin(differ, ", ");
}

std::string ApplyFingerprint(const v1::ApplyOptimizerRequest& request) {
  v1::ApplyOptimizerRequest shape = request;
  shape.clear_head();
  shape.clear_client_id();
  shape.clear_step_key();
  if (shape.params().ByteSizeLong() == 0) shape.clear_params();
  return Canonical(shape);
}

std::string ApplyDifferences(absl::string_view remembered, absl::string_view repeat) {
  if (remembered == repeat) return "";
  v1::ApplyOptimizerRequest a, b;
  a.ParseFromArray(remembered.data(), static_cast<int>(remembered.size()));
  b.ParseFromArray(repeat.data(), static_cast<int>(repeat.size()));
  std::vector<std::string> differ;
  if (Canonical(a.params()) != Canonical(b.params())) differ.push_back("params");
  if (a.has_grad_divisor() != b.has_grad_divisor() ||
      !SameBits(a.grad_divisor(), b.grad_divisor())) {
    differ.push_back("grad_divisor");
  }
  if (a.has_max_norm() != b.has_max_norm() || !SameBits(a.max_norm(), b.max_norm())) {
    differ.push_back("max_norm");
  }
  if (!SameBits(a.trunk_grad_sq_norm(), b.trunk_grad_sq_norm())) {
    differ.push_back("trunk_grad_sq_norm");
  }
  if (a.has_expected_weights_version() != b.has_expected_weights_version() ||
      a.expected_weights_version() != b.expected_weights_version()) {
    differ.push_back("expected_weights_version");
  }
  if (differ.empty()) differ.push_back("request");  // fields this server does not know
  return absl::StrJoin(differ, ", ");
}

}  // namespace losshead::server
