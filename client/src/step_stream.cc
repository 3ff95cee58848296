// The Step stream: micro-batches out in message-sized pieces, answers reassembled by a reader
// thread and handed out in order. Messages are gRPC byte buffers framed here (raw_message.h):
// hidden states are copied once into the slices sent, and dH once from the slices received into
// its destination.
#include "losshead/client/step_stream.h"

#include <grpcpp/support/sync_stream.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "common/parallel_copy.h"
#include "losshead/client/client.h"
#include "losshead/client/device_region.h"
#include "losshead/client/retry.h"
#include "losshead/client/status.h"
#include "losshead/v1/wire_dtype.h"
#include "raw_message.h"
#include "shared_region.h"
#include "transport/wire_format.h"

namespace losshead::client {
namespace {

namespace wire = transport::wire;

// Fields of StepRequest and StepResponse (proto/losshead/v1/losshead.proto).
constexpr uint32_t kRequestHeaderField = 1;
constexpr uint32_t kRequestHiddenField = 2;
constexpr uint32_t kRequestTargetsField = 3;
constexpr uint32_t kRequestLastField = 4;
constexpr uint32_t kRequestFirstTokenInputField = 5;  // then one per TokenInput, in order
constexpr uint32_t kResponseGradHiddenField = 5;
// per_token_loss, the four token outputs and the top-k's ids and log-probs.
constexpr size_t kPerTokenTensors = 7;

template <typename T>
void CopyOut(const std::string& bytes, std::vector<T>* out) {
  out->resize(bytes.size() / sizeof(T));
  if (!bytes.empty()) std::memcpy(out->data(), bytes.data(), bytes.size());
}

// OK when `result` carries every token output asked for (`token_outputs`, `correct_count`); a
// server older than them ignores the request and answers without them.
absl::Status MissingOutputs(int64_t num_tokens, const std::vector<int>& token_outputs,
                            bool correct_count, uint32_t top_k, const StepResult& result) {
  std::string missing;
  auto check = [&](bool asked, bool present, absl::string_view name) {
    if (asked && !present) absl::StrAppend(&missing, missing.empty() ? "" : ", ", name);
  };
  const auto asked = [&token_outputs](v1::TokenOutput output) {
    return std::find(token_outputs.begin(), token_outputs.end(), output) != token_outputs.end();
  };
  const size_t n = static_cast<size_t>(num_tokens);
  check(asked(v1::TOKEN_OUTPUT_LOGPROB), result.per_token_logprob.size() == n, "per_token_logprob");
  check(asked(v1::TOKEN_OUTPUT_ENTROPY), result.per_token_entropy.size() == n, "per_token_entropy");
  check(asked(v1::TOKEN_OUTPUT_LSE), result.per_token_lse.size() == n, "per_token_lse");
  check(asked(v1::TOKEN_OUTPUT_ARGMAX), result.per_token_argmax.size() == n, "per_token_argmax");
  check(correct_count, result.correct_count.has_value(), "correct_count");
  check(top_k > 0,
        result.top_k_ids.size() == n * top_k && result.top_k_logprobs.size() == n * top_k, "top_k");
  if (missing.empty()) return absl::OkStatus();
  absl::Status status = absl::UnimplementedError(absl::StrCat(
      "the server answered micro-batch (", result.client_id, ", ", result.sequence, ") without ",
      missing, ": it does not know token outputs (it ran the micro-batch without them",
      result.forward_only ? "" : " and counted it", ")"));
  status.SetPayload(kMicrobatchErrorPayload, absl::Cord("1"));
  return status;
}

// Offsets in a region are kept 64-byte aligned (a cache line; any dtype's alignment).
size_t Aligned(size_t bytes) { return (bytes + 63) / 64 * 64; }

// The dH bytes the server answers `mb` with: N x D of the dH dtype, D from the hidden states'
// size. nullopt when the shapes do not divide (the server refuses the micro-batch; it then goes
// the network way, so that it is refused exactly as there).
std::optional<size_t> GradHiddenBytes(const Microbatch& mb) {
  if (mb.kind == v1::STEP_KIND_EMBEDDING_GRAD || mb.options.skip_grad_hidden()) return 0;
  const size_t element = v1::WireDTypeSize(mb.hidden_dtype);
  if (mb.num_tokens <= 0 || element == 0) return std::nullopt;
  const size_t row = static_cast<size_t>(mb.num_tokens) * element;
  if (mb.hidden.size() % row != 0) return std::nullopt;
  const v1::DType grad = mb.options.grad_hidden_dtype() != v1::DTYPE_UNSPECIFIED
                             ? mb.options.grad_hidden_dtype()
                             : mb.hidden_dtype;
  return mb.hidden.size() / element * v1::WireDTypeSize(grad);
}

}  // namespace

bool IsMicrobatchError(const absl::Status& status) {
  return status.GetPayload(kMicrobatchErrorPayload).has_value();
}

StepStream::StepStream(std::unique_ptr<grpc::ClientContext> context,
                       grpc::ChannelInterface* channel, size_t max_message_bytes,
                       std::shared_ptr<const SameNodeLink> same_node)
    : context_(std::move(context)),
      max_message_bytes_(max_message_bytes),
      same_node_(std::move(same_node)) {
  stream_.reset(grpc::internal::ClientReaderWriterFactory<grpc::ByteBuffer, grpc::ByteBuffer>::Create(
      channel, raw::StepMethod(), context_.get()));
  reader_ = std::thread([this] { ReadLoop(); });
}

StepStream::~StepStream() {
  bool ended;
  {
    std::lock_guard<std::mutex> lock(mu_);
    ended = ended_;
  }
  if (!ended) CancelCall();
  if (reader_.joinable()) reader_.join();
}

void StepStream::Cancel() { CancelCall(); }

void StepStream::CancelCall() {
  cancelled_here_.store(true);
  context_->TryCancel();
}

void StepStream::Close(absl::Duration grace) {
  {
    std::lock_guard<std::mutex> write_lock(write_mu_);
    if (!writes_done_) {
      writes_done_ = true;
      stream_->WritesDone();
    }
  }
  std::unique_lock<std::mutex> lock(mu_);
  if (!cv_.wait_for(lock, absl::ToChronoNanoseconds(grace), [this] { return ended_; })) {
    CancelCall();
  }
}

bool StepStream::ended() const {
  std::lock_guard<std::mutex> lock(mu_);
  return ended_;
}

const char* StepStream::data_path() const {
  return same_node_ != nullptr && !same_node_off_.load() ? "shared_memory" : "network";
}

std::shared_ptr<SharedRegion> StepStream::TakeRegion(size_t bytes) {
  if (same_node_ == nullptr || same_node_off_.load()) return nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = free_regions_.begin(); it != free_regions_.end(); ++it) {
      if ((*it)->size() < bytes) continue;
      std::shared_ptr<SharedRegion> region = std::move(*it);
      free_regions_.erase(it);
      return region;
    }
    // None fits: the smallest free one is let go (the server unmaps it), so that a stream whose
    // micro-batches grow keeps no more regions than it has micro-batches in flight.
    if (!free_regions_.empty()) {
      auto smallest =
          std::min_element(free_regions_.begin(), free_regions_.end(),
                           [](const auto& a, const auto& b) { return a->size() < b->size(); });
      free_regions_.erase(smallest);
    }
  }
  // Rounded up to a power of two (at least 1 MiB), so that micro-batches of slowly varying
  // sizes reuse it.
  size_t size = size_t{1} << 20;
  while (size < bytes) size *= 2;
  absl::StatusOr<std::unique_ptr<SharedRegion>> region =
      SharedRegion::Register(same_node_->socket, same_node_->authorization, size);
  if (!region.ok()) {
    // The network path serves every micro-batch the same; this stream stays on it.
    same_node_off_.store(true);
    return nullptr;
  }
  return std::shared_ptr<SharedRegion>(std::move(*region));
}

size_t StepStream::outstanding() const {
  std::lock_guard<std::mutex> lock(mu_);
  return expected_.size() + answers_.size();
}

absl::Status StepStream::Send(const Microbatch& mb) {
  bool write_failed = false;
  {
    std::lock_guard<std::mutex> write_lock(write_mu_);
    if (writes_done_) return absl::FailedPreconditionError("Send after Finish on a step stream");
    // The same-node path: hidden states, targets and room for dH in a region, laid out in that
    // order; only the header, token inputs and `last` go in the message.
    std::shared_ptr<SharedRegion> region;
    v1::SharedMemoryRef ref;
    const bool device = mb.device.has_value() && mb.device->region != nullptr;
    if (device) {
      // The device path: the caller laid the tensors out in its device region.
      const Microbatch::DeviceTensors& d = *mb.device;
      ref.set_kind(v1::REGION_KIND_DEVICE);
      ref.set_region_id(d.region->id());
      ref.set_region_key(d.region->key());
      ref.set_hidden_offset(d.hidden_offset);
      ref.set_hidden_bytes(d.hidden_bytes);
      ref.set_targets_offset(d.targets_offset);
      ref.set_targets_bytes(d.targets_bytes);
      ref.set_grad_hidden_offset(d.grad_hidden_offset);
      ref.set_grad_hidden_bytes(d.grad_hidden_bytes);
    } else if (same_node_ != nullptr && !same_node_off_.load()) {
      if (const std::optional<size_t> grad = GradHiddenBytes(mb); grad.has_value()) {
        const size_t targets_at = Aligned(mb.hidden.size());
        const size_t grad_at = targets_at + Aligned(mb.targets.size());
        region = TakeRegion(grad_at + *grad);
        if (region != nullptr) {
          ParallelCopy(region->data(), mb.hidden.data(), mb.hidden.size());
          if (!mb.targets.empty()) {
            std::memcpy(region->data() + targets_at, mb.targets.data(), mb.targets.size());
          }
          ref.set_region_id(region->id());
          ref.set_region_key(region->key());
          ref.set_hidden_offset(0);
          ref.set_hidden_bytes(mb.hidden.size());
          ref.set_targets_offset(targets_at);
          ref.set_targets_bytes(mb.targets.size());
          ref.set_grad_hidden_offset(grad_at);
          ref.set_grad_hidden_bytes(*grad);
        }
      }
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (ended_) {
        // Answered at once, as after a refused write (below): either way Receive() answers this
        // micro-batch with the call's status, so callers count it as sent whichever way Send
        // learnt that the call was over. expected_ is empty here, so the order holds.
        const absl::Status status =
            call_status_.ok() ? absl::UnavailableError("the step stream has ended") : call_status_;
        answers_.push_back(status);
        cv_.notify_all();
        return status;
      }
      expected_.push_back(
          {.client_id = mb.client_id,
           .sequence = mb.sequence,
           .grad_hidden_out = mb.grad_hidden_out,
           .num_tokens = mb.num_tokens,
           .token_outputs = {mb.options.token_outputs().begin(), mb.options.token_outputs().end()},
           .correct_count = mb.options.return_correct_count(),
           .top_k = mb.options.top_k(),
           .region = region,
           .grad_offset = ref.grad_hidden_offset(),
           .grad_capacity = ref.grad_hidden_bytes(),
           .device = device});
    }

    v1::StepHeader header;
    header.set_kind(mb.kind);
    header.set_head(mb.head);
    header.set_client_id(mb.client_id);
    header.set_sequence(mb.sequence);
    header.set_num_tokens(mb.num_tokens);
    header.set_hidden_dtype(mb.hidden_dtype);
    header.set_target_dtype(mb.target_dtype);
    *header.mutable_options() = mb.options;
    *header.mutable_loss_options() = mb.loss_options;
    if (region != nullptr || device) *header.mutable_shared_memory() = ref;
    // The per-token inputs, in TokenInput order (their StepRequest fields' order), after the
    // targets.
    struct Tail {
      uint32_t field;
      const char* data;
      size_t left;
    };
    std::vector<Tail> tails = {{kRequestTargetsField,
                                reinterpret_cast<const char*>(mb.targets.data()),
                                region != nullptr ? 0 : mb.targets.size()}};
    const std::pair<v1::TokenInput, std::span<const float>> inputs[] = {
        {v1::TOKEN_INPUT_WEIGHT, mb.token_weights},
        {v1::TOKEN_INPUT_OLD_LOGPROB, mb.old_logprob},
        {v1::TOKEN_INPUT_ADVANTAGE, mb.advantages},
        {v1::TOKEN_INPUT_REF_LOGPROB, mb.ref_logprob}};
    for (const auto& [input, values] : inputs) {
      if (values.empty()) continue;
      header.add_token_inputs(input);
      tails.push_back({kRequestFirstTokenInputField + static_cast<uint32_t>(input) - 1,
                       reinterpret_cast<const char*>(values.data()), values.size_bytes()});
    }

    // Hidden bytes first, then target bytes, cut at message-sized boundaries: the server appends
    // pieces of each field in order, so a message may carry the tail of one and the head of the
    // other. Each message is framed here: the header (first message only), the hidden piece
    // copied once into the message's slice, then the targets piece and `last`.
    std::string header_field;
    wire::AppendTag(header_field, kRequestHeaderField, wire::kLengthDelimited);
    wire::AppendVarint(header_field, header.ByteSizeLong());
    header.AppendToString(&header_field);
    const std::byte* hidden = mb.hidden.data();
    size_t hidden_left = region != nullptr ? 0 : mb.hidden.size();
    size_t tails_left = 0;
    for (const Tail& tail : tails) tails_left += tail.left;
    bool first = true;
    while (first || hidden_left + tails_left > 0) {
      // Room for the tags and lengths of every tail field besides the header's.
      size_t budget =
          PieceBytes(max_message_bytes_, (first ? header_field.size() : 0) + 16 * tails.size());
      const size_t h = std::min(budget, hidden_left);
      budget -= h;
      std::string trailer;
      for (Tail& tail : tails) {
        const size_t t = std::min(budget, tail.left);
        if (t == 0) continue;
        wire::AppendTag(trailer, tail.field, wire::kLengthDelimited);
        wire::AppendVarint(trailer, t);
        trailer.append(tail.data, t);
        tail.data += t;
        tail.left -= t;
        tails_left -= t;
        budget -= t;
      }
      if (hidden_left - h + tails_left == 0) {
        wire::AppendTag(trailer, kRequestLastField, wire::kVarint);
        wire::AppendVarint(trailer, 1);
      }
      grpc::ByteBuffer message =
          raw::MessageWithData(first ? header_field : std::string(), kRequestHiddenField,
                               std::span<const std::byte>(hidden, h), trailer);
      hidden += h;
      hidden_left -= h;
      first = false;
      if (!stream_->Write(message)) {
        write_failed = true;
        break;
      }
    }
  }
  if (!write_failed) return absl::OkStatus();
  // A refused write means the call is over; the reader is about to learn why. The micro-batch
  // stays expected, so Receive() reports the same status for it.
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [this] { return ended_; });
  return call_status_.ok() ? absl::UnavailableError("the step stream has ended") : call_status_;
}

absl::StatusOr<StepResult> StepStream::Receive() {
  std::unique_lock<std::mutex> lock(mu_);
  if (expected_.empty() && answers_.empty()) {
    return absl::FailedPreconditionError("Receive with no micro-batch outstanding");
  }
  cv_.wait(lock, [this] { return !answers_.empty(); });
  absl::StatusOr<StepResult> answer = std::move(answers_.front());
  answers_.pop_front();
  return answer;
}

absl::Status StepStream::Finish() {
  {
    std::lock_guard<std::mutex> write_lock(write_mu_);
    if (!writes_done_) {
      writes_done_ = true;
      stream_->WritesDone();
    }
  }
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [this] { return ended_; });
  return call_status_;
}

void StepStream::ReadLoop() {
  grpc::ByteBuffer buffer;
  v1::StepResponse response;  // every field but dH, which stays in `grad` (pieces of `buffer`)
  raw::DataPieces grad;
  absl::Status protocol;  // first framing error; the call is cancelled on it
  std::optional<StepResult> current;
  // The per-token tensors (per_token_loss, then the token outputs in field order) as bytes until
  // the answer is complete, and the bytes each announced.
  std::array<std::string, kPerTokenTensors> per_token;
  std::array<uint64_t, kPerTokenTensors> per_token_bytes{};
  Expected key;
  uint64_t grad_bytes = 0;
  uint64_t grad_filled = 0;
  std::byte* grad_dest = nullptr;  // the caller's buffer; null: current->grad_hidden

  auto deliver = [this](absl::StatusOr<StepResult> answer) {
    std::lock_guard<std::mutex> lock(mu_);
    // Answered: the server writes nothing more into its region, which the next one may take.
    if (expected_.front().region != nullptr) {
      free_regions_.push_back(std::move(expected_.front().region));
    }
    expected_.pop_front();
    answers_.push_back(std::move(answer));
    cv_.notify_all();
  };
  auto fail = [&](absl::Status status) {
    protocol = std::move(status);
    CancelCall();
  };

  while (stream_->Read(&buffer)) {
    if (!protocol.ok()) continue;
    response.Clear();
    if (absl::Status parsed =
            raw::ParseWithoutData(buffer, kResponseGradHiddenField, &response, &grad);
        !parsed.ok()) {
      fail(absl::InternalError(absl::StrCat("malformed step answer: ", parsed.message())));
      continue;
    }
    if (!current.has_value()) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (expected_.empty()) {
          fail(absl::InternalError("step answer for a micro-batch that was not sent"));
          continue;
        }
        key = expected_.front();
      }
      if (response.client_id() != key.client_id || response.sequence() != key.sequence) {
        fail(absl::InternalError(absl::StrCat("step answer for (", response.client_id(), ", ",
                                              response.sequence(), ") while (", key.client_id, ", ",
                                              key.sequence, ") was next")));
        continue;
      }
      if (response.has_error()) {
        if (!response.last()) {
          fail(absl::InternalError("micro-batch error not marked last"));
          continue;
        }
        absl::Status error =
            FromCodeAndMessage(response.error().code(), response.error().message());
        if (response.error().retry_after_ms() > 0 && !error.ok()) {
          // Kept with the status so that the retry logic can honour the server's hint.
          error.SetPayload(kRetryAfterPayload,
                           absl::Cord(absl::StrCat(response.error().retry_after_ms())));
        }
        if (!error.ok()) error.SetPayload(kMicrobatchErrorPayload, absl::Cord("1"));
        deliver(error.ok() ? absl::InternalError("micro-batch error with code OK") : error);
        continue;
      }
      if (!response.has_result()) {
        fail(absl::InternalError("first message of a step answer has no result"));
        continue;
      }
      const v1::StepResult& r = response.result();
      current.emplace();
      current->client_id = key.client_id;
      current->sequence = key.sequence;
      current->loss_sum = r.loss_sum();
      current->token_count = r.token_count();
      current->loss = r.loss();
      current->weights_version = r.weights_version();
      current->replayed = r.replayed();
      current->forward_only = r.forward_only();
      current->grad_hidden_dtype = r.grad_hidden_dtype();
      grad_bytes = r.grad_hidden_bytes();
      current->grad_hidden_bytes = grad_bytes;
      grad_filled = 0;
      if (r.has_correct_count()) current->correct_count = r.correct_count();
      per_token_bytes = {
          r.per_token_loss_bytes(), r.per_token_logprob_bytes(), r.per_token_entropy_bytes(),
          r.per_token_lse_bytes(),  r.per_token_argmax_bytes(),  r.top_k_ids_bytes(),
          r.top_k_logprobs_bytes(),
      };
      if (std::any_of(per_token_bytes.begin(), per_token_bytes.end(),
                      [](uint64_t b) { return b % 4 != 0; })) {
        fail(absl::InternalError("per-token bytes not a multiple of 4"));
        continue;
      }
      if (key.grad_hidden_out.has_value()) {
        if (grad_bytes > key.grad_hidden_out->size()) {
          // Cancelling ends the call: every micro-batch outstanding on it fails with this status.
          fail(absl::InternalError(absl::StrCat("dH of ", grad_bytes, " bytes does not fit the ",
                                                key.grad_hidden_out->size(),
                                                "-byte buffer given for it")));
          continue;
        }
        grad_dest = key.grad_hidden_out->data();
      } else {
        grad_dest = nullptr;
        if (!key.device) current->grad_hidden.reserve(grad_bytes);
      }
      if (r.grad_hidden_in_shared_memory()) {
        // dH is in the region already, written before this answer was sent.
        const bool room = key.region != nullptr || key.device;
        if (!room || grad_bytes > key.grad_capacity) {
          fail(absl::InternalError(absl::StrCat("the server put ", grad_bytes,
                                                " dH bytes in shared memory where ",
                                                room ? key.grad_capacity : 0, " were given")));
          continue;
        }
      }
      if (r.grad_hidden_in_shared_memory() && key.device) {
        grad_filled = grad_bytes;  // in the caller's device region, for it to read
      } else if (r.grad_hidden_in_shared_memory()) {
        const std::byte* from = key.region->data() + key.grad_offset;
        if (grad_dest != nullptr) {
          ParallelCopy(grad_dest, from, grad_bytes);
        } else {
          current->grad_hidden.assign(from, from + grad_bytes);
        }
        grad_filled = grad_bytes;
      }
      current->shared_memory = key.region != nullptr;
      current->device = key.device;
      for (size_t i = 0; i < kPerTokenTensors; ++i) {
        per_token[i].clear();
        per_token[i].reserve(per_token_bytes[i]);
      }
    } else if (response.has_result() || response.has_error()) {
      fail(absl::InternalError("step answer started inside another"));
      continue;
    }
    const std::array<const std::string*, kPerTokenTensors> pieces = {
        &response.per_token_loss(), &response.per_token_logprob(), &response.per_token_entropy(),
        &response.per_token_lse(),  &response.per_token_argmax(),  &response.top_k_ids(),
        &response.top_k_logprobs()};
    bool over = grad_filled + grad.size > grad_bytes;
    for (size_t i = 0; i < kPerTokenTensors; ++i) {
      over = over || per_token[i].size() + pieces[i]->size() > per_token_bytes[i];
    }
    if (over) {
      fail(absl::InternalError("step answer carries more bytes than it announced"));
      continue;
    }
    if (grad.size == 0) {
      // Nothing of dH in this message (it may be in a region: grad_hidden stays empty then).
    } else if (grad_dest != nullptr) {
      grad.CopyTo(grad_dest + grad_filled);
    } else {
      current->grad_hidden.resize(grad_filled + grad.size);
      grad.CopyTo(current->grad_hidden.data() + grad_filled);
    }
    grad_filled += grad.size;
    for (size_t i = 0; i < kPerTokenTensors; ++i) per_token[i].append(*pieces[i]);
    if (!response.last()) continue;
    bool short_answer = grad_filled != grad_bytes;
    for (size_t i = 0; i < kPerTokenTensors; ++i) {
      short_answer = short_answer || per_token[i].size() != per_token_bytes[i];
    }
    if (short_answer) {
      fail(absl::InternalError(absl::StrCat("step answer ended with ", grad_filled, "/", grad_bytes,
                                            " dH bytes and ", per_token[0].size(), "/",
                                            per_token_bytes[0],
                                            " per-token loss bytes, or short token outputs")));
      continue;
    }
    CopyOut(per_token[0], &current->per_token_loss);
    CopyOut(per_token[1], &current->per_token_logprob);
    CopyOut(per_token[2], &current->per_token_entropy);
    CopyOut(per_token[3], &current->per_token_lse);
    CopyOut(per_token[4], &current->per_token_argmax);
    CopyOut(per_token[5], &current->top_k_ids);
    CopyOut(per_token[6], &current->top_k_logprobs);
    current->top_k = static_cast<int32_t>(key.top_k);
    if (absl::Status missing = MissingOutputs(key.num_tokens, key.token_outputs, key.correct_count,
                                              key.top_k, *current);
        !missing.ok()) {
      deliver(missing);
    } else {
      deliver(std::move(*current));
    }
    current.reset();
  }

  grpc::Status status;
  {
    // Finish must not race a Write; a Write on an ended call returns at once, so this waits
    // at most for one refused write.
    std::lock_guard<std::mutex> write_lock(write_mu_);
    status = stream_->Finish();
  }
  absl::Status call = protocol.ok() ? FromGrpcStatus(status, cancelled_here_.load()) : protocol;
  if (protocol.ok() && call.ok() && current.has_value()) {
    call = absl::InternalError("step call ended inside an answer");
  }
  EndCall(call);
}

void StepStream::EndCall(const absl::Status& status) {
  std::lock_guard<std::mutex> lock(mu_);
  ended_ = true;
  call_status_ = status;
  const absl::Status missing =
      status.ok() ? absl::InternalError("the step call ended without answering a micro-batch")
                  : status;
  for (size_t i = 0; i < expected_.size(); ++i) answers_.push_back(missing);
  expected_.clear();
  cv_.notify_all();
}

}  // namespace losshead::client
