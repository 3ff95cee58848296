"""PyTorch bridge: a remote LM head as an nn.Module, and a local mirror of W for torch.optim.

Normalisation (how the mean loss stays exact across micro-batches and data-parallel ranks)
-----------------------------------------------------------------------------------------
Every training step reaches the server with reduction=SUM and grad_scale=1, whatever the
module's reduction. The server's dW accumulator therefore holds d(sum of token losses)/dW over
every micro-batch of every rank since the last pull, and the pull's summary says how many
non-ignored tokens that is (token_count, counted by the server). `RemoteHeadOptimizer` divides
by it, which gives the gradient of the mean loss over all tokens of the global batch: exactly
what a local head computes for that batch as one, however it was split into micro-batches,
chunks and ranks. The upstream gradient of the loss (e.g. a 1/accumulation factor) scales dH
locally but never dW: dW is always the token mean.

The trunk receives dH. With reduction="mean" (default) each call is normalised by its own
token count, like F.cross_entropy. For the exact global token mean on the trunk too, when
micro-batches hold different numbers of tokens, use reduction="sum" and divide the trunk's
gradients by the global token count: `RemoteHeadOptimizer.pull_gradient` returns it, and a
data-parallel rank that does not pull gets it by all-reducing `RemoteLMHead.take_token_count()`.

Data parallelism: one rank owns the mirror and its optimizer (pull, step, push); the others only
step. Every rank must have finished its steps before the pull (e.g. after the trunk's gradient
all-reduce) and must wait for the push before its next step (a barrier, or
`expected_weights_version`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, List, Optional, Sequence

import torch
from torch import nn

from losshead import _wire
from losshead._plan import StepPlan
from losshead._window import WindowTracker, tracker
from losshead._wire import DTypeLike
from losshead.client import Client, GradientSummary, LossOptions, StepResult
from losshead._types import TokenOutputLike, TokenOutputs
from losshead.functional import Asked, _check_reduction, _evaluate, _loss

_PLAN_FIELDS = ("wire_dtype", "grad_hidden_dtype", "chunk_tokens", "streams", "min_chunk_tokens",
                "depth", "edge_tokens")


def _plan_field(name: str) -> property:
    """RemoteLMHead.<name>: its plan's field, as the attribute it was before plans."""
    def get(self: "RemoteLMHead") -> Any:
        return getattr(self.plan, name)

    def set_(self: "RemoteLMHead", value: Any) -> None:
        self.plan = dataclasses.replace(self.plan, **{name: value})
    return property(get, set_, doc=f"`plan.{name}`; setting it replaces the plan")


class RemoteLMHead(nn.Module):
    """The LM head + cross-entropy of a model, computed by a losshead server.

    forward(hidden (..., D), targets (...)) takes floating-point hidden states and integer class
    ids of hidden's shape without D (or either side flattened); anything else raises
    LossheadError (INVALID_ARGUMENT) before anything is sent. It returns the loss: a scalar for
    reduction "mean" (over non-ignored tokens; NaN when there are none) or "sum", per-token
    losses of targets' shape for "none" (0 at ignored tokens). backward returns dH from that
    same step, times the upstream gradient; no second round trip. W lives on the server; dW
    accumulates there (see the module docstring for its normalisation) until
    `RemoteHeadOptimizer` pulls it. The module is a thin holder of its settings around
    `losshead.functional.LinearCrossEntropyFunction`, which `linear_cross_entropy` calls too.

    Loss options left as None inherit the head's defaults. How a batch travels is its `plan`
    (a `losshead.StepPlan`; default StepPlan()): hidden states as `wire_dtype` (bf16), cut
    into micro-batches pipelined over `streams` (4) Step streams, each on a connection of its
    own unless the client caps them: at most `chunk_tokens` (2048) each, `depth` (4) per stream
    where that keeps them at `min_chunk_tokens` (1024) or more (the upload of one overlaps the
    computation and download of the previous), and a small first and last one (`edge_tokens`,
    256) so that the server starts early and the last answer comes back fast. Four streams run
    a Llama-sized step about 5 % faster than two (BENCHMARKS.md). The loss, dH and dW do not
    depend on the plan (each chunk is summed on the server and the sums are added up). Those
    settings given as keyword arguments, the form before plans, build the plan (with `plan`
    too: TypeError); `module.streams` and the others read and replace the plan's.

    Which steps count: only a forward in training mode (`module.training`, the default) with
    grad mode on adds to the head's dW. In eval() mode the server runs forward-only steps (the
    loss on the current W, nothing added to dW or to the window's counts) and still returns dH
    when grad mode is on, so gradients reach the trunk and the inputs while the head stays
    out, as a frozen head's would. With grad mode off (`torch.no_grad()`, or `evaluate`) the
    steps are forward-only and carry no dH. `last_result` holds the combined StepResult of the
    last call, training or evaluation. A training micro-batch is noted in the head's
    `window` (losshead._window), which warns (UnsteppedHeadWarning) when many run against
    the same weights version: nothing steps the head.

    `token_outputs` (any of "logprob", "entropy", "lse", "argmax") and `return_correct_count`
    ask every step for what the model predicts, from the same pass (the loss and dH stay the
    same to the bit): `last_outputs` (a TokenOutputs, targets' shape) and
    `last_result.accuracy`; `top_k` (0: none; k in [1, 16], at most the vocabulary) the k most
    likely classes per token and their log-probabilities (`last_outputs.top_k_ids` and
    `top_k_logprobs`, shape (..., k)). `module.asked = Asked.of(...)` changes them between
    calls.
    """

    def __init__(self, client: Client, head: str, *, reduction: str = "mean",
                 ignore_index: Optional[int] = None, label_smoothing: Optional[float] = None,
                 z_loss: Optional[float] = None, logit_softcap: Optional[float] = None,
                 plan: Optional[StepPlan] = None, wire_dtype: Optional[DTypeLike] = None,
                 grad_hidden_dtype: Optional[DTypeLike] = None,
                 chunk_tokens: Optional[int] = None, streams: Optional[int] = None,
                 min_chunk_tokens: Optional[int] = None, depth: Optional[int] = None,
                 edge_tokens: Optional[int] = None,
                 token_outputs: Sequence[TokenOutputLike] = (),
                 return_correct_count: bool = False, top_k: int = 0) -> None:
        super().__init__()
        _check_reduction(reduction)
        given = {k: v for k, v in (("wire_dtype", wire_dtype),
                                   ("grad_hidden_dtype", grad_hidden_dtype),
                                   ("chunk_tokens", chunk_tokens), ("streams", streams),
                                   ("min_chunk_tokens", min_chunk_tokens), ("depth", depth),
                                   ("edge_tokens", edge_tokens)) if v is not None}
        if plan is not None and given:
            raise TypeError(f"RemoteLMHead: {', '.join(given)} belong to the plan; give them in "
                            "the StepPlan, not beside it")
        self.client = client
        self.head = head
        self.reduction = reduction
        self.loss_options = LossOptions(ignore_index=ignore_index, label_smoothing=label_smoothing,
                                        z_loss=z_loss, logit_softcap=logit_softcap)
        self.plan = plan if plan is not None else StepPlan(**given)
        self.last_result: Optional[StepResult] = None
        self.asked = Asked.of(token_outputs, return_correct_count, top_k)
        self._tokens = 0

    wire_dtype = _plan_field("wire_dtype")
    grad_hidden_dtype = _plan_field("grad_hidden_dtype")
    chunk_tokens = _plan_field("chunk_tokens")
    streams = _plan_field("streams")
    min_chunk_tokens = _plan_field("min_chunk_tokens")
    depth = _plan_field("depth")
    edge_tokens = _plan_field("edge_tokens")

    def extra_repr(self) -> str:
        return f"head={self.head!r}, target={self.client.target!r}, reduction={self.reduction!r}"

    def forward(self, hidden: torch.Tensor, targets: torch.Tensor,
                token_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The loss of hidden (..., D) against targets (...); `token_weights` (targets' shape)
        multiplies each token's loss and gradient. The loss terms (temperature, entropy_coef,
        logit_scale) are fields of `self.loss_options`; the policy-gradient loss is
        `losshead.functional.linear_policy_gradient`."""
        inputs = None if token_weights is None else {"token_weights": token_weights.detach()}
        return _loss(self.client, self.head, hidden, targets, reduction=self.reduction,
                     loss_options=self.loss_options, plan=self.plan, training=self.training,
                     on_result=self._took, asked=self.asked, inputs=inputs)

    def _took(self, result: StepResult) -> None:
        if not result.forward_only:
            self._tokens += result.token_count
        self.last_result = result

    def take_token_count(self) -> int:
        """Non-ignored tokens this module stepped since the last call (for data parallelism)."""
        n, self._tokens = self._tokens, 0
        return n

    def _chunks_for(self, n: int) -> List[int]:
        """The micro-batch sizes of a batch of `n` tokens (`plan.chunks`)."""
        return self.plan.chunks(n)

    @property
    def window(self) -> WindowTracker:
        """What this process put into the head's open window (losshead._window)."""
        return tracker(self.client.target, self.head)

    def evaluate(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The loss on the server from forward-only steps: nothing is added to dW or counted.

        Same plan and loss options as training, without dH: the micro-batches leave dW, the
        pull's token and micro-batch counts and `take_token_count` alone, so evaluating between
        optimizer steps does not disturb the gradient window. Returns what `forward` would (a
        scalar, or per-token losses for reduction "none"), as a tensor without a graph. A
        server without forward-only support raises LossheadError (UNIMPLEMENTED) after having
        counted the micro-batches in dW.
        """
        return _evaluate(self.client, self.head, hidden, targets, reduction=self.reduction,
                         loss_options=self.loss_options, plan=self.plan,
                         on_result=self._took, asked=self.asked)

    @property
    def last_outputs(self) -> Optional[TokenOutputs]:
        """The token outputs of the last call (`token_outputs`, `return_correct_count`), in its
        targets' shape on its hidden states' device; None when none were asked."""
        return None if self.last_result is None else self.last_result.outputs


def token_losses(logits: torch.Tensor, targets: torch.Tensor, *, ignore_index: int = -100,
                 label_smoothing: float = 0.0, z_loss: float = 0.0,
                 logit_softcap: float = 0.0) -> torch.Tensor:
    """Per-token loss with losshead's options (0 at ignored tokens); differentiable.

    The reference the server implements: optional soft-cap c*tanh(z/c), cross-entropy with label
    smoothing as in F.cross_entropy, plus z_loss * logsumexp^2.
    """
    if logit_softcap > 0:
        logits = logit_softcap * torch.tanh(logits / logit_softcap)
    ce = nn.functional.cross_entropy(logits, targets, ignore_index=ignore_index,
                                     label_smoothing=label_smoothing, reduction="none")
    if z_loss > 0:
        lse = torch.logsumexp(logits, dim=-1)
        ce = ce + z_loss * lse.square() * (targets != ignore_index).to(lse.dtype)
    return ce


class RemoteHeadOptimizer:
    """A local mirror of the remote W that any torch.optim optimizer can step.

    `weight` is an nn.Parameter (fp32 master copy by default) initialised from the server. Per
    optimisation step: `pull_gradient()` pulls dW with reset and sets weight.grad to the token
    mean (see the module docstring), the optimizer steps, `push()` sends W back in the head's
    dtype and checks that nobody else pushed in between (FAILED_PRECONDITION otherwise).
    `step(optimizer)` does all three.

    dW is pulled into the same host tensor every time, and W is pushed from the same staging
    tensor: a fresh multi-gigabyte tensor per step would cost its page faults, about as long as
    the transfer itself. So, as with torch's in-place gradients, `weight.grad` on the CPU in
    fp32 is that reused tensor: a copy of it must be taken to keep it past the next pull.

    A head with an output bias has `bias` too (an nn.Parameter of V, None without one), pulled,
    stepped and pushed with W: give the optimizer both (`[mirror.weight, mirror.bias]`, or two
    param groups for a bias without weight decay).
    """

    def __init__(self, client: Client, head: str, *, device: Any = "cpu",
                 dtype: torch.dtype = torch.float32, push_dtype: Optional[DTypeLike] = None,
                 normalize: bool = True) -> None:
        self.client = client
        self.head = head
        self.normalize = normalize
        info = client.get_head(head)
        self.push_dtype = push_dtype if push_dtype is not None else info.spec.weight_dtype
        downloaded = client.download_weights(head, dtype=torch.float32)
        self.version = downloaded.version
        self.weight = nn.Parameter(downloaded.weights.to(device=device, dtype=dtype))
        self.bias: Optional[nn.Parameter] = None
        if downloaded.bias is not None:
            self.bias = nn.Parameter(downloaded.bias.to(device=device, dtype=dtype))
        self.last_summary: Optional[GradientSummary] = None
        self._pulled: Optional[torch.Tensor] = None  # fp32 host tensor dW lands in
        self._staged: Optional[torch.Tensor] = None  # host tensor W is pushed from

    def pull_gradient(self) -> GradientSummary:
        """Pulls dW (reset) into weight.grad, divided by the tokens it covers; returns its summary.

        A window without tokens leaves a zero gradient.
        """
        if self._pulled is None:
            self._pulled = torch.empty(self.weight.shape, dtype=torch.float32)
        pulled = self.client.pull_gradient(self.head, reset=True, out=self._pulled)
        tracker(self.client.target, self.head).note_cut()
        count = pulled.summary.token_count
        g = pulled.grad
        if self.normalize:
            # In place on the pulled tensor: the division costs no second V x D allocation.
            if count:
                g.div_(count)
            else:
                g.zero_()
        self.weight.grad = g.to(device=self.weight.device, dtype=self.weight.dtype)
        if self.bias is not None and pulled.grad_bias is not None:
            gb = pulled.grad_bias
            if self.normalize:
                gb = gb / count if count else torch.zeros_like(gb)
            self.bias.grad = gb.to(device=self.bias.device, dtype=self.bias.dtype)
        self.last_summary = pulled.summary
        return pulled.summary

    @torch.no_grad()
    def push(self) -> int:
        """Sends W to the server; returns (and remembers) the new weights version."""
        w = self.weight.detach()
        wire = _wire.to_torch_dtype(self.push_dtype)
        if w.device.type != "cpu" or w.dtype != wire or not w.is_contiguous():
            # Converted (or brought to the host) into one reused tensor rather than a fresh one.
            if self._staged is None:
                self._staged = torch.empty(w.shape, dtype=wire)
            self._staged.copy_(w)
            w = self._staged
        bias = None if self.bias is None else self.bias.detach().to("cpu")
        self.version = self.client.push_weights(self.head, w, dtype=self.push_dtype,
                                                expected_weights_version=self.version, bias=bias)
        tracker(self.client.target, self.head).note_push()
        return self.version

    def step(self, optimizer: torch.optim.Optimizer) -> GradientSummary:
        """pull_gradient, optimizer.step, push; clears weight.grad. Returns the pull's summary."""
        summary = self.pull_gradient()
        optimizer.step()
        self.push()
        self.weight.grad = None
        if self.bias is not None:
            self.bias.grad = None
        return summary


def scale_gradients_(parameters: Any, factor: float) -> None:
    """Multiplies every existing .grad in `parameters` by `factor` in place."""
    for p in parameters:
        if p.grad is not None:
            p.grad.mul_(factor)
