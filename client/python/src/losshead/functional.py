"""The LM head + cross-entropy on a losshead server, as a function.

    import losshead.functional as LF
    loss = LF.linear_cross_entropy(hidden, targets, client=client, head="lm")
    loss.backward()                       # dH of that same step, times the upstream gradient

The pieces, from the bottom up (as torch.nn.functional splits a module from its function):
`LinearCrossEntropyFunction` is the autograd Function (forward: one step on the server, which
returns the loss and dH and adds to dW; backward: dH times the upstream gradient, no second
round trip); `linear_cross_entropy` is the functional form; `losshead.RemoteLMHead` is the
nn.Module that holds a client, a head, loss options and a StepPlan and calls the same
Function; `losshead.integrations` put that module into a model.

Normalisation (how the mean loss stays exact across micro-batches, chunks and ranks): every
training step reaches the server with reduction=SUM and grad_scale=1, whatever the reduction
asked for here, so dW always accumulates the token sum and the optimizer divides it by the
window's token count (`losshead.torch_bridge` says more). The reduction only decides what is
returned and how dH is scaled on the trainer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from losshead._plan import StepPlan
from losshead._types import LossOptions, StepResult, TokenOutputLike, to_token_outputs
from losshead._window import tracker
from losshead.client import Client

__all__ = ["LinearCrossEntropyFunction", "StepPlan", "linear_cross_entropy",
           "linear_policy_gradient"]

_REDUCTIONS = ("mean", "sum", "none")
_DEFAULT_PLAN = StepPlan()

OnResult = Optional[Callable[[StepResult], None]]


@dataclass(frozen=True)
class Asked:
    """The token outputs a step asks for (StepOptions.token_outputs, return_correct_count,
    top_k)."""

    token_outputs: Tuple[int, ...] = ()
    correct_count: bool = False
    top_k: int = 0

    @classmethod
    def of(cls, token_outputs: Sequence[TokenOutputLike] = (),
           correct_count: bool = False, top_k: int = 0) -> "Asked":
        if int(top_k) < 0:
            raise ValueError(f"losshead: top_k must be >= 0, not {top_k}")
        return cls(tuple(to_token_outputs(token_outputs)), bool(correct_count), int(top_k))

    def step_options(self) -> dict:
        return {"token_outputs": self.token_outputs, "return_correct_count": self.correct_count,
                "top_k": self.top_k}


_NOTHING_ASKED = Asked()


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without waiting for it: from pageable memory a copy to a CUDA
    device waits for the device, and on a GPU the server shares that wait sits behind its
    kernels (BENCHMARKS.md, "The trainer's host waits")."""
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _shape_outputs(result: StepResult, hidden: torch.Tensor, targets: torch.Tensor) -> None:
    """The result's token outputs on hidden's device, in targets' shape."""
    if result.outputs is not None:
        result.outputs = result.outputs.map(
            lambda t: _to_device(t, hidden.device).reshape(targets.shape))


def _check_reduction(reduction: str) -> None:
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, not {reduction!r}")


class LinearCrossEntropyFunction(torch.autograd.Function):
    """loss = CE(hidden @ W^T, targets) on the server; dH comes back with the loss.

    apply(hidden, targets, client, head, reduction, loss_options, plan, forward_only,
    on_result, asked, inputs): one training step (a forward-only one with `forward_only`:
    nothing added to dW), cut and sent as `plan` says; `on_result(result)` sees the combined
    StepResult, with the token outputs `asked` (an Asked; None: none) in targets' shape on
    hidden's device. `inputs` (a dict; None: none) holds the per-token inputs of the loss terms
    by name (token_weights, old_logprob, advantages, ref_logprob), in targets' shape; they are
    data, not differentiated.
    """

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, targets: torch.Tensor,  # type: ignore[override]
                client: Client, head: str, reduction: str, loss_options: LossOptions,
                plan: StepPlan, forward_only: bool, on_result: OnResult,
                asked: Optional[Asked] = None,
                inputs: Optional[Dict[str, torch.Tensor]] = None) -> torch.Tensor:
        result = client.step_chunked(
            head, hidden.detach(), targets.detach(), plan=plan, reduction="sum",
            grad_scale=1.0, loss_options=loss_options,
            return_per_token_loss=reduction == "none",
            skip_grad_hidden=not ctx.needs_input_grad[0],
            grad_hidden_device=hidden.device if hidden.is_cuda else None,
            forward_only=forward_only, **(asked or _NOTHING_ASKED).step_options(),
            **(inputs or {}))
        _shape_outputs(result, hidden, targets)
        if on_result is not None:
            on_result(result)
        if not forward_only:
            tracker(client.target, head).note_training(1, result.weights_version,
                                                       result.token_count)
        out_dtype = torch.promote_types(hidden.dtype, torch.float32)
        if reduction == "none":
            assert result.per_token_loss is not None
            loss = _to_device(result.per_token_loss, hidden.device).to(out_dtype)
            loss = loss.reshape(targets.shape)
            scale = 1.0
        elif reduction == "sum":
            # A fill, not a copy from the host: nothing waits for the device.
            loss = torch.full((), result.loss_sum, dtype=out_dtype, device=hidden.device)
            scale = 1.0
        else:
            # 0/0 is NaN, as in F.cross_entropy when every target is ignored.
            count = result.token_count
            loss = torch.full((), result.loss_sum / count if count else float("nan"),
                              dtype=out_dtype, device=hidden.device)
            scale = 1.0 / count if count else 0.0
        ctx.grad_hidden = result.grad_hidden
        ctx.scale = scale
        ctx.client_target, ctx.head = client.target, head
        ctx.hidden_meta = (hidden.shape, hidden.dtype, hidden.device)
        ctx.per_token = reduction == "none"
        return loss

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor  # type: ignore[override]
                 ) -> Tuple[Optional[torch.Tensor], ...]:
        shape, dtype, device = ctx.hidden_meta
        dh = ctx.grad_hidden
        ctx.grad_hidden = None  # one backward per forward; free the buffer early
        if dh is None:
            return _NO_GRADS
        # Computed in fp32 at least: dH arrives in bf16 and the upstream gradient may be tiny.
        work = torch.promote_types(dtype, torch.float32)
        # dH of a CUDA batch is on its device already (step_chunked copied each stream's part
        # there as soon as that stream was done); a CPU batch's stays where it is.
        dh = dh.to(device=device).to(work)
        g = grad_output.to(work)
        window = tracker(ctx.client_target, ctx.head)
        if ctx.per_token:
            dh = dh * g.reshape(-1, 1)
            window.last_grad_scale = None
        else:
            factor = g * ctx.scale
            dh = dh * factor
            # A tied input embedding's backward, which runs after this one, divides its rows by
            # it (losshead.embedding), so that the window holds both in the same units. Kept as
            # a tensor: reading it here would make every backward wait for the device.
            window.last_grad_scale = factor.detach()
        return (dh.to(dtype).reshape(shape),) + _NO_GRADS[1:]


_NO_GRADS: Tuple[None, ...] = (None,) * 11  # one per argument of forward


@torch.no_grad()
def _evaluate(client: Client, head: str, hidden: torch.Tensor, targets: torch.Tensor, *,
             reduction: str, loss_options: LossOptions, plan: StepPlan,
             on_result: OnResult = None, asked: Optional[Asked] = None,
             inputs: Optional[Dict[str, torch.Tensor]] = None) -> torch.Tensor:
    """The loss from forward-only steps without dH: nothing added to dW or counted."""
    result = client.step_chunked(
        head, hidden.detach(), targets.detach(), plan=plan, reduction="sum",
        loss_options=loss_options, return_per_token_loss=reduction == "none",
        skip_grad_hidden=True, forward_only=True,
        grad_hidden_dtype=None,  # no dH asked for: no dH dtype sent, whatever the plan's
        **(asked or _NOTHING_ASKED).step_options(), **(inputs or {}))
    _shape_outputs(result, hidden, targets)
    if on_result is not None:
        on_result(result)
    out_dtype = torch.promote_types(hidden.dtype, torch.float32)
    if reduction == "none":
        assert result.per_token_loss is not None
        return result.per_token_loss.to(device=hidden.device, dtype=out_dtype).reshape(
            targets.shape)
    total = result.loss_sum
    if reduction == "mean":
        # 0/0 is NaN, as in F.cross_entropy when every target is ignored.
        count = result.token_count
        total = total / count if count else float("nan")
    return torch.tensor(total, dtype=out_dtype, device=hidden.device)


def linear_cross_entropy(hidden: torch.Tensor, targets: torch.Tensor, *, client: Client,
                         head: str, reduction: str = "mean", ignore_index: Optional[int] = None,
                         label_smoothing: Optional[float] = None, z_loss: Optional[float] = None,
                         logit_softcap: Optional[float] = None, plan: Optional[StepPlan] = None,
                         training: bool = True, return_result: bool = False,
                         token_outputs: Sequence[TokenOutputLike] = (),
                         return_correct_count: bool = False,
                         temperature: Optional[float] = None,
                         entropy_coef: Optional[float] = None,
                         token_weights: Optional[torch.Tensor] = None,
                         logit_scale: Optional[float] = None, top_k: int = 0) -> Any:
    """The loss of hidden (..., D) against targets (...) through the head `head` on `client`'s
    server: CE(hidden @ W^T, targets) with the given options (None: the head's defaults).

    Returns what RemoteLMHead returns: a scalar for reduction "mean" (over non-ignored tokens;
    NaN when there are none) or "sum", per-token losses of targets' shape for "none" (0 at
    ignored tokens); with `return_result`, the pair (loss, StepResult). With grad mode on,
    backward returns dH from the same step times the upstream gradient, and a `training` step
    adds to the head's dW (`training=False`: forward-only, the loss on the current W with dH
    and nothing added, as RemoteLMHead in eval() mode). With grad mode off the steps are
    forward-only and carry no dH. `plan` (a StepPlan; default StepPlan()) says how the batch
    is cut and sent. The same autograd Function as RemoteLMHead's: the two agree bit for bit.

    `token_outputs` (any of "logprob", "entropy", "lse", "argmax") and `return_correct_count`
    ask for what the model predicts, from the same pass (they change the loss and dH by not a
    bit): the StepResult's `outputs` (a TokenOutputs) holds them in targets' shape on hidden's
    device, and `accuracy` the token accuracy; so ask for `return_result` too. `top_k` (0: none;
    k in [1, 16], at most the vocabulary) adds the k most likely classes per token and their
    log-probabilities, `outputs.top_k_ids` and `outputs.top_k_logprobs` of shape (..., k).


    The loss terms: `temperature` T divides the logits (softmax(z / T); the outputs are those of
    that distribution), `logit_scale` overrides the head's model scale (best left to the head's
    default), `entropy_coef` adds entropy_coef * H_t to each token's loss (negative: an entropy
    bonus), `token_weights` (targets' shape) multiplies each token's loss and gradient; "mean"
    still divides by the non-ignored tokens (sum_t w_t loss_t / count, the masked token mean).
    """
    _check_reduction(reduction)
    options = LossOptions(ignore_index=ignore_index, label_smoothing=label_smoothing,
                          z_loss=z_loss, logit_softcap=logit_softcap, temperature=temperature,
                          entropy_coef=entropy_coef, logit_scale=logit_scale)
    results: List[StepResult] = []
    loss = _loss(client, head, hidden, targets, reduction=reduction, loss_options=options,
                 plan=_DEFAULT_PLAN if plan is None else plan, training=training,
                 on_result=results.append,
                 asked=Asked.of(token_outputs, return_correct_count, top_k),
                 inputs=_inputs(token_weights=token_weights))
    return (loss, results[0]) if return_result else loss


def linear_policy_gradient(hidden: torch.Tensor, targets: torch.Tensor,
                           old_logprob: torch.Tensor, advantages: torch.Tensor, *,
                           client: Client, head: str, ref_logprob: Optional[torch.Tensor] = None,
                           kl_coef: Optional[float] = None, clip_low: Optional[float] = None,
                           clip_high: Optional[float] = None,
                           entropy_coef: Optional[float] = None,
                           temperature: Optional[float] = None,
                           token_weights: Optional[torch.Tensor] = None,
                           reduction: str = "mean", ignore_index: Optional[int] = None,
                           z_loss: Optional[float] = None, logit_softcap: Optional[float] = None,
                           plan: Optional[StepPlan] = None, training: bool = True,
                           return_result: bool = False,
                           token_outputs: Sequence[TokenOutputLike] = (),
                           return_correct_count: bool = False) -> Any:
    """The clipped policy-gradient loss (PPO / GRPO) of the sampled tokens `targets` through the
    head `head` on `client`'s server, per token t with log p_t the log-prob of its target under
    softmax(hidden @ W^T * scale / temperature):

        r_t    = exp(log p_t - old_logprob_t)
        loss_t = -min(r_t A_t, clamp(r_t, 1 - clip_low, 1 + clip_high) A_t)
                 + kl_coef (exp(q_t - log p_t) - (q_t - log p_t) - 1) + entropy_coef H_t

    with A_t = advantages, q_t = ref_logprob (needed exactly when kl_coef > 0), H_t the
    entropy, times token_weights_t when given; ignored targets (ignore_index) add nothing. The
    reduction is as linear_cross_entropy's: "mean" divides by the non-ignored tokens (so
    `token_weights` of 0 and 1 give the masked token mean of a GRPO step), "sum", or per-token
    "none". old_logprob, advantages, ref_logprob and token_weights are in targets' shape and are
    data (not differentiated); clip_low, clip_high default to 0.2. Backward returns dH times the
    upstream gradient; a `training` step adds to the head's dW, as linear_cross_entropy's.
    token_outputs ("logprob" for the new log-probs, "entropy", ...) come from the same pass.
    """
    _check_reduction(reduction)
    options = LossOptions(ignore_index=ignore_index, z_loss=z_loss, logit_softcap=logit_softcap,
                          temperature=temperature, entropy_coef=entropy_coef,
                          kind="policy_gradient", clip_low=clip_low, clip_high=clip_high,
                          kl_coef=kl_coef)
    results: List[StepResult] = []
    loss = _loss(client, head, hidden, targets, reduction=reduction, loss_options=options,
                 plan=_DEFAULT_PLAN if plan is None else plan, training=training,
                 on_result=results.append, asked=Asked.of(token_outputs, return_correct_count),
                 inputs=_inputs(token_weights=token_weights, old_logprob=old_logprob,
                                advantages=advantages, ref_logprob=ref_logprob))
    return (loss, results[0]) if return_result else loss


def _inputs(**given: Optional[torch.Tensor]) -> Optional[Dict[str, torch.Tensor]]:
    """The per-token inputs given (None ones left out); None when there are none."""
    inputs = {name: t.detach() for name, t in given.items() if t is not None}
    return inputs or None


def _loss(client: Client, head: str, hidden: torch.Tensor, targets: torch.Tensor, *,
          reduction: str, loss_options: LossOptions, plan: StepPlan, training: bool,
          on_result: OnResult = None, asked: Optional[Asked] = None,
          inputs: Optional[Dict[str, torch.Tensor]] = None) -> torch.Tensor:
    """What linear_cross_entropy, linear_policy_gradient and RemoteLMHead.forward run, their
    arguments checked."""
    if not torch.is_grad_enabled():
        return _evaluate(client, head, hidden, targets, reduction=reduction,
                        loss_options=loss_options, plan=plan, on_result=on_result, asked=asked,
                        inputs=inputs)
    return LinearCrossEntropyFunction.apply(hidden, targets, client, head, reduction,
                                            loss_options, plan, not training, on_result, asked,
                                            inputs)
