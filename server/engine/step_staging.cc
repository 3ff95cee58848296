#include "server/engine/step_staging.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/parallel_copy.h"
#include "common/status_macros.h"

namespace losshead::server {

absl::Status StageIn(const PreparedStep& p, Replica& replica, IoSlot& slot, bool outputs,
                     bool hidden_here, DeviceScratch& scratch) {
  kernels::Backend& backend = replica.backend;
  const size_t n = p.problem.n;
  const size_t hidden_bytes = n * p.problem.d * kernels::DTypeSize(p.problem.dtype);
  const size_t targets_bytes = n * sizeof(int32_t);
  if (slot.copies == nullptr) {
    LOSSHEAD_ASSIGN_OR_RETURN(slot.copies, backend.CreateStream());
  }
  LOSSHEAD_RETURN_IF_ERROR(scratch.Ensure(replica, slot.hidden, hidden_bytes, false));
  LOSSHEAD_RETURN_IF_ERROR(scratch.Ensure(replica, slot.targets, targets_bytes, false));
  LOSSHEAD_RETURN_IF_ERROR(scratch.Ensure(replica, slot.scalars, kStepScalarBytes, false));
  // The token inputs are small (4 bytes per token each) and go to every device that runs a part.
  const size_t input_bytes = p.inputs.values.size() * sizeof(float);
  if (input_bytes > 0) {
    LOSSHEAD_RETURN_IF_ERROR(scratch.Ensure(replica, slot.token_inputs, input_bytes, false));
  }
  const bool grad_hidden = outputs && p.want_grad_hidden;
  const bool per_token = outputs && p.want_per_token;
  const size_t token_output_bytes = outputs ? p.outputs.bytes(n) : 0;
  if (token_output_bytes > 0) {
    LOSSHEAD_RETURN_IF_ERROR(
        scratch.Ensure(replica, slot.token_outputs, token_output_bytes, false));
  }
  if (grad_hidden) {
    LOSSHEAD_RETURN_IF_ERROR(scratch.Ensure(replica, slot.grad_hidden, hidden_bytes, false));
  }
  if (per_token) {
    LOSSHEAD_RETURN_IF_ERROR(scratch.Ensure(replica, slot.per_token, n * sizeof(float), false));
  }
  // The larger of the two directions: the buffer serves the copies in, then the copies out.
  const size_t out_bytes =
      (grad_hidden ? hidden_bytes : 0) + (per_token ? n * sizeof(float) : 0) + token_output_bytes;
  const size_t hidden_in = hidden_here ? hidden_bytes : 0;
  LOSSHEAD_ASSIGN_OR_RETURN(
      const bool staged,
      scratch.EnsureStaging(replica, slot.staging, std::max(hidden_in + targets_bytes, out_bytes)));
  const char* hidden = p.hidden().data();
  const char* targets = reinterpret_cast<const char*>(p.targets.data());
  if (staged) {
    // Page-locked memory copies at the bus rate and asynchronously; a copy from the request's own
    // (pageable) bytes would go through the driver's bounce buffer at a fraction of it. Hidden
    // states the receiver assembled in page-locked memory need no staging.
    if (hidden_here && !p.request_pinned) {
      std::memcpy(slot.staging.data(), hidden, hidden_bytes);
      hidden = slot.staging.data();
    }
    std::memcpy(slot.staging.data() + hidden_in, targets, targets_bytes);
    targets = slot.staging.data() + hidden_in;
  }
  if (hidden_here) {
    LOSSHEAD_RETURN_IF_ERROR(
        backend.CopyToDevice(slot.hidden.data(), hidden, hidden_bytes, *slot.copies));
  }
  LOSSHEAD_RETURN_IF_ERROR(
      backend.CopyToDevice(slot.targets.data(), targets, targets_bytes, *slot.copies));
  if (input_bytes > 0) {
    LOSSHEAD_RETURN_IF_ERROR(backend.CopyToDevice(slot.token_inputs.data(), p.inputs.values.data(),
                                                  input_bytes, *slot.copies));
  }
  return slot.copies->Synchronize();
}

absl::Status StageOut(const PreparedStep& p, Replica& replica, IoSlot& slot, ResultPool& results,
                      std::string* grad_hidden, std::vector<float>* per_token,
                      std::string* token_outputs) {
  kernels::Backend& backend = replica.backend;
  const size_t n = p.problem.n;
  const size_t hidden_bytes = n * p.problem.d * kernels::DTypeSize(p.problem.dtype);
  const size_t outputs_bytes = p.outputs.bytes(n);
  const bool staged = slot.staging.bytes() > 0;
  // Every byte is overwritten below: a recycled buffer needs neither zeroing nor page faults.
  if (p.want_grad_hidden) *grad_hidden = results.Take(hidden_bytes);
  if (p.want_per_token) per_token->resize(n);
  token_outputs->resize(outputs_bytes);
  char* dh = staged ? slot.staging.data() : grad_hidden->data();
  const size_t pt_at = p.want_grad_hidden ? hidden_bytes : 0;
  char* pt = staged ? slot.staging.data() + pt_at : reinterpret_cast<char*>(per_token->data());
  const size_t to_at = pt_at + (p.want_per_token ? n * sizeof(float) : 0);
  char* to = staged ? slot.staging.data() + to_at : token_outputs->data();
  if (outputs_bytes > 0) {
    LOSSHEAD_RETURN_IF_ERROR(
        backend.CopyToHost(to, slot.token_outputs.data(), outputs_bytes, *slot.copies));
  }
  if (p.want_grad_hidden) {
    LOSSHEAD_RETURN_IF_ERROR(
        backend.CopyToHost(dh, slot.grad_hidden.data(), hidden_bytes, *slot.copies));
  }
  if (p.want_per_token) {
    LOSSHEAD_RETURN_IF_ERROR(
        backend.CopyToHost(pt, slot.per_token.data(), n * sizeof(float), *slot.copies));
  }
  LOSSHEAD_RETURN_IF_ERROR(slot.copies->Synchronize());
  if (staged) {
    if (p.want_grad_hidden) ParallelCopy(grad_hidden->data(), dh, hidden_bytes);
    if (p.want_per_token) std::memcpy(per_token->data(), pt, n * sizeof(float));
    if (outputs_bytes > 0) std::memcpy(token_outputs->data(), to, outputs_bytes);
  }
  return absl::OkStatus();
}

bool DeliversGradHidden(const PreparedStep& p) {
  const size_t bytes = p.problem.n * p.problem.d * kernels::DTypeSize(p.problem.dtype);
  return p.grad_hidden_to != nullptr && p.want_grad_hidden && !p.results_unread &&
         p.grad_hidden_dtype == p.problem.dtype && bytes <= p.grad_hidden_to_bytes;
}

absl::Status QueueGradHiddenDelivery(const PreparedStep& p, Replica& replica, IoSlot& slot) {
  const size_t bytes = p.problem.n * p.problem.d * kernels::DTypeSize(p.problem.dtype);
  return replica.backend.CopyOnDevice(p.grad_hidden_to, slot.grad_hidden.data(), bytes,
                                      *replica.stream);
}

}  // namespace losshead::server
