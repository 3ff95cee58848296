#include "server/engine/replicated_placement.h"

#include "absl/status/status.h"
#include "common/status_macros.h"
#include "server/engine/device_scratch.h"

namespace losshead::server {

absl::Status ReplicatedPlacement::CheckWorkspace(Replica& replica, size_t budget) const {
  const kernels::Problem probe{.n = 1,
                               .d = group().hidden_size(),
                               .v = group().vocab_size(),
                               .dtype = group().dtype(),
                               .precision = group().precision()};
  return replica.backend.WorkspaceBytes(probe, budget).status();
}

void ReplicatedPlacement::Take(int64_t tokens, StepDevices& devices) {
  devices.Queue(group().Next(), tokens);
  devices.TakeSlots();
}

absl::Status ReplicatedPlacement::Prepare(const StepRun& run, StepDevices& devices,
                                          DeviceScratch& scratch) {
  Replica& replica = devices.replica(0);
  LOSSHEAD_ASSIGN_OR_RETURN(devices.workspace_bytes(0),
                            replica.backend.WorkspaceBytes(run.problem, run.workspace_budget));
  LOSSHEAD_RETURN_IF_ERROR(
      scratch.Ensure(replica, replica.workspace, devices.workspace_bytes(0), true));
  devices.stash(0) = kernels::GradStash{};
  // Forward-only: without dW the backend skips the dW GEMM; the loss and dH are computed the same
  // way, so they match an undeferred counted step's bit for bit.
  if (run.grad_weight) {
    LOSSHEAD_ASSIGN_OR_RETURN(devices.stash(0), scratch.StashFor(replica, run.problem));
  }
  return absl::OkStatus();
}

absl::Status ReplicatedPlacement::Run(const StepRun& run, StepDevices& devices) {
  Replica& replica = devices.replica(0);
  const IoSlot& slot = devices.slot(0);
  kernels::Arguments args;
  args.hidden = slot.hidden.data();
  args.weight = replica.weights.data();
  args.targets = slot.targets.as<int32_t>();
  args.grad_hidden = run.grad_hidden ? slot.grad_hidden.data() : nullptr;
  args.grad_stash = devices.stash(0);
  if (run.grad_weight && args.grad_stash.data == nullptr)
    args.grad_weight = replica.grad.as<float>();
  char* scalars = slot.scalars.as<char>();
  args.token_count = reinterpret_cast<int64_t*>(scalars + kTokenCountOffset);
  args.loss_sum = reinterpret_cast<float*>(scalars + kLossSumOffset);
  args.per_token_loss = run.per_token ? slot.per_token.as<float>() : nullptr;
  const TokenOutputs& o = run.outputs;
  args.per_token_logprob = TokenOutputIn<float>(slot, run, TokenOutput::kLogprob);
  args.per_token_entropy = TokenOutputIn<float>(slot, run, TokenOutput::kEntropy);
  args.per_token_lse = TokenOutputIn<float>(slot, run, TokenOutput::kLse);
  args.per_token_argmax = TokenOutputIn<int32_t>(slot, run, TokenOutput::kArgmax);
  args.correct_count =
      o.correct_count ? reinterpret_cast<int64_t*>(scalars + kCorrectCountOffset) : nullptr;
  // The output bias (empty without one); its gradient with dW's, never for a forward-only run.
  args.bias = replica.bias.data() != nullptr ? replica.bias.as<float>() : nullptr;
  args.grad_bias = args.bias != nullptr && run.grad_weight ? replica.grad_bias.as<float>() : nullptr;
  args.token_weights = TokenInputIn(slot, run, TokenInput::kWeight);
  args.old_logprob = TokenInputIn(slot, run, TokenInput::kOldLogprob);
  args.advantages = TokenInputIn(slot, run, TokenInput::kAdvantage);
  args.ref_logprob = TokenInputIn(slot, run, TokenInput::kRefLogprob);
  args.top_k = o.top_k;
  args.top_k_ids = TopKIdsIn(slot, run);
  args.top_k_logprobs = TopKLogprobsIn(slot, run);
  args.workspace = replica.workspace.data();
  args.workspace_bytes = devices.workspace_bytes(0);
  return replica.backend.Run(run.problem, args, *replica.stream);
}

void SingleDevicePlacement::Take(int64_t tokens, StepDevices& devices) {
  devices.Queue(group()[0], tokens);
  devices.TakeSlots();
}

}  // namespace losshead::server
