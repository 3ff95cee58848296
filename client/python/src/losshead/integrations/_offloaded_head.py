"""`OffloadedHead`: the handle of a model whose LM head lives on a losshead server.

It installs the offloaded forward on the model instance and takes it away again (`restore`,
`local_head`), exports W, uploads a loaded `lm_head.weight`, refuses copies, and connects the
head to what steps it (`optimizer`, `attach`). `losshead.integrations.causal_lm` creates it.
"""

from __future__ import annotations

import contextlib
import types
import warnings
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn

from losshead._dist import Ranks
from losshead._window import UnsteppedHeadWarning, tracker
from losshead.client import Client
from losshead.functional import Asked
from losshead.integrations._causal_loss import (causal_targets, keeps_every_position,
                                                last_hidden_state, reduce_loss)
from losshead.embedding import OffloadedEmbedding
from losshead.integrations._causal_model import OFFLOAD_ATTR, OffloadedLMHead, embedding_scale
from losshead.joint import JointOptimizer
from losshead.torch_bridge import RemoteLMHead

BIAS_KEY = "lm_head.bias"  # where a checkpoint keeps b, as nn.Linear's state dict names it


class OffloadedHead:
    """A model's LM head on a losshead server; what `offload_causal_lm` returns.

    `remote` is the RemoteLMHead the model's forward steps through (reduction "sum"; its
    `take_token_count()` serves data parallelism), `client` and `head` name the server's head,
    `vocab_size` and `hidden_size` its shape, `weights_version` the version uploaded or attached
    to. What steps it: `attach(trainer)` (a Hugging Face Trainer's own loop, or an accelerate
    Accelerator's clipping), `optimizer(trunk_optimizer)` (the trunk's optimizer with the head
    in it, for a loop of your own), or `RemoteAdamW(offloaded.client, offloaded.head, ...)`. The
    model's mode decides what a forward does to the head: in train() mode with grad enabled it
    adds to the gradient window; in eval() mode (or under no_grad) the server runs forward-only
    steps. Copying or pickling the model raises, naming the way (`local_head`).

    With `eval_predictions` (an argument of `offload_causal_lm`, or set on the handle) an
    eval-mode forward also returns, in the output's `logits`, the ids the head predicts (B, T):
    what a Trainer's `preprocess_logits_for_metrics` usually makes of logits
    (`logits.argmax(-1)`), computed on the server in the same pass, so that `compute_metrics`
    gets its predictions without the N x V logits; ignored positions hold -1.
    `take_eval_accuracy()` gives the token accuracy of those forwards.

    While offloaded, `model.lm_head` is an `OffloadedLMHead` and `model.state_dict()` has no
    `lm_head.weight`: `export_state_dict()` downloads it (a complete checkpoint is
    `{**model.state_dict(), **offloaded.export_state_dict()}`, e.g. as `save_pretrained`'s
    `state_dict`), `restore(model)` puts W back into the model and its forward back as it was
    (then `save_pretrained` writes a normal checkpoint), and `local_head(model)` does that for
    one block of code only (generation, logits).

    A tied model (config.tie_word_embeddings; `tied` is True) keeps nothing of W either: its
    input embedding module is replaced by `embedding`, an OffloadedEmbedding over the same head
    (rows looked up on the server, their gradient sent back into the head's window, a Gemma 3
    scaled embedding's factor applied after the lookup), and `model.state_dict()` lacks the
    embedding's weight too. `weight_keys()` names the key a tied checkpoint keeps W under
    (the embedding's), which `export_state_dict()` fills; restore() and local_head() put the
    original embedding back, still tied to lm_head.

    A head with an output bias (Phi's lm_head; `has_bias`) keeps b on the server beside W: the
    server adds it to the logits, accumulates db in the same window and steps it with W. Here
    lm_head.bias is emptied as lm_head.weight is, `export_state_dict()` holds "lm_head.bias" too,
    restore() and local_head() put it back, and a loaded "lm_head.bias" goes up with W.
    """

    def __init__(self, *, client: Client, head: str, remote: RemoteLMHead, linear: nn.Linear,
                 output_type: Callable[..., Any], ignore_index: int, weights_version: int,
                 head_dtype: Optional[torch.dtype] = None, eval_predictions: bool = False,
                 embedding: Optional[Tuple[str, nn.Embedding]] = None) -> None:
        self.client = client
        self.eval_predictions = eval_predictions
        # Token accuracy of the eval-mode forwards with eval_predictions, since the last take.
        self._eval_correct = 0
        self._eval_tokens = 0
        self.head = head
        self.remote = remote
        self.ignore_index = ignore_index
        self.weights_version = weights_version
        self.vocab_size, self.hidden_size = linear.weight.shape
        self._linear = linear  # the model's own module, its weight emptied while offloaded
        self._dtype = linear.weight.dtype
        self._device = linear.weight.device
        self._output_type = output_type
        self.head_dtype = head_dtype if head_dtype is not None else self._dtype
        self.has_bias = linear.bias is not None
        self._bias_dtype = linear.bias.dtype if linear.bias is not None else None
        self._placeholder = OffloadedLMHead(self.hidden_size, self.vocab_size, self._dtype,
                                            head, client.target, bias_dtype=self._bias_dtype)
        self._placeholder._owner = self
        # A tied model (tied_embedding): its input embedding, whose module is replaced by an
        # OffloadedEmbedding over the same head while offloaded.
        self.tied = embedding is not None
        self._embedding_path = embedding[0] if embedding is not None else None
        self._embedding_module = embedding[1] if embedding is not None else None
        self.embedding: Optional[OffloadedEmbedding] = None
        if embedding is not None:
            module = embedding[1]
            self.embedding = OffloadedEmbedding(
                client, head, self.vocab_size, self.hidden_size, dtype=self._dtype,
                padding_idx=module.padding_idx, scale=embedding_scale(module))
            self.embedding._owner = self
            self._placeholder.tied = True
        self._uploaded: Optional[Tuple[Any, ...]] = None  # what upload_weight sent last
        self._warned_unattached = False
        self._previous_forward: Any = None
        self._had_own_forward = False
        self._installed = False

    def __repr__(self) -> str:
        return (f"OffloadedHead(head={self.head!r}, target={self.client.target!r}, "
                f"{self.vocab_size} x {self.hidden_size}, installed={self._installed})")

    # -- evaluation --------------------------------------------------------------------------
    def take_eval_accuracy(self) -> Tuple[int, int]:
        """(correct, tokens) over the eval-mode forwards of this process since the last call:
        the non-ignored shifted labels and how many of them the head's argmax predicted
        (`eval_predictions`); (0, 0) without them. Sum it over data-parallel ranks for the
        global token accuracy, correct / tokens."""
        taken = (self._eval_correct, self._eval_tokens)
        self._eval_correct = self._eval_tokens = 0
        return taken

    # -- training loops ----------------------------------------------------------------------
    def optimizer(self, trunk_optimizer: torch.optim.Optimizer, **options: Any) -> JointOptimizer:
        """The trunk's optimizer and this head as one torch optimizer (`losshead.joint`): build
        the learning-rate schedule on it, clip with its `clip_grad_norm_`, step and zero it as
        usual; every rank of a data-parallel job does. `options` go to JointOptimizer (the
        head's `kind` and hyper-parameters, `grad_divisor`, `sharded`, `process_group`)."""
        return JointOptimizer(trunk_optimizer, self.client, self.head, **options)

    def attach(self, loop: Any, **options: Any) -> Any:
        """Makes a training loop's own machinery drive this head; returns `loop`.

        A Hugging Face Trainer: its optimizer, schedule, clipping, gradient accumulation, fp16
        scaling, checkpoints and resume (`losshead.integrations.hf_trainer.attach`; `options`
        are the head's optimizer settings as for `optimizer`). An accelerate Accelerator that
        prepared `offloaded.optimizer(...)`: its `clip_grad_norm_` clips trunk and head by one
        global norm (`losshead.integrations.accelerate`)."""
        if hasattr(loop, "args") and hasattr(loop, "create_optimizer"):
            from losshead.integrations.hf_trainer import attach

            return attach(self, loop, **options)
        if hasattr(loop, "prepare") and hasattr(loop, "clip_grad_norm_"):
            if options:
                raise TypeError("losshead: an Accelerator takes no options; give them to "
                                "offloaded.optimizer(...)")
            from losshead.integrations.accelerate import attach_accelerator

            return attach_accelerator(loop)
        raise TypeError(f"losshead: attach takes a transformers Trainer or an accelerate "
                        f"Accelerator, not {type(loop).__name__}")

    def upload_weight(self, weight: Optional[torch.Tensor],
                      bias: Optional[torch.Tensor] = None) -> int:
        """Replaces the server's W with `weight` (V x D; in the head's dtype on the wire, checked
        against the head's version), and b with `bias` for a head with an output bias, in one
        push; returns the new version. One of W and b alone (a checkpoint that holds the other
        elsewhere) goes up with the server's other. Under data parallelism rank 0 alone uploads
        and the others return the version they know (loading a state dict runs on every
        rank)."""
        if bias is not None and not self.has_bias:
            raise ValueError(f"losshead: head {self.head!r} has no output bias (the model's "
                             "lm_head had none when it was offloaded): lm_head.bias cannot go up")
        if weight is None and bias is None:
            return self.weights_version
        # A tied checkpoint may hold W under both keys (lm_head's and the embedding's), one
        # tensor loaded twice: it goes up once.
        stamp = tuple((t.data_ptr(), tuple(t.shape), t._version) if t is not None else None
                      for t in (weight, bias)) + (self.weights_version,)
        if self._uploaded == stamp:
            return self.weights_version
        if Ranks().is_leader:
            info = self.client.get_head(self.head)
            if self.has_bias and (weight is None or bias is None):
                held_w, held_b = self.download_head()
                weight = held_w if weight is None else weight
                bias = held_b if bias is None else bias
            self.weights_version = self.client.push_weights(
                self.head, weight.detach(), dtype=self._wire_dtype(),
                bias=None if bias is None else bias.detach(),
                expected_weights_version=info.weights_version)
            tracker(self.client.target, self.head).note_push()
        self._uploaded = stamp[:-1] + (self.weights_version,)
        return self.weights_version

    def _wire_dtype(self) -> torch.dtype:
        """The dtype W (and b) travel in: the head's, except where b, kept in fp32 on the
        server, would be rounded on the way (a bias of another dtype than the head's): fp32."""
        if self.has_bias and self._bias_dtype != self.head_dtype:
            return torch.float32
        return self.head_dtype

    # -- copies ------------------------------------------------------------------------------
    def _no_copy(self) -> TypeError:
        return TypeError(
            f"losshead: this model's LM head lives on the losshead server ({self.client.target}, "
            f"head {self.head!r}), and a copy would share that one head with the original (a "
            "reference or EMA model would then train or read the original's head). Copy it with "
            "W local: `with offloaded.local_head(model): twin = copy.deepcopy(model)` (the copy "
            "has a normal lm_head), then offload the copy to a head of its own if it should "
            "live on the server too: `offload_lm_head(twin, client, 'another-head')`. To save "
            "the model, use save_pretrained or the Trainer's checkpoints (lm_head.weight "
            "included) rather than pickling it")

    def __deepcopy__(self, memo: Dict[int, Any]) -> "OffloadedHead":
        raise self._no_copy()

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise self._no_copy()

    # -- export ------------------------------------------------------------------------------
    def download_weight(self) -> torch.Tensor:
        """W from the server (V x D, the model's lm_head dtype, on the CPU)."""
        return self.download_head()[0]

    def download_head(self) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """W and, for a head with an output bias, b from the server (in the model's lm_head
        dtypes, on the CPU; b None without one), read in one download."""
        w = self.client.download_weights(self.head, dtype=self._wire_dtype())
        self.weights_version = w.version
        bias = None
        if self.has_bias:
            if w.bias is None:
                raise ValueError(f"losshead: head {self.head!r} on {self.client.target} has no "
                                 "output bias, and the model's lm_head has one")
            bias = w.bias.to(self._bias_dtype)
        return w.weights.to(self._dtype), bias

    def weight_keys(self) -> List[str]:
        """The state-dict keys W goes under in a checkpoint of the model: "lm_head.weight", or for
        a tied model the input embedding's (e.g. "model.embed_tokens.weight"), the one key a
        tied model's own checkpoint keeps (save_pretrained drops the tied lm_head.weight), which
        from_pretrained ties lm_head to."""
        if self._embedding_path is not None:
            return [f"{self._embedding_path}.weight"]
        return ["lm_head.weight"]

    def export_state_dict(self) -> Dict[str, torch.Tensor]:
        """{key: W} as trained on the server, in the model's dtype, on the CPU, for each of
        `weight_keys()`; and {"lm_head.bias": b} for a head with an output bias."""
        weight, bias = self.download_head()
        state = {key: weight for key in self.weight_keys()}
        if bias is not None:
            state[BIAS_KEY] = bias
        return state

    def restore(self, model: nn.Module, *, delete_head: bool = False) -> int:
        """Downloads W into model.lm_head.weight (the model's own module and parameter, in its
        dtype, on the trunk's device), b into lm_head.bias for a head with an output bias, and
        gives the model its forward back; returns the weights version. With `delete_head` the
        server's head is deleted afterwards."""
        self._check_installed(model)
        self._uninstall(model, *self.download_head())
        if delete_head:
            self.client.delete_head(self.head)
        return self.weights_version

    @contextlib.contextmanager
    def local_head(self, model: nn.Module) -> Iterator[nn.Module]:
        """W in the model for the block (generation, logits), offloaded again after it.

        Whatever the block does to the local W is discarded: the server's W is the trained one.
        """
        self._check_installed(model)
        self._uninstall(model, *self.download_head())
        try:
            yield model
        finally:
            self._install(model)

    # -- the model's side --------------------------------------------------------------------
    def _check_installed(self, model: nn.Module) -> None:
        if not self._installed or getattr(model, OFFLOAD_ATTR, None) is not self:
            raise ValueError(f"losshead: head {self.head!r} is not offloaded from this model")

    def _install(self, model: nn.Module) -> None:
        weight = self._linear.weight
        # In place on the parameter, as FSDP frees its shards: an optimizer or a caller still
        # holding the parameter does not keep the V x D tensor alive.
        weight.data = torch.empty((0, self.hidden_size), dtype=self._dtype, device=self._device)
        weight.grad = None
        bias = self._linear.bias
        if bias is not None:
            bias.data = torch.empty((0,), dtype=bias.dtype, device=self._device)
            bias.grad = None
        model.lm_head = self._placeholder
        if self.embedding is not None:
            # The tied parameter is lm_head's, emptied above: the embedding's module keeps it
            # (and the tie) for _uninstall.
            _set_module(model, self._embedding_path, self.embedding)
        self._had_own_forward = "forward" in model.__dict__
        self._previous_forward = model.__dict__.get("forward")
        model.forward = types.MethodType(_offloaded_forward(self), model)
        setattr(model, OFFLOAD_ATTR, self)
        self._installed = True

    def _uninstall(self, model: nn.Module, weight: torch.Tensor,
                   bias: Optional[torch.Tensor] = None) -> None:
        # W goes where the trunk is now: model.to() after the offload moved the trunk but not
        # the emptied parameter, which is outside the model meanwhile.
        trunk_param = next(model.model.parameters(), None)
        self._device = trunk_param.device if trunk_param is not None else self._device
        self._linear.weight.data = weight.to(device=self._device, dtype=self._dtype)
        if self._linear.bias is not None and bias is not None:
            self._linear.bias.data = bias.to(device=self._device, dtype=self._bias_dtype)
        model.lm_head = self._linear
        if self._embedding_module is not None:
            if self.embedding is not None:
                self.embedding.flush()  # its gradients are in the window before W leaves
            _set_module(model, self._embedding_path, self._embedding_module)
        if self._had_own_forward:
            model.forward = self._previous_forward
        else:
            del model.forward
        self._previous_forward = None
        delattr(model, OFFLOAD_ATTR)
        self._installed = False

    def _check_stepped(self) -> None:
        """A Trainer-style loop with nothing in this process to step the head: said at once."""
        if not self._warned_unattached and tracker(self.client.target,
                                                   self.head).steppers == 0:
            self._warned_unattached = True
            _warn_unattached(self)

    def _run(self, model: nn.Module, *, labels: Optional[torch.Tensor],
                logits_to_keep: Any, return_dict: Optional[bool],
                trunk_args: Dict[str, Any], kwargs: Dict[str, Any]) -> Any:
        """The model's forward while offloaded (see `offload_causal_lm`)."""
        num_items_in_batch = kwargs.pop("num_items_in_batch", None)
        shift_labels = kwargs.pop("shift_labels", None)
        logits_to_keep = kwargs.pop("num_logits_to_keep", logits_to_keep)
        if labels is None and shift_labels is None:
            raise ValueError(
                f"losshead: the LM head is offloaded to {self.client.target} (head "
                f"{self.head!r}): the model's forward computes the loss only and needs labels. "
                "For logits or generation, bring W back with "
                "`with offloaded.local_head(model): ...` or `offloaded.restore(model)`")
        if not keeps_every_position(logits_to_keep):
            raise ValueError(
                f"losshead: logits_to_keep={logits_to_keep!r} asks for logits, which an "
                "offloaded head does not produce; use `offloaded.local_head(model)`")
        trunk_args = {k: v for k, v in trunk_args.items() if v is not None}
        out = model.model(**trunk_args, **kwargs)
        hidden = last_hidden_state(out)
        if shift_labels is not None:
            targets = shift_labels  # already shifted by the caller (e.g. context parallelism)
        else:
            targets = causal_targets(labels, self.ignore_index)  # type: ignore[arg-type]
        if tuple(targets.shape) != tuple(hidden.shape[:-1]) or hidden.shape[-1] != self.hidden_size:
            raise ValueError(f"losshead: labels of shape {tuple(targets.shape)} do not match "
                             f"hidden states of shape {tuple(hidden.shape)} (hidden size "
                             f"{self.hidden_size})")
        # The model's mode decides: in eval() the server runs forward-only steps (nothing added to
        # dW), whether or not grad mode is on.
        self.remote.training = model.training
        if num_items_in_batch is not None and model.training and torch.is_grad_enabled():
            self._check_stepped()
        predict = self.eval_predictions and not model.training
        self.remote.asked = _PREDICTIONS if predict else Asked()
        loss_sum = self.remote(hidden.reshape(-1, self.hidden_size), targets.reshape(-1))
        result = self.remote.last_result
        assert result is not None
        loss = reduce_loss(loss_sum, result.token_count, num_items_in_batch)
        predictions = None
        if predict:
            assert result.outputs is not None and result.outputs.argmax is not None
            # What preprocess_logits_for_metrics usually computes, logits.argmax(-1): the id
            # predicted at each position (for the next token), int64 in the labels' shape; -1
            # where the shifted label is ignored (the last position among them).
            predictions = result.outputs.argmax.to(torch.int64).reshape(targets.shape)
            self._eval_correct += int(result.outputs.correct_count or 0)
            self._eval_tokens += result.token_count
        output = self._output_type(
            loss=loss, logits=predictions, past_key_values=getattr(out, "past_key_values", None),
            hidden_states=getattr(out, "hidden_states", None),
            attentions=getattr(out, "attentions", None))
        return output.to_tuple() if return_dict is False else output


# What an eval-mode forward asks for with eval_predictions.
_PREDICTIONS = Asked.of(("argmax",), correct_count=True)


def _set_module(model: nn.Module, path: Optional[str], module: nn.Module) -> None:
    """model's submodule at `path` ("model.embed_tokens") replaced by `module`."""
    assert path is not None
    parent_path, _, name = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    setattr(parent, name, module)


def _warn_unattached(offloaded: "OffloadedHead") -> None:
    warnings.warn(
        f"losshead: the model is trained by a loop that passes num_items_in_batch (the Hugging "
        f"Face Trainer), but nothing in this process steps head {offloaded.head!r} on "
        f"{offloaded.client.target}: its window would grow and W never change. Call "
        "`offloaded.attach(trainer)` after building the Trainer (or step it with "
        "`offloaded.optimizer(...)` / RemoteAdamW in a loop of your own)",
        UnsteppedHeadWarning, stacklevel=4)


def _offloaded_forward(offloaded: OffloadedHead) -> Callable[..., Any]:
    """The forward installed on the model instance. Its parameters are named as Hugging Face's
    (the Trainer keeps the dataset columns a forward names and passes num_items_in_batch to a
    forward that takes **kwargs); the trunk receives those that are given."""

    def forward(self: nn.Module, input_ids: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.Tensor] = None, past_key_values: Any = None,
                inputs_embeds: Optional[torch.Tensor] = None,
                labels: Optional[torch.Tensor] = None, use_cache: Optional[bool] = None,
                output_attentions: Optional[bool] = None,
                output_hidden_states: Optional[bool] = None, return_dict: Optional[bool] = None,
                cache_position: Optional[torch.Tensor] = None, logits_to_keep: Any = 0,
                **kwargs: Any) -> Any:
        trunk_args = dict(input_ids=input_ids, attention_mask=attention_mask,
                          position_ids=position_ids, past_key_values=past_key_values,
                          inputs_embeds=inputs_embeds, use_cache=use_cache,
                          output_attentions=output_attentions,
                          output_hidden_states=output_hidden_states,
                          cache_position=cache_position)
        return offloaded._run(self, labels=labels, logits_to_keep=logits_to_keep,
                                 return_dict=return_dict, trunk_args=trunk_args, kwargs=kwargs)

    return forward
