"""A causal language model's LM head moved to a losshead server, without any model library.

The model has the layout of Hugging Face's *ForCausalLM classes: `model.model` (the trunk)
returns hidden states (a tensor, `.last_hidden_state`, or a tuple that starts with them),
`model.lm_head` is an nn.Linear over them (with a bias or without: Phi's has one, which the
head then holds as its output bias), and `model.config` may carry
`tie_word_embeddings` (the head then serves the input embedding too) and
`final_logit_softcapping` (Gemma 2/3). `offload_causal_lm` uploads
`lm_head.weight` into a head on the server, frees it locally and replaces the model's forward
on the instance: given labels it returns the loss computed by the server, with the label shift
and ignore index of Hugging Face's causal LM loss, and dH flows back into the trunk through
`RemoteLMHead`. `losshead.integrations.transformers` is the same call with the library's own
output type.

Why the forward refuses to run without labels: the whole point is that the N x V logits never
exist on the trainer, and the server returns only the loss and dH. Logits (generation,
evaluation metrics) need W back: `OffloadedHead.local_head(model)` for a block of code, or
`OffloadedHead.restore(model)` for good.

The pieces, one job each: `_causal_model` (what the model must look like; the placeholder
that takes `lm_head`'s place), `_causal_loss` (the label shift and the reduction of Hugging
Face's loss), `_offloaded_head` (`OffloadedHead`, the handle that installs the forward and
brings W back) and this module, which checks, creates, uploads and installs.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional

import torch
from torch import nn

from losshead import _wire
from losshead._plan import StepPlan
from losshead._types import LossOptions, to_matmul_precision
from losshead._wire import DTypeLike
from losshead.client import Client
from losshead.errors import LossheadError
from losshead.integrations._causal_loss import (IGNORE_INDEX, CausalLMOutput, causal_targets,
                                                reduce_loss)
from losshead.integrations._causal_model import (TIED_EMBEDDINGS_ERROR, OffloadedLMHead,
                                                 check_offloadable, logit_softcap,
                                                 model_logit_scale, tied_embedding)
from losshead.integrations._offloaded_head import OffloadedHead
from losshead.torch_bridge import RemoteLMHead

__all__ = ["CausalLMOutput", "IGNORE_INDEX", "OffloadedHead", "OffloadedLMHead",
           "TIED_EMBEDDINGS_ERROR", "causal_targets", "logit_softcap", "offload_causal_lm",
           "reduce_loss"]


def offload_causal_lm(model: nn.Module, client: Client, head: str, *, create: bool = True,
                      upload: Optional[bool] = None, head_dtype: Optional[DTypeLike] = None,
                      chunk_tokens: Optional[int] = None, streams: Optional[int] = None,
                      wire_dtype: Optional[DTypeLike] = None, ignore_index: int = IGNORE_INDEX,
                      label_smoothing: float = 0.0, z_loss: float = 0.0,
                      output_type: Callable[..., Any] = CausalLMOutput,
                      replicas: int = 1, shards: Optional[int] = None,
                      matmul_precision: Optional[str] = None,
                      plan: Optional[StepPlan] = None,
                      eval_predictions: bool = False) -> OffloadedHead:
    """Moves `model.lm_head` to the head `head` of a losshead server; returns its handle.

    `create` (default) creates the head with the model's V, D and `head_dtype` (default: the
    weight's dtype) and uploads lm_head.weight; ALREADY_EXISTS when it exists. `create=False`
    attaches to an existing head of the same V x D (ValueError otherwise) and uploads nothing
    (a data-parallel rank other than the one that created it, or a server that holds the trained
    head already); `upload` overrides either default. `replicas` spreads a created head over
    that many of the server's devices (0: all), `shards` shards it by vocabulary rows over that
    many (see Client.create_head). `matmul_precision` ("highest", "high", "medium") is what a
    created fp32 head's GEMMs may round their inputs to on the server's GPU (Client.create_head);
    None gives an fp32 head `torch.get_float32_matmul_precision()`, so that it computes as the
    model's own head would under the same global setting, and leaves a bf16 or fp16 head's unset
    (those take "highest" only: INVALID_ARGUMENT for another). An attached head keeps its own.
    The upload replaces W in one PushWeights stream of pieces, checked against the version the
    head had (FAILED_PRECONDITION if someone pushed in between). The model is checked before
    anything is sent; a failed upload deletes the head it had created, and the model is left as
    it was.

    Then lm_head.weight is emptied (its parameter kept, with no V x D memory: optimizers built
    on model.parameters() afterwards do not see it, so offload before building them and before
    wrapping the model for data parallelism) and `model.lm_head` becomes an `OffloadedLMHead`.
    The model's forward, replaced on the instance, runs `model.model` and sends the hidden
    states with the shifted labels (`causal_targets`) to the server through a `RemoteLMHead`
    (its `plan`, a StepPlan, default StepPlan(); `chunk_tokens`, `streams` and `wire_dtype`
    build one instead, as RemoteLMHead's do; the loss options: `ignore_index`, the config's
    final-logit soft-cap, `label_smoothing`, `z_loss`, overriding the head's defaults); the loss
    is `reduce_loss` of the server's sum, and `output_type(loss=..., logits=None, ...)` is
    returned (its `to_tuple()` with return_dict=False). Without labels, or when logits are
    asked for, it raises ValueError. dW accumulates on the server as the token sum; RemoteAdamW
    (or RemoteHeadOptimizer) divides it by the tokens of the window.

    `eval_predictions`: in eval() mode the output's `logits` are the predicted ids (B, T, int64;
    -1 where the shifted label is ignored) that the server computes in the same pass, in place
    of the logits a Trainer's `preprocess_logits_for_metrics` would reduce with argmax(-1), and
    `OffloadedHead.take_eval_accuracy()` counts the correct ones. Training steps are unchanged.

    A model whose head is tied to its input embedding (`tie_word_embeddings`, or the two sharing
    one tensor: Gemma, Llama-3.2 1B/3B, small Qwen) is offloaded whole: the tied matrix is
    uploaded once, and the input embedding module (an nn.Embedding of lm_head's shape) becomes
    an `OffloadedEmbedding` over the same head, so that its rows come from the server and their
    gradient lands in the head's window beside the head's own: one apply steps W with both, as
    the tied model's autograd would (losshead.embedding). A Gemma 3 scaled embedding keeps its
    factor; Gemma 1/2 scale in the trunk. The embedding's gradient must come from this loss
    alone (an auxiliary loss on the embedding's output would be rescaled wrongly).

    An lm_head with a bias (Phi) gives a head with an output bias (HeadSpec.bias): lm_head.bias
    is uploaded with W in the same push (in fp32 unless it is in the head's dtype already, as
    the server keeps b in fp32) and emptied locally as W is; the server computes the logits
    h . W^T + b, accumulates db beside dW and steps b with W. An attached head (`create=False`)
    must have a bias exactly when lm_head has one (ValueError otherwise).
    """
    lm_head = check_offloadable(model)
    embedding = tied_embedding(model, lm_head)
    has_bias = lm_head.bias is not None
    vocab_size, hidden_size = lm_head.weight.shape
    dtype = _wire.to_torch_dtype(head_dtype if head_dtype is not None else lm_head.weight.dtype)
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"losshead: a head's weights are bf16, fp16 or fp32, not {dtype}")
    if matmul_precision is not None:
        to_matmul_precision(matmul_precision)  # refused here, before anything is sent
    elif dtype == torch.float32:
        matmul_precision = torch.get_float32_matmul_precision()
    softcap = logit_softcap(getattr(model, "config", None))
    # Cohere's and Granite's scale on the logits: a property of the model, so the head's default.
    scale = model_logit_scale(getattr(model, "config", None))
    # Built before anything is sent: a plan it refuses leaves the server as it was.
    remote = RemoteLMHead(client, head, reduction="sum", ignore_index=ignore_index,
                          label_smoothing=label_smoothing, z_loss=z_loss, logit_softcap=softcap,
                          plan=plan, wire_dtype=wire_dtype, chunk_tokens=chunk_tokens,
                          streams=streams)
    created = False
    if create:
        info = client.create_head(
            head, vocab_size, hidden_size, weight_dtype=dtype, replicas=replicas, shards=shards,
            matmul_precision=matmul_precision, bias=has_bias,
            default_options=LossOptions(logit_scale=scale) if scale != 1.0 else None)
        created = True
    else:
        info = client.get_head(head)
        if (info.spec.vocab_size, info.spec.hidden_size) != (vocab_size, hidden_size):
            raise ValueError(
                f"losshead: head {head!r} is {info.spec.vocab_size} x {info.spec.hidden_size}, "
                f"the model's lm_head {vocab_size} x {hidden_size}")
        if bool(info.spec.bias) != has_bias:
            raise ValueError(
                f"losshead: head {head!r} {'has' if info.spec.bias else 'has no'} output bias, "
                f"the model's lm_head {'has' if has_bias else 'has no'} bias; attach to a head "
                "created from this model")
        defaults = info.spec.default_options
        have = defaults.logit_scale if defaults.HasField("logit_scale") else 1.0
        if have != _fp32(scale):
            raise ValueError(
                f"losshead: head {head!r} has the default logit_scale {have}, the model "
                f"{_fp32(scale)} (its config's logit_scale or logits_scaling); set the head's "
                "with client.set_loss_options, or create the head from the model")
    version = info.weights_version
    if upload if upload is not None else create:
        # b is kept in fp32 on the server: it travels in the head's dtype only when it is in
        # that dtype already (nothing rounded on the way), else W and b travel in fp32.
        wire = dtype if not has_bias or lm_head.bias.dtype == dtype else torch.float32
        try:
            version = client.push_weights(
                head, lm_head.weight, dtype=wire, expected_weights_version=version,
                bias=lm_head.bias.detach() if has_bias else None)
        except BaseException:
            if created:
                with contextlib.suppress(LossheadError):
                    client.delete_head(head)
            raise
    offloaded = OffloadedHead(client=client, head=head, remote=remote, linear=lm_head,
                              output_type=output_type, ignore_index=ignore_index,
                              weights_version=version, head_dtype=dtype,
                              eval_predictions=eval_predictions, embedding=embedding)
    offloaded._install(model)
    return offloaded


def _fp32(x: float) -> float:
    """`x` as the server keeps it (an fp32 field)."""
    return float(torch.tensor(x, dtype=torch.float32))
