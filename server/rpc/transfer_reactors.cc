#include "server/rpc/transfer_reactors.h"

#include <algorithm>
#include <functional>
#include <optional>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "losshead/kernels/problem.h"
#include "server/engine/proto_convert.h"
#include "server/engine/status_macros.h"
#include "server/engine/transfer_buffers.h"
#include "server/rpc/status_util.h"
#include "server/rpc/step_assembler.h"

namespace losshead::server {
namespace {

// Streams one host tensor as `Msg` chunks: the producer runs on a worker, fills the first
// message's header fields and returns the payload; each message then carries one piece.
template <typename Msg>
class ChunkedWriter final : public grpc::ServerWriteReactor<Msg> {
 public:
  using Producer = std::function<absl::StatusOr<std::string>(Msg& first)>;

  ChunkedWriter(ServiceContext* ctx, const char* method, Producer produce)
      : ctx_(ctx), method_(method), start_(absl::Now()) {
    ctx_->pool->Schedule([this, produce = std::move(produce)] {
      absl::StatusOr<std::string> data = ctx_->draining.load()
                                             ? absl::UnavailableError("the server is shutting down")
                                             : produce(msg_);
      if (!data.ok()) {
        FinishWith(ToGrpcStatus(data.status()));
        return;
      }
      data_ = std::move(*data);
      ctx_->metrics->Bytes(method_, "out", data_.size());
      WriteNext();
    });
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      FinishWith(grpc::Status(grpc::StatusCode::CANCELLED, "the client went away"));
    } else if (offset_ < data_.size()) {
      WriteNext();
    } else {
      FinishWith(grpc::Status::OK);
    }
  }

  void OnDone() override {
    ctx_->metrics->RpcFinished(method_, status_.error_code(), absl::Now() - start_);
    GiveTransferBuffer(std::move(data_));
    delete this;
  }

 private:
  void WriteNext() {
    // Header fields ride on the first message only. Clear keeps the data field's allocation, so
    // every piece is copied into the same warm buffer rather than a fresh one.
    if (offset_ > 0) msg_.Clear();
    const size_t n = std::min(ChunkPayloadBytes(ctx_->max_message_bytes), data_.size() - offset_);
    msg_.set_offset(offset_);
    msg_.mutable_data()->assign(data_, offset_, n);
    offset_ += n;
    this->StartWrite(&msg_);
  }

  void FinishWith(grpc::Status status) {
    status_ = status;
    this->Finish(std::move(status));  // last use of `this`: OnDone may delete it
  }

  ServiceContext* const ctx_;
  const char* const method_;
  const absl::Time start_;
  Msg msg_;
  std::string data_;
  size_t offset_ = 0;
  grpc::Status status_;
};

class PushReactor final : public grpc::ServerReadReactor<v1::PushWeightsRequest> {
 public:
  PushReactor(ServiceContext* ctx, v1::PushWeightsResponse* response)
      : ctx_(ctx), response_(response), start_(absl::Now()) {
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
      absl::StatusOr<uint64_t> version =
          head_->PushWeights(header_.dtype(), header_.mode(), staged_,
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
      total_bytes_ = static_cast<uint64_t>(head_->vocab_size()) * head_->hidden_size() *
                     kernels::DTypeSize(dtype);
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
  v1::PushWeightsRequest request_;
  v1::PushHeader header_;
  std::shared_ptr<Head> head_;
  uint64_t total_bytes_ = 0;
  std::string staged_;
  grpc::Status status_;
};

}  // namespace

grpc::ServerWriteReactor<v1::GradientChunk>* StartPullGradient(
    ServiceContext* ctx, const v1::PullGradientRequest* request, absl::Status reset_permission) {
  v1::PullGradientRequest req = *request;
  return new ChunkedWriter<v1::GradientChunk>(
      ctx, "PullGradient",
      [ctx, req, reset_permission](v1::GradientChunk& first) -> absl::StatusOr<std::string> {
        if (req.reset()) LOSSHEAD_RETURN_IF_ERROR(reset_permission);
        LOSSHEAD_ASSIGN_OR_RETURN(std::shared_ptr<Head> head, ctx->registry->Get(req.head()));
        LOSSHEAD_ASSIGN_OR_RETURN(GradientSnapshot snap,
                                  head->PullGradient(req.dtype(), req.reset()));
        ctx->metrics->Pull(head->name());
        *first.mutable_summary() = snap.summary;
        return std::move(snap.data);
      });
}

grpc::ServerWriteReactor<v1::WeightsChunk>* StartDownloadWeights(
    ServiceContext* ctx, const v1::DownloadWeightsRequest* request) {
  v1::DownloadWeightsRequest req = *request;
  return new ChunkedWriter<v1::WeightsChunk>(
      ctx, "DownloadWeights", [ctx, req](v1::WeightsChunk& first) -> absl::StatusOr<std::string> {
        LOSSHEAD_ASSIGN_OR_RETURN(std::shared_ptr<Head> head, ctx->registry->Get(req.head()));
        LOSSHEAD_ASSIGN_OR_RETURN(WeightsSnapshot snap, head->DownloadWeights(req.dtype()));
        first.set_vocab_size(head->vocab_size());
        first.set_hidden_size(head->hidden_size());
        first.set_dtype(snap.dtype);
        first.set_weights_version(snap.version);
        first.set_total_bytes(snap.data.size());
        return std::move(snap.data);
      });
}

grpc::ServerReadReactor<v1::PushWeightsRequest>* StartPushWeights(
    ServiceContext* ctx, v1::PushWeightsResponse* response) {
  return new PushReactor(ctx, response);
}

}  // namespace losshead::server
