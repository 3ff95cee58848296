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

from typing import Any, List, Optional, Tuple

import torch
from torch import nn

from losshead import _wire
from losshead._chunk_plan import plan_chunks
from losshead._window import WindowTracker, tracker
from losshead._wire import DTypeLike
from losshead.client import Client, GradientSummary, LossOptions, StepResult

_REDUCTIONS = ("mean", "sum", "none")


class _RemoteLinearCrossEntropy(torch.autograd.Function):
    """loss = CE(hidden @ W^T, targets) on the server; dH comes back with the loss."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, targets: torch.Tensor,  # type: ignore[override]
                module: "RemoteLMHead") -> torch.Tensor:
        result = module._step(hidden, targets, need_grad_hidden=ctx.needs_input_grad[0],
                              forward_only=not module.training)
        out_dtype = torch.promote_types(hidden.dtype, torch.float32)
        if module.reduction == "none":
            assert result.per_token_loss is not None
            loss = result.per_token_loss.to(device=hidden.device, dtype=out_dtype)
            loss = loss.reshape(targets.shape)
            scale = 1.0
        elif module.reduction == "sum":
            loss = torch.tensor(result.loss_sum, dtype=out_dtype, device=hidden.device)
            scale = 1.0
        else:
            # 0/0 is NaN, as in F.cross_entropy when every target is ignored.
            count = result.token_count
            loss = torch.tensor(result.loss_sum / count if count else float("nan"),
                                dtype=out_dtype, device=hidden.device)
            scale = 1.0 / count if count else 0.0
        ctx.grad_hidden = result.grad_hidden
        ctx.scale = scale
        ctx.hidden_meta = (hidden.shape, hidden.dtype, hidden.device)
        ctx.per_token = module.reduction == "none"
        return loss

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor  # type: ignore[override]
                 ) -> Tuple[Optional[torch.Tensor], None, None]:
        shape, dtype, device = ctx.hidden_meta
        dh = ctx.grad_hidden
        ctx.grad_hidden = None  # one backward per forward; free the buffer early
        if dh is None:
            return None, None, None
        # Computed in fp32 at least: dH arrives in bf16 and the upstream gradient may be tiny.
        work = torch.promote_types(dtype, torch.float32)
        # dH of a CUDA batch is on its device already (step_chunked copied each stream's part
        # there as soon as that stream was done); a CPU batch's stays where it is.
        dh = dh.to(device=device).to(work)
        g = grad_output.to(work)
        if ctx.per_token:
            dh = dh * g.reshape(-1, 1)
        else:
            dh = dh * (g * ctx.scale)
        return dh.to(dtype).reshape(shape), None, None


class RemoteLMHead(nn.Module):
    """The LM head + cross-entropy of a model, computed by a losshead server.

    forward(hidden (..., D), targets (...)) takes floating-point hidden states and integer class
    ids of hidden's shape without D (or either side flattened); anything else raises
    LossheadError (INVALID_ARGUMENT) before anything is sent. It returns the loss: a scalar for
    reduction "mean" (over non-ignored tokens; NaN when there are none) or "sum", per-token
    losses of targets' shape for "none" (0 at ignored tokens). backward returns dH from that
    same step, times the upstream gradient; no second round trip. W lives on the server; dW
    accumulates there (see the module docstring for its normalisation) until
    `RemoteHeadOptimizer` pulls it.

    Loss options left as None inherit the head's defaults. Hidden states travel as
    `wire_dtype` (bf16). A batch is cut into micro-batches pipelined over `streams` Step
    streams, each on a connection of its own unless the client caps them (losshead._chunk_plan):
    at most `chunk_tokens` each, `depth` per stream where that keeps them at `min_chunk_tokens`
    or more (the upload of one overlaps the computation and download of the previous), and,
    with `edge_tokens`, a small first and last one so that the server starts early and the last
    answer comes back fast. Four streams run a Llama-sized step about 5 % faster than two
    (BENCHMARKS.md). The loss, dH and dW do not depend on the cut (each chunk is summed on the
    server and the sums are added up).

    Which steps count: only a forward in training mode (`module.training`, the default) with
    grad mode on adds to the head's dW. In eval() mode the server runs forward-only steps (the
    loss on the current W, nothing added to dW or to the window's counts) and still returns dH
    when grad mode is on, so gradients reach the trunk and the inputs while the head stays
    out, as a frozen head's would. With grad mode off (`torch.no_grad()`, or `evaluate`) the
    steps are forward-only and carry no dH. `last_result` holds the combined StepResult of the
    last call, training or evaluation. A training micro-batch is noted in the head's
    `window` (losshead._window), which warns (UnsteppedHeadWarning) when many run against
    the same weights version: nothing steps the head.
    """

    def __init__(self, client: Client, head: str, *, reduction: str = "mean",
                 ignore_index: Optional[int] = None, label_smoothing: Optional[float] = None,
                 z_loss: Optional[float] = None, logit_softcap: Optional[float] = None,
                 wire_dtype: DTypeLike = torch.bfloat16, grad_hidden_dtype: Optional[DTypeLike] = None,
                 chunk_tokens: int = 2048, streams: int = 4,
                 min_chunk_tokens: int = 1024, depth: int = 4, edge_tokens: int = 256) -> None:
        super().__init__()
        if reduction not in _REDUCTIONS:
            raise ValueError(f"reduction must be one of {_REDUCTIONS}, not {reduction!r}")
        self.client = client
        self.head = head
        self.reduction = reduction
        self.loss_options = LossOptions(ignore_index=ignore_index, label_smoothing=label_smoothing,
                                        z_loss=z_loss, logit_softcap=logit_softcap)
        self.wire_dtype = wire_dtype
        self.grad_hidden_dtype = grad_hidden_dtype
        self.chunk_tokens = int(chunk_tokens)
        self.streams = int(streams)
        self.min_chunk_tokens = int(min_chunk_tokens)
        self.depth = int(depth)
        self.edge_tokens = int(edge_tokens)
        self.last_result: Optional[StepResult] = None
        self._tokens = 0

    def extra_repr(self) -> str:
        return f"head={self.head!r}, target={self.client.target!r}, reduction={self.reduction!r}"

    def forward(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return self.evaluate(hidden, targets)
        return _RemoteLinearCrossEntropy.apply(hidden, targets, self)

    def take_token_count(self) -> int:
        """Non-ignored tokens this module stepped since the last call (for data parallelism)."""
        n, self._tokens = self._tokens, 0
        return n

    def _chunks_for(self, n: int) -> List[int]:
        """The micro-batch sizes of a batch of `n` tokens (see losshead._chunk_plan)."""
        return plan_chunks(n, streams=self.streams, chunk_tokens=self.chunk_tokens,
                           min_chunk_tokens=self.min_chunk_tokens, depth=self.depth,
                           edge_tokens=self.edge_tokens)

    def _step(self, hidden: torch.Tensor, targets: torch.Tensor, *, need_grad_hidden: bool,
              forward_only: bool = False) -> StepResult:
        chunks = self._chunks_for(targets.numel())
        result = self.client.step_chunked(
            self.head, hidden.detach(), targets.detach(), chunks=chunks,
            streams=self.streams, reduction="sum", grad_scale=1.0,
            loss_options=self.loss_options, hidden_dtype=self.wire_dtype,
            return_per_token_loss=self.reduction == "none",
            skip_grad_hidden=not need_grad_hidden, grad_hidden_dtype=self.grad_hidden_dtype,
            grad_hidden_device=hidden.device if hidden.is_cuda else None,
            forward_only=forward_only)
        if not forward_only:
            self._tokens += result.token_count
            self.window.note_training(1, result.weights_version, result.token_count)
        self.last_result = result
        return result

    @property
    def window(self) -> WindowTracker:
        """What this process put into the head's open window (losshead._window)."""
        return tracker(self.client.target, self.head)

    @torch.no_grad()
    def evaluate(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The loss on the server from forward-only steps: nothing is added to dW or counted.

        Same chunking, streams, wire dtype and loss options as training, without dH: the
        micro-batches leave dW, the pull's token and micro-batch counts and `take_token_count`
        alone, so evaluating between optimizer steps does not disturb the gradient window.
        Returns what `forward` would (a scalar, or per-token losses for reduction "none"), as a
        tensor without a graph. A server without forward-only support raises LossheadError
        (UNIMPLEMENTED) after having counted the micro-batches in dW.
        """
        result = self.client.step_chunked(
            self.head, hidden.detach(), targets.detach(),
            chunks=self._chunks_for(targets.numel()),
            streams=self.streams, reduction="sum", loss_options=self.loss_options,
            hidden_dtype=self.wire_dtype, return_per_token_loss=self.reduction == "none",
            skip_grad_hidden=True, forward_only=True)
        self.last_result = result
        out_dtype = torch.promote_types(hidden.dtype, torch.float32)
        if self.reduction == "none":
            assert result.per_token_loss is not None
            return result.per_token_loss.to(device=hidden.device, dtype=out_dtype).reshape(
                targets.shape)
        total = result.loss_sum
        if self.reduction == "mean":
            # 0/0 is NaN, as in F.cross_entropy when every target is ignored.
            count = result.token_count
            total = total / count if count else float("nan")
        return torch.tensor(total, dtype=out_dtype, device=hidden.device)


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
        self.version = self.client.push_weights(self.head, w, dtype=self.push_dtype,
                                                expected_weights_version=self.version)
        tracker(self.client.target, self.head).note_push()
        return self.version

    def step(self, optimizer: torch.optim.Optimizer) -> GradientSummary:
        """pull_gradient, optimizer.step, push; clears weight.grad. Returns the pull's summary."""
        summary = self.pull_gradient()
        optimizer.step()
        self.push()
        self.weight.grad = None
        return summary


def scale_gradients_(parameters: Any, factor: float) -> None:
    """Multiplies every existing .grad in `parameters` by `factor` in place."""
    for p in parameters:
        if p.grad is not None:
            p.grad.mul_(factor)
