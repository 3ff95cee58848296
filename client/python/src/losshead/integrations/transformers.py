"""Hugging Face causal LMs with their LM head on a losshead server, in one call.

    from losshead import Client
    from losshead.integrations.transformers import offload_lm_head

    client = Client("127.0.0.1:50051")
    model = AutoModelForCausalLM.from_pretrained(...)          # or from_config
    offloaded = offload_lm_head(model, client, "llama-head")   # W uploaded, freed locally
    trainer = offloaded.attach(Trainer(model=model, args=args, train_dataset=data))
    trainer.train()                                            # the Trainer steps the head

    # or a loop of your own: the trunk's optimizer and the head as one optimizer
    opt = offloaded.optimizer(torch.optim.AdamW(model.parameters(), lr=3e-4))
    loss = model(input_ids, attention_mask=mask, labels=labels).loss
    loss.backward(); opt.clip_grad_norm_(1.0); opt.step(); opt.zero_grad()
    offloaded.restore(model); model.save_pretrained(out_dir)   # a normal checkpoint

Any model whose output layer is `lm_head` over `model` works the same: Llama, Mistral,
Qwen2/Qwen3, Gemma 2/3 (the final-logit soft-cap goes to the server as the loss option
logit_softcap). Models that tie the head to the input embeddings (tie_word_embeddings: Gemma's
and several small Llama / Qwen checkpoints) are offloaded whole: the head serves the input
embedding too (losshead.embedding.OffloadedEmbedding), so W leaves the trainer entirely, and one
apply steps it with both gradients. The forward returns a
transformers CausalLMOutputWithPast whose loss is the model's own (label shift, ignore index
-100, and `num_items_in_batch` from the Trainer's gradient accumulation: the sum divided by it)
and whose logits are None. See `losshead.integrations.causal_lm` for the details, the handle
it returns, and the rules on logits, generation and checkpoints, and
`losshead.integrations.hf_trainer` for what `attach` makes of the Trainer.

This module imports transformers only when `offload_lm_head` is called, so importing it never
needs transformers; calling it without transformers raises ImportError.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from torch import nn

from losshead._plan import StepPlan
from losshead._wire import DTypeLike
from losshead.client import Client
from losshead.integrations.causal_lm import IGNORE_INDEX, OffloadedHead, offload_causal_lm

__all__ = ["OffloadedHead", "offload_lm_head"]


def _causal_lm_output_type() -> Callable[..., Any]:
    try:
        from transformers.modeling_outputs import CausalLMOutputWithPast
    except ImportError as e:
        raise ImportError(
            "losshead.integrations.transformers needs the 'transformers' package, which is not "
            f"installed here ({e}); install it (pip install transformers), or use "
            "losshead.integrations.causal_lm.offload_causal_lm for a model of the same layout "
            "without it") from e
    return CausalLMOutputWithPast


def offload_lm_head(model: nn.Module, client: Client, head: str = "lm-head", *,
                    create: bool = True, upload: Optional[bool] = None,
                    head_dtype: Optional[DTypeLike] = None, chunk_tokens: Optional[int] = None,
                    streams: Optional[int] = None, wire_dtype: Optional[DTypeLike] = None,
                    ignore_index: int = IGNORE_INDEX, label_smoothing: float = 0.0,
                    z_loss: float = 0.0, replicas: int = 1, shards: Optional[int] = None,
                    matmul_precision: Optional[str] = None,
                    plan: Optional[StepPlan] = None,
                    eval_predictions: bool = False) -> OffloadedHead:
    """Offloads a transformers causal LM's `lm_head` to the losshead head `head`.

    `create` (default) creates the head with the model's V x D and dtype (`head_dtype` to
    choose another, e.g. bf16 under fp32 master weights) and uploads lm_head.weight with the
    version check; `create=False` attaches to an existing head of the same shape and uploads
    nothing unless `upload=True` (the other ranks of a data-parallel job, or a resumed run).
    A created head sits on one of the server's GPUs, or is replicated over `replicas` of them or
    sharded by vocabulary rows over `shards` (0: every GPU of the server).
    A created fp32 head's GEMMs run under `matmul_precision`, by default the process's
    `torch.get_float32_matmul_precision()`, as the model's own head would. `plan` (a
    StepPlan) is how its batches travel (`chunk_tokens`, `streams`, `wire_dtype` build one
    instead, as RemoteLMHead's do). The returned
    `OffloadedHead` exports W back (`export_state_dict`, `restore`, `local_head`);
    `eval_predictions` gives an eval-mode forward's output the predicted ids as `logits` (for
    the Trainer's `compute_metrics`, without `preprocess_logits_for_metrics`);
    `causal_lm.offload_causal_lm` documents every argument.
    """
    output_type = _causal_lm_output_type()
    return offload_causal_lm(model, client, head, create=create, upload=upload,
                             head_dtype=head_dtype, chunk_tokens=chunk_tokens, streams=streams,
                             wire_dtype=wire_dtype, ignore_index=ignore_index,
                             label_smoothing=label_smoothing, z_loss=z_loss,
                             output_type=output_type, replicas=replicas, shards=shards,
                             matmul_precision=matmul_precision, plan=plan,
                             eval_predictions=eval_predictions)
