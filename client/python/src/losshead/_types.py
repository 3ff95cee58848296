"""The package's value types: loss options, step results, gradients, weights, progress."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, List, Optional, Sequence, Union

import torch

from losshead._proto.losshead.v1 import losshead_pb2 as pb

ReductionLike = Union[str, int, None]

_REDUCTIONS = {
    None: pb.REDUCTION_UNSPECIFIED, "": pb.REDUCTION_UNSPECIFIED,
    "mean": pb.REDUCTION_MEAN, "sum": pb.REDUCTION_SUM, "none": pb.REDUCTION_NONE,
}


def to_reduction(reduction: ReductionLike) -> int:
    """The proto Reduction for "mean" | "sum" | "none" | None (inherit) or an enum value."""
    if isinstance(reduction, int):
        return reduction
    try:
        return _REDUCTIONS[reduction.lower() if isinstance(reduction, str) else reduction]
    except KeyError:
        raise ValueError(f"losshead: unknown reduction {reduction!r}") from None


# The names of torch.set_float32_matmul_precision, so that torch.get_float32_matmul_precision()
# can be handed over as it is.
_MATMUL_PRECISIONS = {
    "highest": pb.MATMUL_PRECISION_HIGHEST, "high": pb.MATMUL_PRECISION_HIGH,
    "medium": pb.MATMUL_PRECISION_MEDIUM,
}


def to_matmul_precision(precision: str) -> int:
    """The proto MatmulPrecision for "highest" | "high" | "medium"."""
    try:
        return _MATMUL_PRECISIONS[precision]
    except (KeyError, TypeError):
        raise ValueError(f"losshead: matmul_precision must be 'highest', 'high' or 'medium' "
                         f"(as torch.set_float32_matmul_precision) or None, got "
                         f"{precision!r}") from None


TokenOutputLike = Union[str, int]

# StepOptions.token_outputs by name (see TokenOutput in the proto).
_TOKEN_OUTPUTS = {
    "logprob": pb.TOKEN_OUTPUT_LOGPROB, "entropy": pb.TOKEN_OUTPUT_ENTROPY,
    "lse": pb.TOKEN_OUTPUT_LSE, "argmax": pb.TOKEN_OUTPUT_ARGMAX,
}


def to_token_outputs(outputs: Iterable[TokenOutputLike]) -> List[int]:
    """The proto TokenOutputs for "logprob" | "entropy" | "lse" | "argmax" or enum values (which
    go as they are: the server judges them)."""
    if isinstance(outputs, (str, int)):
        outputs = [outputs]
    values = []
    for o in outputs:
        if isinstance(o, int):
            values.append(o)
            continue
        try:
            values.append(_TOKEN_OUTPUTS[o.lower()])
        except (KeyError, AttributeError):
            raise ValueError(f"losshead: unknown token output {o!r} (one of "
                             f"{', '.join(_TOKEN_OUTPUTS)})") from None
    return values


@dataclass
class TokenOutputs:
    """What the model predicts per token, from the same pass as the loss (see TokenOutput in the
    proto): the distribution p = softmax(logits after the soft-cap). Each is None unless asked.

    `logprob` is log p(target) (fp32; 0 at ignored tokens), `entropy` the entropy of p (fp32; 0
    at ignored tokens), `lse` the log-sum-exp of the logits (fp32, every token), `argmax` the
    predicted class (int32, the lowest id among ties; -1 at ignored tokens), all of the
    targets' shape (flattened, N, in a StepResult). `correct_count` (with
    return_correct_count) counts the non-ignored tokens whose argmax is their target.
    `top_k_ids` (int32) and `top_k_logprobs` (fp32), with top_k = k, are of shape (..., k):
    per token the k classes of largest logit, in decreasing logit (ties by increasing id, so
    the first is `argmax`), and their log-probabilities; -1 and 0 at ignored tokens.
    """

    logprob: Optional[torch.Tensor] = None
    entropy: Optional[torch.Tensor] = None
    lse: Optional[torch.Tensor] = None
    argmax: Optional[torch.Tensor] = None
    correct_count: Optional[int] = None
    top_k_ids: Optional[torch.Tensor] = None
    top_k_logprobs: Optional[torch.Tensor] = None

    def map(self, fn: "Callable[[torch.Tensor], torch.Tensor]") -> "TokenOutputs":
        """The same outputs with `fn` applied to each tensor present; the top-k's as (N, k)
        tensors, `fn` applied to each of their k columns and the results stacked last."""
        def per_token(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
            return None if t is None else fn(t)

        def top_k(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
            if t is None:
                return None
            flat = t.reshape(-1, t.shape[-1])
            return torch.stack([fn(flat[:, i]) for i in range(flat.shape[1])], dim=-1)

        return TokenOutputs(*(per_token(t)
                              for t in (self.logprob, self.entropy, self.lse, self.argmax)),
                            correct_count=self.correct_count,
                            top_k_ids=top_k(self.top_k_ids),
                            top_k_logprobs=top_k(self.top_k_logprobs))


@dataclass
class LossOptions:
    """Loss options; None inherits (request -> head default -> built-in default).

    Built-in defaults: ignore_index -100, reduction mean, no label smoothing, z-loss or soft-cap,
    logit_scale 1, temperature 1, no entropy term, kind "cross_entropy".

    The loss terms (see the proto's LossOptions): `logit_scale` is the model's (logits =
    logit_scale * h . w; a head default), `temperature` a sampling temperature (the kernels take
    logit_scale / temperature), `entropy_coef` adds entropy_coef * H_t per token (negative: an
    entropy bonus), `kind` "cross_entropy" or "policy_gradient" (the clipped PPO / GRPO
    objective, which needs old log-probs and advantages per token), with `clip_low`,
    `clip_high` (the ratio's range [1 - clip_low, 1 + clip_high]) and `kl_coef` (the k3 KL
    estimator against reference log-probs).
    """

    ignore_index: Optional[int] = None
    reduction: ReductionLike = None
    label_smoothing: Optional[float] = None
    z_loss: Optional[float] = None
    logit_softcap: Optional[float] = None
    logit_scale: Optional[float] = None
    temperature: Optional[float] = None
    entropy_coef: Optional[float] = None
    kind: Optional[str] = None  # "cross_entropy" | "policy_gradient"
    clip_low: Optional[float] = None
    clip_high: Optional[float] = None
    kl_coef: Optional[float] = None

    def to_proto(self) -> pb.LossOptions:
        msg = pb.LossOptions(reduction=to_reduction(self.reduction))
        if self.ignore_index is not None:
            msg.ignore_index = int(self.ignore_index)
        if self.label_smoothing is not None:
            msg.label_smoothing = float(self.label_smoothing)
        if self.z_loss is not None:
            msg.z_loss = float(self.z_loss)
        if self.logit_softcap is not None:
            msg.logit_softcap = float(self.logit_softcap)
        for name in ("logit_scale", "temperature", "entropy_coef", "clip_low", "clip_high",
                     "kl_coef"):
            value = getattr(self, name)
            if value is not None:
                setattr(msg, name, float(value))
        if self.kind is not None:
            msg.kind = to_loss_kind(self.kind)
        return msg


_LOSS_KINDS = {"cross_entropy": pb.LOSS_KIND_CROSS_ENTROPY,
               "policy_gradient": pb.LOSS_KIND_POLICY_GRADIENT}


def to_loss_kind(kind: Union[str, int]) -> int:
    """"cross_entropy" | "policy_gradient" (or a pb.LossKind value) -> pb.LossKind."""
    if isinstance(kind, str):
        if kind not in _LOSS_KINDS:
            raise ValueError(f"kind must be one of {sorted(_LOSS_KINDS)}, got {kind!r}")
        return _LOSS_KINDS[kind]
    return int(kind)


# Per-token inputs of the loss terms: the micro-batch keyword and its pb.TokenInput, in the
# order of their StepRequest fields.
TOKEN_INPUTS = (("token_weights", pb.TOKEN_INPUT_WEIGHT),
                ("old_logprob", pb.TOKEN_INPUT_OLD_LOGPROB),
                ("advantages", pb.TOKEN_INPUT_ADVANTAGE),
                ("ref_logprob", pb.TOKEN_INPUT_REF_LOGPROB))


@dataclass
class StepResult:
    """The outcome of one micro-batch (or, from `step_chunked`, of all its chunks combined).

    `loss` is the reduced loss the server computed (for a combined result: `loss_sum`, or the
    mean over `token_count` for reduction "mean"), `grad_hidden` is dH (N x D, CPU, the dtype
    the server sent) unless skipped, `per_token_loss` the fp32 losses (N) when asked for.
    """

    loss: float
    loss_sum: float
    token_count: int
    weights_version: int
    replayed: bool
    client_id: str
    sequence: int
    grad_hidden: Optional[torch.Tensor] = None
    per_token_loss: Optional[torch.Tensor] = None
    forward_only: bool = False
    # The token outputs asked for (token_outputs, return_correct_count); None when none were.
    outputs: Optional[TokenOutputs] = None
    # The way its tensors went, where the native path reports it: "device" (the same-node
    # device path), "shared_memory" or "network"; None where unreported. A combined result
    # has its chunks' one way, or their ways joined with "+" (sorted).
    data_path: Optional[str] = None

    @property
    def accuracy(self) -> Optional[float]:
        """correct_count / token_count when return_correct_count was asked (NaN without
        tokens), else None."""
        if self.outputs is None or self.outputs.correct_count is None:
            return None
        return self.outputs.correct_count / self.token_count if self.token_count else float("nan")


@dataclass
class GradientSummary:
    """What a pulled dW covers (see GradientSummary in the proto)."""

    vocab_size: int
    hidden_size: int
    token_count: int
    microbatch_count: int
    min_weights_version: int
    max_weights_version: int
    was_reset: bool


@dataclass
class Gradient:
    grad: torch.Tensor  # V x D on the CPU, fp32 unless another dtype was asked for
    summary: GradientSummary
    grad_bias: Optional[torch.Tensor] = None  # db (V), same dtype, for a head with a bias


@dataclass
class Weights:
    weights: torch.Tensor  # V x D on the CPU
    version: int
    bias: Optional[torch.Tensor] = None  # b (V), same dtype, for a head with a bias


@dataclass
class ClientProgress:
    """Highest sequence of a client id applied to dW on the server ("acknowledged") and the
    highest one in the head's last checkpoint ("persisted"); None when there is none."""

    client_id: str
    acknowledged_sequence: Optional[int]
    persisted_sequence: Optional[int]

    @classmethod
    def from_proto(cls, msg: pb.ClientProgress) -> "ClientProgress":
        return cls(client_id=msg.client_id,
                   acknowledged_sequence=(msg.acknowledged_sequence
                                          if msg.HasField("acknowledged_sequence") else None),
                   persisted_sequence=(msg.persisted_sequence
                                       if msg.HasField("persisted_sequence") else None))


@dataclass
class HeadCheckpoint:
    """One head's checkpoint as written: what it holds and, per client id, what is persisted."""

    head: str
    weights_version: int
    microbatches_since_pull: int
    bytes: int
    write_seconds: float
    clients: List[ClientProgress] = field(default_factory=list)


def combine_results(parts: Sequence[StepResult]) -> StepResult:
    """One StepResult for consecutive chunks of a batch (sums and concatenations)."""
    loss_sum = sum(p.loss_sum for p in parts)
    dhs = [p.grad_hidden for p in parts]
    ptls = [p.per_token_loss for p in parts]
    return StepResult(
        loss=loss_sum, loss_sum=loss_sum, token_count=sum(p.token_count for p in parts),
        weights_version=min(p.weights_version for p in parts),
        replayed=all(p.replayed for p in parts), client_id=parts[0].client_id,
        forward_only=all(p.forward_only for p in parts),
        sequence=parts[0].sequence,
        grad_hidden=torch.cat(dhs) if all(x is not None for x in dhs) else None,  # type: ignore[arg-type]
        per_token_loss=torch.cat(ptls) if all(x is not None for x in ptls) else None,  # type: ignore[arg-type]
        outputs=_combine_outputs([p.outputs for p in parts]),
        data_path=_combine_paths([p.data_path for p in parts]))


def _combine_paths(paths: Sequence[Optional[str]]) -> Optional[str]:
    known = sorted({p for p in paths if p is not None})
    return "+".join(known) if known else None


def _combine_outputs(parts: Sequence[Optional[TokenOutputs]]) -> Optional[TokenOutputs]:
    """The chunks' token outputs concatenated and their correct counts summed; None unless
    every chunk has them."""
    if not parts or any(p is None for p in parts):
        return None
    present = [p for p in parts if p is not None]

    def cat(name: str) -> Optional[torch.Tensor]:
        got = [getattr(p, name) for p in present]
        return torch.cat(got) if all(t is not None for t in got) else None

    counts = [p.correct_count for p in present]
    return TokenOutputs(logprob=cat("logprob"), entropy=cat("entropy"), lse=cat("lse"),
                        argmax=cat("argmax"), top_k_ids=cat("top_k_ids"),
                        top_k_logprobs=cat("top_k_logprobs"),
                        correct_count=(sum(counts)  # type: ignore[arg-type]
                                       if all(c is not None for c in counts) else None))


def asks_outputs(options: pb.StepOptions) -> bool:
    """Whether `options` asks for any token output, the correct count or the top-k."""
    return bool(options.token_outputs or options.return_correct_count or options.top_k)


def missing_outputs(options: pb.StepOptions, outputs: TokenOutputs, n: int) -> str:
    """The token outputs `options` asked for that `outputs` lacks (a server older than them
    ignores the request), comma-separated; empty when none is missing."""
    asked = set(options.token_outputs)
    have = {pb.TOKEN_OUTPUT_LOGPROB: outputs.logprob, pb.TOKEN_OUTPUT_ENTROPY: outputs.entropy,
            pb.TOKEN_OUTPUT_LSE: outputs.lse, pb.TOKEN_OUTPUT_ARGMAX: outputs.argmax}
    names = [f"per_token_{pb.TokenOutput.Name(o)[len('TOKEN_OUTPUT_'):].lower()}"
             for o, t in have.items() if o in asked and (t is None or t.numel() != n)]
    if options.return_correct_count and outputs.correct_count is None:
        names.append("correct_count")
    k = options.top_k
    for name in ("top_k_ids", "top_k_logprobs"):
        t = getattr(outputs, name)
        if k and (t is None or t.numel() != n * k):
            names.append(name)
    return ", ".join(names)
