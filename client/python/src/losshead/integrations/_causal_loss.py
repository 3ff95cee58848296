"""The loss a causal LM's offloaded forward returns, as Hugging Face's causal LM loss computes it:
the label shift, the ignore index, the reduction (with the Trainer's `num_items_in_batch`), and
the output type and hidden states a model of that layout hands around. Nothing here speaks to a
server.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

import torch

IGNORE_INDEX = -100  # Hugging Face's causal LM loss ignores this label


@dataclass
class CausalLMOutput:
    """What the offloaded forward returns when no model library supplies its output type."""

    loss: torch.Tensor
    logits: Any = None  # None, or the predicted ids (B, T) with eval_predictions in eval mode
    past_key_values: Any = None
    hidden_states: Any = None
    attentions: Any = None

    def to_tuple(self) -> tuple:
        return tuple(v for v in (self.loss, self.logits, self.past_key_values,
                                 self.hidden_states, self.attentions) if v is not None)


def causal_targets(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """The target of every position: the label of the next one; the last position ignored.

    The label shift of Hugging Face's causal LM loss (logits[..., :-1] predict labels[..., 1:])
    written as a shift of the labels rather than a slice of the hidden states: every position's
    hidden state goes to the server as it is (a view of the batch, not a copy), and the last
    position of each sequence counts for nothing. Labels equal to `ignore_index` (padding,
    prompts) stay ignored; the attention mask is not consulted, as in Hugging Face.
    """
    if labels.dim() == 0:
        raise ValueError("losshead: labels must have a sequence dimension")
    targets = labels.new_full(labels.shape, ignore_index)
    targets[..., :-1] = labels[..., 1:]
    return targets


def reduce_loss(loss_sum: torch.Tensor, token_count: int,
                num_items_in_batch: Union[int, torch.Tensor, None] = None) -> torch.Tensor:
    """The summed token loss of a call reduced as Hugging Face's causal LM loss reduces it.

    With `num_items_in_batch` (the non-ignored tokens of the whole gradient-accumulation batch,
    which the Trainer passes along): sum / num_items_in_batch. Without it: the mean over the
    call's `token_count` non-ignored tokens; NaN when there are none, with a zero gradient, as
    F.cross_entropy gives.
    """
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss_sum.device)
        return loss_sum / num_items_in_batch
    if token_count == 0:
        return loss_sum + float("nan")  # dH of an all-ignored batch is zero and stays zero
    return loss_sum / token_count


def last_hidden_state(out: Any) -> torch.Tensor:
    if torch.is_tensor(out):
        return out
    hidden = getattr(out, "last_hidden_state", None)
    if hidden is None and isinstance(out, (tuple, list)) and len(out) > 0:
        hidden = out[0]
    if not torch.is_tensor(hidden):
        raise TypeError(f"losshead: model.model returned {type(out).__name__}; expected hidden "
                        "states (a tensor, .last_hidden_state, or a tuple starting with them)")
    return hidden


def keeps_every_position(logits_to_keep: Any) -> bool:
    return logits_to_keep is None or (isinstance(logits_to_keep, int) and logits_to_keep == 0)
