#include "server/rpc/transfer_reactors.h"

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "losshead/kernels/problem.h"
#include "losshead/v1/wire_dtype.h"
#include "server/engine/proto_convert.h"
#include "server/engine/transfer_buffers.h"
#include "server/rpc/group_control.h"
#include "server/rpc/shared_slice.h"
#include "server/rpc/status_util.h"
#include "server/rpc/step_assembler.h"
#include "transport/wire_format.h"

namespace losshead::server {
namespace {

// The `data` field of GradientChunk and WeightsChunk (proto/losshead/v1/losshead.proto).
constexpr uint32_t kGradientDataField = 3;
constexpr uint32_t kWeightsDataField = 7;
constexpr uint32_t kEmbeddingRowsDataField = 7;  // EmbeddingRowsChunk.data

// The snapshot a pull or download sends: the host tensor, recycled once the last slice that
// references it has been written.
struct Snapshot {
  std::string data;
  ~Snapshot() { GiveTransferBuffer(std::move(data)); }
};

// Streams one host tensor as `Msg` chunks, written raw: each message is its fields (the first
// one's header fields from the producer, then the offset) encoded here, followed by the `data`
// field's tag and length and a slice that references the snapshot. A typed message would copy
// every byte twice before gRPC sees it (into the message's bytes field, then into the serialised
// slices); for a 2 GB dW those copies took about as long as the transfer itself.
template <typename Msg, uint32_t kDataField>
class ChunkedWriter final : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
 public:
  using Producer = std::function<absl::StatusOr<std::string>(Msg& first)>;

  ChunkedWriter(ServiceContext* ctx, const char* method, Producer produce)
      : ctx_(ctx), method_(method), start_(absl::Now()) {
    ctx_->pool->Schedule([this, produce = std::move(produce)] {
      absl::StatusOr<std::string> data = ctx_->draining.load()
                                             ? absl::UnavailableError("the server is shutting down")
                                             : produce(first_);
      if (!data.ok()) {
        FinishWith(ToGrpcStatus(data.status()));
        return;
      }
      snapshot_ = std::make_shared<Snapshot>();
      snapshot_->data = std::move(*data);
      ctx_->metrics->Bytes(method_, "out", snapshot_->data.size());
      WriteNext();
    });
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      FinishWith(grpc::Status(grpc::StatusCode::CANCELLED, "the client went away"));
    } else if (offset_ < snapshot_->data.size()) {
      WriteNext();
    } else {
      FinishWith(grpc::Status::OK);
    }
  }

  void OnDone() override {
    ctx_->metrics->RpcFinished(method_, status_.error_code(), absl::Now() - start_);
    delete this;  // the snapshot goes back to the pool once gRPC has released its slices
  }

 private:
  void WriteNext() {
    const std::string& data = snapshot_->data;
    const size_t n = std::min(ChunkPayloadBytes(ctx_->max_message_bytes), data.size() - offset_);
    // Header fields ride on the first message only.
    Msg fields;
    if (offset_ == 0) fields = first_;
    fields.set_offset(offset_);
    std::string frame = fields.SerializeAsString();
    grpc::Slice slices[2];
    size_t count = 1;
    if (n > 0) {
      transport::wire::AppendTag(frame, kDataField, transport::wire::kLengthDelimited);
      transport::wire::AppendVarint(frame, n);
      slices[1] = SharedSlice(snapshot_, data.data() + offset_, n);
      count = 2;
    }
    slices[0] = grpc::Slice(frame);
    message_ = grpc::ByteBuffer(slices, count);
    offset_ += n;
    StartWrite(&message_);
  }

  void FinishWith(grpc::Status status) {
    status_ = status;
    Finish(std::move(status));  // last use of `this`: OnDone may delete it
  }

  ServiceContext* const ctx_;
  const char* const method_;
  const absl::Time start_;
  Msg first_;
  std::shared_ptr<Snapshot> snapshot_;
  grpc::ByteBuffer message_;
  size_t offset_ = 0;
  grpc::Status status_;
};

// A raw method's request, parsed as gRPC would parse a typed one.
template <typename Request>
absl::StatusOr<Request> ParseRequest(const grpc::ByteBuffer* raw, const char* method) {
  grpc::ByteBuffer copy(*raw);  // Deserialize consumes its buffer; a copy only adds references
  Request request;
  if (!grpc::SerializationTraits<Request>::Deserialize(&copy, &request).ok()) {
    return absl::InvalidArgumentError(absl::StrCat("malformed ", method, " request"));
  }
  return request;
}

// A reactor that answers `status` at once.
class Refusal final : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
 public:
  Refusal(ServiceContext* ctx, const char* method, absl::Status status)
      : ctx_(ctx), method_(method), start_(absl::Now()), status_(ToGrpcStatus(status)) {
    Finish(status_);
  }
  void OnDone() override {
    ctx_->metrics->RpcFinished(method_, status_.error_code(), absl::Now() - start_);
    delete this;
  }

 private:
  ServiceContext* const ctx_;
  const char* const method_;
  const absl::Time start_;
  const grpc::Status status_;
};

class PushReactor final : public grpc::ServerReadReactor<v1::PushWeightsRequest> {
 public:
  PushReactor(ServiceContext* ctx, v1::PushWeightsResponse* response, std::string authorization)
      : ctx_(ctx),
        response_(response),
        start_(absl::Now()),
        authorization_(std::move(authorization)) {
    if (ctx_->draining.load()) {
      FinishWith(grpc::Status(grpc::StatusCode::UNAVAILABLE, "the server is shutting down"));
      return;
    }
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    if (ok) {
      absl::Status s = Accept();
      request_.Clear();
      if (!s.ok()) return FinishWith(ToGrpcStatus(s));
      StartRead(&request_);
      return;
    }
    // The client half-closed: the push is complete or it is refused whole.
    if (head_ == nullptr) {
      return FinishWith(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                                     "PushWeights carried no header; weights unchanged"));
    }
    if (staged_.size() != total_bytes_) {
      return FinishWith(
          grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                       absl::StrCat("PushWeights ended after ", staged_.size(), " of ",
                                    total_bytes_, " bytes; weights unchanged")));
    }
    ctx_->pool->Schedule([this] {
      // Across processes the bytes go to every process, pushed on each in the leader's order.
      absl::StatusOr<uint64_t> version =
          ctx_->group != nullptr
              ? ctx_->group->Push(header_, std::exchange(staged_, std::string()), authorization_)
              : head_->PushWeights(header_.dtype(), header_.mode(), staged_,
                                   header_.has_expected_weights_version()
                                       ? std::optional<uint64_t>(header_.expected_weights_version())
                                       : std::nullopt);
      GiveTransferBuffer(std::move(staged_));
      if (!version.ok()) return FinishWith(ToGrpcStatus(version.status()));
      ctx_->metrics->Push(head_->name());
      response_->set_weights_version(*version);
      FinishWith(grpc::Status::OK);
    });
  }

  void OnDone() override {
    ctx_->metrics->RpcFinished("PushWeights", status_.error_code(), absl::Now() - start_);
    GiveTransferBuffer(std::move(staged_));  // a push refused half-way
    delete this;
  }

 private:
  absl::Status Accept() {
    if (head_ == nullptr) {
      if (!request_.has_header()) {
        return absl::InvalidArgumentError("the first PushWeights message must carry the header");
      }
      header_ = request_.header();
      LOSSHEAD_ASSIGN_OR_RETURN(head_, ctx_->registry->Get(header_.head()));
      LOSSHEAD_ASSIGN_OR_RETURN(const kernels::DType dtype, FloatDType(header_.dtype(), "dtype"));
      if (header_.mode() != v1::PUSH_MODE_REPLACE && header_.mode() != v1::PUSH_MODE_ADD) {
        return absl::InvalidArgumentError(
            absl::StrCat("mode must be PUSH_MODE_REPLACE or PUSH_MODE_ADD, got ",
                         static_cast<int>(header_.mode())));
      }
      // W, then b for a head with an output bias.
      total_bytes_ = static_cast<uint64_t>(head_->tensor_elements()) * kernels::DTypeSize(dtype);
    } else if (request_.has_header()) {
      return absl::InvalidArgumentError("a PushWeights header may only come in the first message");
    }
    const std::string& data = request_.data();
    if (data.empty()) return absl::OkStatus();
    if (request_.offset() != staged_.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("PushWeights piece at offset ", request_.offset(), ", expected ",
                       staged_.size(), ": pieces must arrive in order, without gaps"));
    }
    if (data.size() > total_bytes_ - staged_.size()) {
      return absl::InvalidArgumentError(absl::StrCat("PushWeights data run past the ", total_bytes_,
                                                     " bytes of the head's V x D weights"));
    }
    if (staged_.capacity() < total_bytes_) {
      // A recycled buffer: appending within its capacity writes no zeros and faults no pages.
      staged_ = TakeTransferBuffer(total_bytes_);
      staged_.clear();
    }
    staged_.append(data);
    ctx_->metrics->Bytes("PushWeights", "in", data.size());
    return absl::OkStatus();
  }

  void FinishWith(grpc::Status status) {
    status_ = status;
    Finish(std::move(status));  // last use of `this`: OnDone may delete it
  }

  ServiceContext* const ctx_;
  v1::PushWeightsResponse* const response_;
  const absl::Time start_;
  const std::string authorization_;  // the caller's, forwarded across processes
  v1::PushWeightsRequest request_;
  v1::PushHeader header_;
  std::shared_ptr<Head> head_;
  uint64_t total_bytes_ = 0;
  std::string staged_;
  grpc::Status status_;
};

// `control` (a download or rows of a head sharded across processes) run on every process in the
// leader's order (group_control.h); the bytes gathered at this process, with their version and
// dtype.
absl::StatusOr<WeightsSnapshot> GatheredByGroup(ServiceContext* ctx,
                                                const v1::ControlRequest& control,
                                                const std::string& authorization) {
  GradientSnapshot gathered;
  LOSSHEAD_ASSIGN_OR_RETURN(const v1::ControlResponse done,
                            ctx->group->Run(control, authorization, &gathered));
  WeightsSnapshot snap;
  snap.version = done.weights_version();
  snap.dtype = gathered.summary.dtype();
  snap.data = std::move(gathered.data);
  return snap;
}

}  // namespace

grpc::ServerWriteReactor<grpc::ByteBuffer>* StartPullGradient(ServiceContext* ctx,
                                                              const grpc::ByteBuffer* raw,
                                                              absl::Status reset_permission,
                                                              std::string authorization) {
  absl::StatusOr<v1::PullGradientRequest> parsed =
      ParseRequest<v1::PullGradientRequest>(raw, "PullGradient");
  if (!parsed.ok()) return new Refusal(ctx, "PullGradient", parsed.status());
  return new ChunkedWriter<v1::GradientChunk, kGradientDataField>(
      ctx, "PullGradient",
      [ctx, req = *std::move(parsed), reset_permission,
       authorization](v1::GradientChunk& first) -> absl::StatusOr<std::string> {
        if (req.reset()) LOSSHEAD_RETURN_IF_ERROR(reset_permission);
        LOSSHEAD_ASSIGN_OR_RETURN(std::shared_ptr<Head> head, ctx->registry->Get(req.head()));
        if (ctx->group != nullptr) {
          v1::ControlRequest control;
          *control.mutable_pull_gradient() = req;
          GradientSnapshot snap;
          LOSSHEAD_RETURN_IF_ERROR(ctx->group->Run(control, authorization, &snap).status());
          ctx->metrics->Pull(head->name());
          *first.mutable_summary() = snap.summary;
          return std::move(snap.data);
        }
        if (req.summary_only()) {
          // One message, the summary alone (ChunkedWriter writes one for an empty tensor).
          LOSSHEAD_ASSIGN_OR_RETURN(*first.mutable_summary(),
                                    head->WindowSummary(req.dtype(), req.reset()));
          if (req.reset()) {
            ctx->metrics->GradientDiscard(head->name(), first.summary().microbatch_count(),
                                          first.summary().token_count());
          } else {
            ctx->metrics->Pull(head->name());
          }
          return std::string();
        }
        LOSSHEAD_ASSIGN_OR_RETURN(GradientSnapshot snap,
                                  head->PullGradient(req.dtype(), req.reset()));
        ctx->metrics->Pull(head->name());
        *first.mutable_summary() = snap.summary;
        return std::move(snap.data);
      });
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* StartDownloadWeights(ServiceContext* ctx,
                                                                 const grpc::ByteBuffer* raw,
                                                                 std::string authorization) {
  absl::StatusOr<v1::DownloadWeightsRequest> parsed =
      ParseRequest<v1::DownloadWeightsRequest>(raw, "DownloadWeights");
  if (!parsed.ok()) return new Refusal(ctx, "DownloadWeights", parsed.status());
  return new ChunkedWriter<v1::WeightsChunk, kWeightsDataField>(
      ctx, "DownloadWeights",
      [ctx, req = *std::move(parsed),
       authorization](v1::WeightsChunk& first) -> absl::StatusOr<std::string> {
        LOSSHEAD_ASSIGN_OR_RETURN(std::shared_ptr<Head> head, ctx->registry->Get(req.head()));
        WeightsSnapshot snap;
        if (ctx->group != nullptr && head->across_processes()) {
          // Every process sends its rows, in the leader's order (group_control.h).
          v1::ControlRequest control;
          *control.mutable_download_weights() = req;
          LOSSHEAD_ASSIGN_OR_RETURN(snap, GatheredByGroup(ctx, control, authorization));
          snap.bias = head->has_bias();  // b (every process's alike) after the gathered W
        } else {
          LOSSHEAD_ASSIGN_OR_RETURN(snap, head->DownloadWeights(req.dtype()));
        }
        first.set_vocab_size(head->vocab_size());
        first.set_hidden_size(head->hidden_size());
        first.set_dtype(snap.dtype);
        first.set_weights_version(snap.version);
        first.set_total_bytes(snap.data.size());
        first.set_bias(snap.bias);
        return std::move(snap.data);
      });
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* StartEmbeddingRows(ServiceContext* ctx,
                                                               const grpc::ByteBuffer* raw,
                                                               std::string authorization) {
  absl::StatusOr<v1::EmbeddingRowsRequest> parsed =
      ParseRequest<v1::EmbeddingRowsRequest>(raw, "EmbeddingRows");
  if (!parsed.ok()) return new Refusal(ctx, "EmbeddingRows", parsed.status());
  return new ChunkedWriter<v1::EmbeddingRowsChunk, kEmbeddingRowsDataField>(
      ctx, "EmbeddingRows",
      [ctx, req = *std::move(parsed),
       authorization](v1::EmbeddingRowsChunk& first) -> absl::StatusOr<std::string> {
        LOSSHEAD_ASSIGN_OR_RETURN(std::shared_ptr<Head> head, ctx->registry->Get(req.head()));
        WeightsSnapshot rows;
        if (ctx->group != nullptr && head->across_processes()) {
          // Every process sends the rows it owns, in the leader's order (group_control.h); a bad
          // request is refused here first, without waiting for the group.
          LOSSHEAD_RETURN_IF_ERROR(
              head->CheckEmbeddingRows(req.id_dtype(), req.ids(), req.dtype()));
          v1::ControlRequest control;
          *control.mutable_embedding_rows() = req;
          LOSSHEAD_ASSIGN_OR_RETURN(rows, GatheredByGroup(ctx, control, authorization));
        } else {
          LOSSHEAD_ASSIGN_OR_RETURN(
              rows,
              head->EmbeddingRows(req.id_dtype(), req.ids(), req.dtype(),
                                  req.has_expected_weights_version()
                                      ? std::optional<uint64_t>(req.expected_weights_version())
                                      : std::nullopt));
        }
        const size_t row_bytes =
            static_cast<size_t>(head->hidden_size()) * v1::WireDTypeSize(rows.dtype);
        first.set_num_rows(row_bytes > 0 ? rows.data.size() / row_bytes : 0);
        ctx->metrics->EmbeddingRowsServed(head->name(), first.num_rows());
        first.set_hidden_size(head->hidden_size());
        first.set_dtype(rows.dtype);
        first.set_weights_version(rows.version);
        first.set_total_bytes(rows.data.size());
        return std::move(rows.data);
      });
}

grpc::ServerReadReactor<v1::PushWeightsRequest>* StartPushWeights(ServiceContext* ctx,
                                                                  v1::PushWeightsResponse* response,
                                                                  std::string authorization) {
  return new PushReactor(ctx, response, std::move(authorization));
}

}  // namespace losshead::server
