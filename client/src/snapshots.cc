// The gradient window's summary and discard (summary_only pulls) and named snapshots: what a
// training loop does to a head besides stepping it.
#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "losshead/client/client.h"
#include "losshead/client/status.h"

namespace losshead::client {

absl::StatusOr<v1::GradientSummary> Client::WindowSummaryOnce(const std::string& head, bool reset) {
  v1::PullGradientRequest request;
  request.set_head(head);
  request.set_reset(reset);
  request.set_summary_only(true);
  auto context = NewContext(options_.deadline);
  std::unique_ptr<grpc::ClientReader<v1::GradientChunk>> reader =
      stub_->PullGradient(context.get(), request);
  v1::GradientChunk chunk;
  int messages = 0;
  v1::GradientSummary summary;
  while (reader->Read(&chunk)) {
    if (++messages == 1) summary = chunk.summary();
  }
  grpc::Status status = reader->Finish();
  if (!status.ok()) return FromGrpcStatus(status);
  if (messages != 1 || summary.total_bytes() != 0) {
    return absl::InternalError(absl::StrCat(
        "a summary_only pull answered ", messages, " messages announcing ", summary.total_bytes(),
        " bytes (a server that predates summary_only sends dW instead)"));
  }
  return summary;
}

absl::StatusOr<v1::GradientSummary> Client::WindowSummary(const std::string& head) {
  return RetryCall<v1::GradientSummary>([&] { return WindowSummaryOnce(head, false); });
}

absl::StatusOr<v1::GradientSummary> Client::DiscardGradient(const std::string& head) {
  WaitForServer();
  return WindowSummaryOnce(head, true);
}

absl::StatusOr<v1::SnapshotInfo> Client::SnapshotHead(const std::string& head,
                                                      const std::string& tag) {
  if (tag.empty()) {
    // Without a tag the request is a plain checkpoint of the head.
    return absl::InvalidArgumentError("a snapshot needs a tag");
  }
  v1::CheckpointRequest request;
  request.set_head(head);
  request.set_tag(tag);
  v1::CheckpointResponse response;
  const absl::Status status = RunWithRetry([&] {
    auto context = NewContext(options_.deadline);
    return FromGrpcStatus(stub_->Checkpoint(context.get(), request, &response));
  });
  if (!status.ok()) return status;
  return response.snapshot();
}

absl::StatusOr<v1::HeadInfo> Client::RestoreHead(const std::string& head, const std::string& tag) {
  v1::RestoreHeadRequest request;
  request.set_head(head);
  request.set_tag(tag);
  v1::HeadInfo info;
  const absl::Status status = RunWithRetry([&] {
    auto context = NewContext(options_.deadline);
    return FromGrpcStatus(stub_->RestoreHead(context.get(), request, &info));
  });
  if (!status.ok()) return status;
  return info;
}

absl::Status Client::DeleteSnapshot(const std::string& head, const std::string& tag) {
  v1::DeleteSnapshotRequest request;
  request.set_head(head);
  request.set_tag(tag);
  int attempts = 0;
  return RunWithRetry([&] {
    ++attempts;
    v1::DeleteSnapshotResponse response;
    auto context = NewContext(options_.deadline);
    absl::Status s = FromGrpcStatus(stub_->DeleteSnapshot(context.get(), request, &response));
    // Gone on a repeat: the attempt whose answer was lost deleted it.
    if (attempts > 1 && absl::IsNotFound(s)) return absl::OkStatus();
    return s;
  });
}

absl::StatusOr<std::vector<v1::SnapshotInfo>> Client::ListSnapshots(const std::string& head) {
  v1::ListSnapshotsRequest request;
  request.set_head(head);
  v1::ListSnapshotsResponse response;
  const absl::Status status = RunWithRetry([&] {
    auto context = NewContext(options_.deadline);
    return FromGrpcStatus(stub_->ListSnapshots(context.get(), request, &response));
  });
  if (!status.ok()) return status;
  return std::vector<v1::SnapshotInfo>(response.snapshots().begin(), response.snapshots().end());
}

}  // namespace losshead::client
