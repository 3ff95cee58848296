"""A causal language model's LM head moved to a losshead server, without any model library.

The model has the layout of Hugging Face's *ForCausalLM classes: `model.model` (the trunk)
returns hidden states (a tensor, `.last_hidden_state`, or a tuple that starts with them),
`model.lm_head` is an nn.Linear without bias over them, and `model.config` may carry
`tie_word_embeddings` and `final_logit_softcapping` (Gemma 2/3). `offload_causal_lm` uploads
`lm_head.weight` into a head on the server, frees it locally and replaces the model's forward
on the instance: given labels it returns the loss computed by the server, with the label shift
and ignore index of Hugging Face's causal LM loss, and dH flows back into the trunk through
`RemoteLMHead`. `losshead.integrations.transformers` is the same call with the library's own
output type.

Why the forward refuses to run without labels: the whole point is that the N x V logits never
exist on the trainer, and the server returns only the loss and dH. Logits (generation,
evaluation metrics) need W back: `OffloadedHead.local_head(model)` for a block of code, or
`OffloadedHead.restore(model)` for good.
"""

from __future__ import annotations

import contextlib
import types
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Union

import torch
from torch import nn

from losshead import _wire
from losshead._dist import Ranks
from losshead._types import to_matmul_precision
from losshead._window import UnsteppedHeadWarning, tracker
from losshead._wire import DTypeLike
from losshead.client import Client
from losshead.errors import LossheadError
from losshead.joint import JointOptimizer
from losshead.torch_bridge import RemoteLMHead

__all__ = ["CausalLMOutput", "IGNORE_INDEX", "OffloadedHead", "OffloadedLMHead",
           "TIED_EMBEDDINGS_ERROR", "causal_targets", "logit_softcap", "offload_causal_lm",
           "reduce_loss"]

IGNORE_INDEX = -100  # Hugging Face's causal LM loss ignores this label

TIED_EMBEDDINGS_ERROR = (
    "losshead: the model ties its LM head to its input embeddings (tie_word_embeddings), so the "
    "head cannot be offloaded: the trunk's embedding would keep training locally while the same "
    "matrix trained as the head on the server, and the two copies would diverge. Keep the head "
    "local, or untie it first if separate input and output matrices are what you want "
    "(config.tie_word_embeddings = False and lm_head.weight a copy of the embedding).")

# Configuration fields of models that rescale the logits between the head and the loss (Cohere
# multiplies them, Granite divides them). The server computes plain logits, with an optional
# soft-cap only, so such a model would be trained on another loss than its own.
_LOGIT_SCALES = ("logit_scale", "logits_scaling")

_OFFLOAD_ATTR = "_losshead_offloaded_head"


@dataclass
class CausalLMOutput:
    """What the offloaded forward returns when no model library supplies its output type."""

    loss: torch.Tensor
    logits: None = None
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


def _configs(config: Any) -> List[Any]:
    """The model's configuration and, for a multimodal one, its text model's."""
    if config is None:
        return []
    found = [config]
    get_text = getattr(config, "get_text_config", None)
    if callable(get_text):
        text = get_text()
        if text is not None and text is not config:
            found.append(text)
    return found


def logit_softcap(config: Any) -> float:
    """The final-logit soft-cap c of c * tanh(logits / c) (Gemma 2/3's
    config.final_logit_softcapping); 0 when the model has none."""
    for c in _configs(config):
        cap = getattr(c, "final_logit_softcapping", None)
        if cap:
            return float(cap)
    return 0.0


def _check_offloadable(model: nn.Module) -> nn.Linear:
    """The model's lm_head when it can be offloaded; a clear error otherwise (nothing changed)."""
    if getattr(model, _OFFLOAD_ATTR, None) is not None or isinstance(
            getattr(model, "lm_head", None), OffloadedLMHead):
        raise ValueError("losshead: this model's LM head is offloaded already")
    trunk = getattr(model, "model", None)
    lm_head = getattr(model, "lm_head", None)
    if not isinstance(trunk, nn.Module) or not isinstance(lm_head, nn.Linear):
        raise TypeError(
            f"losshead: {type(model).__name__} is not a causal LM of the expected layout: it "
            "needs `.model` (a module returning hidden states) and `.lm_head` (an nn.Linear over "
            f"them); found model={type(trunk).__name__}, lm_head={type(lm_head).__name__}")
    if lm_head.bias is not None:
        raise ValueError("losshead: lm_head has a bias; a losshead head is a matrix without one")
    weight = lm_head.weight
    if weight.device.type == "meta":
        raise ValueError("losshead: lm_head.weight is on the meta device (not materialised, or "
                         "dispatched elsewhere): there is nothing to upload")
    configs = _configs(getattr(model, "config", None))
    tied_in_config = any(getattr(c, "tie_word_embeddings", False) for c in configs)
    shared = any(p is weight or (p.numel() and p.data_ptr() == weight.data_ptr())
                 for p in trunk.parameters())
    if tied_in_config or shared:
        raise ValueError(TIED_EMBEDDINGS_ERROR)
    for c in configs:
        for name in _LOGIT_SCALES:
            value = getattr(c, name, None)
            if value is not None and float(value) != 1.0:
                raise ValueError(
                    f"losshead: config.{name} = {value} rescales the logits before the loss; the "
                    "server computes plain logits (with an optional soft-cap), so this model "
                    "would train on another loss than its own")
    return lm_head


class OffloadedLMHead(nn.Module):
    """Stands in for `lm_head` while W lives on the server: no parameters, no V x D memory.

    `weight` is an empty (0 x D) tensor on the meta device kept outside the parameters and
    buffers, so that optimizers, state_dict and model.to() never see it. Calling the module
    raises: the model's forward computes the loss without it. Loading a state dict that holds
    `lm_head.weight` (a checkpoint's, `from_pretrained`'s own weights, the Trainer's resume)
    uploads it to the server's head instead (`OffloadedHead.upload_weight`); without it, a
    strict load reports the key missing.
    """

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype, head: str,
                 target: str) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.head = head
        self.target = target
        self.weight = torch.empty((0, in_features), dtype=dtype, device="meta")
        self._owner: Optional["OffloadedHead"] = None
        # Set while loading a checkpoint whose W is beside the model's weights rather than among
        # them (FSDP's sharded checkpoints: hf_trainer uploads it from its own file).
        self.weight_elsewhere = False

    def _load_from_state_dict(self, state_dict: Dict[str, Any], prefix: str, local_metadata: Any,
                              strict: bool, missing_keys: List[str], unexpected_keys: List[str],
                              error_msgs: List[str]) -> None:
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        key = prefix + "weight"
        if key in unexpected_keys:
            unexpected_keys.remove(key)
        if key not in state_dict:
            if strict and not self.weight_elsewhere:
                missing_keys.append(key)
            return
        weight = state_dict[key]
        if tuple(weight.shape) != (self.out_features, self.in_features):
            error_msgs.append(f"size mismatch for {key}: copying a param with shape "
                              f"{tuple(weight.shape)}, the offloaded head is "
                              f"{self.out_features} x {self.in_features}")
            return
        if self._owner is not None:
            self._owner.upload_weight(weight)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"head={self.head!r}, target={self.target!r}")

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise RuntimeError(
            f"losshead: lm_head lives on the losshead server ({self.target}, head "
            f"{self.head!r}) and has no local weights. The model's forward computes the loss "
            "there when given labels; for logits, bring W back with "
            "`with offloaded.local_head(model): ...` or `offloaded.restore(model)`")


def _last_hidden_state(out: Any) -> torch.Tensor:
    if torch.is_tensor(out):
        return out
    hidden = getattr(out, "last_hidden_state", None)
    if hidden is None and isinstance(out, (tuple, list)) and len(out) > 0:
        hidden = out[0]
    if not torch.is_tensor(hidden):
        raise TypeError(f"losshead: model.model returned {type(out).__name__}; expected hidden "
                        "states (a tensor, .last_hidden_state, or a tuple starting with them)")
    return hidden


def _keeps_every_position(logits_to_keep: Any) -> bool:
    return logits_to_keep is None or (isinstance(logits_to_keep, int) and logits_to_keep == 0)


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

    While offloaded, `model.lm_head` is an `OffloadedLMHead` and `model.state_dict()` has no
    `lm_head.weight`: `export_state_dict()` downloads it (a complete checkpoint is
    `{**model.state_dict(), **offloaded.export_state_dict()}`, e.g. as `save_pretrained`'s
    `state_dict`), `restore(model)` puts W back into the model and its forward back as it was
    (then `save_pretrained` writes a normal checkpoint), and `local_head(model)` does that for
    one block of code only (generation, logits).
    """

    def __init__(self, *, client: Client, head: str, remote: RemoteLMHead, linear: nn.Linear,
                 output_type: Callable[..., Any], ignore_index: int, weights_version: int,
                 head_dtype: Optional[torch.dtype] = None) -> None:
        self.client = client
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
        self._placeholder = OffloadedLMHead(self.hidden_size, self.vocab_size, self._dtype,
                                            head, client.target)
        self._placeholder._owner = self
        self._warned_unattached = False
        self._previous_forward: Any = None
        self._had_own_forward = False
        self._installed = False

    def __repr__(self) -> str:
        return (f"OffloadedHead(head={self.head!r}, target={self.client.target!r}, "
                f"{self.vocab_size} x {self.hidden_size}, installed={self._installed})")

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

    def upload_weight(self, weight: torch.Tensor) -> int:
        """Replaces the server's W with `weight` (V x D; in the head's dtype on the wire, checked
        against the head's version); returns the new version. Under data parallelism rank 0
        alone uploads and the others return the version they know (loading a state dict runs
        on every rank)."""
        if Ranks().is_leader:
            version = self.client.get_head(self.head).weights_version
            self.weights_version = self.client.push_weights(
                self.head, weight.detach(), dtype=self.head_dtype,
                expected_weights_version=version)
            tracker(self.client.target, self.head).note_push()
        return self.weights_version

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
        w = self.client.download_weights(self.head)
        self.weights_version = w.version
        return w.weights.to(self._dtype)

    def export_state_dict(self) -> Dict[str, torch.Tensor]:
        """{"lm_head.weight": W} as trained on the server, in the model's dtype, on the CPU."""
        return {"lm_head.weight": self.download_weight()}

    def restore(self, model: nn.Module, *, delete_head: bool = False) -> int:
        """Downloads W into model.lm_head.weight (the model's own module and parameter, in its
        dtype, on the trunk's device) and gives the model its forward back; returns the weights
        version. With `delete_head` the server's head is deleted afterwards."""
        self._check_installed(model)
        weight = self.download_weight()
        self._uninstall(model, weight)
        if delete_head:
            self.client.delete_head(self.head)
        return self.weights_version

    @contextlib.contextmanager
    def local_head(self, model: nn.Module) -> Iterator[nn.Module]:
        """W in the model for the block (generation, logits), offloaded again after it.

        Whatever the block does to the local W is discarded: the server's W is the trained one.
        """
        self._check_installed(model)
        self._uninstall(model, self.download_weight())
        try:
            yield model
        finally:
            self._install(model)

    # -- the model's side --------------------------------------------------------------------
    def _check_installed(self, model: nn.Module) -> None:
        if not self._installed or getattr(model, _OFFLOAD_ATTR, None) is not self:
            raise ValueError(f"losshead: head {self.head!r} is not offloaded from this model")

    def _install(self, model: nn.Module) -> None:
        weight = self._linear.weight
        # In place on the parameter, as FSDP frees its shards: an optimizer or a caller still
        # holding the parameter does not keep the V x D tensor alive.
        weight.data = torch.empty((0, self.hidden_size), dtype=self._dtype, device=self._device)
        weight.grad = None
        model.lm_head = self._placeholder
        self._had_own_forward = "forward" in model.__dict__
        self._previous_forward = model.__dict__.get("forward")
        model.forward = types.MethodType(_offloaded_forward(self), model)
        setattr(model, _OFFLOAD_ATTR, self)
        self._installed = True

    def _uninstall(self, model: nn.Module, weight: torch.Tensor) -> None:
        # W goes where the trunk is now: model.to() after the offload moved the trunk but not
        # the emptied parameter, which is outside the model meanwhile.
        trunk_param = next(model.model.parameters(), None)
        self._device = trunk_param.device if trunk_param is not None else self._device
        self._linear.weight.data = weight.to(device=self._device, dtype=self._dtype)
        model.lm_head = self._linear
        if self._had_own_forward:
            model.forward = self._previous_forward
        else:
            del model.forward
        self._previous_forward = None
        delattr(model, _OFFLOAD_ATTR)
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
        if not _keeps_every_position(logits_to_keep):
            raise ValueError(
                f"losshead: logits_to_keep={logits_to_keep!r} asks for logits, which an "
                "offloaded head does not produce; use `offloaded.local_head(model)`")
        trunk_args = {k: v for k, v in trunk_args.items() if v is not None}
        out = model.model(**trunk_args, **kwargs)
        hidden = _last_hidden_state(out)
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
        loss_sum = self.remote(hidden.reshape(-1, self.hidden_size), targets.reshape(-1))
        assert self.remote.last_result is not None
        loss = reduce_loss(loss_sum, self.remote.last_result.token_count, num_items_in_batch)
        output = self._output_type(
            loss=loss, logits=None, past_key_values=getattr(out, "past_key_values", None),
            hidden_states=getattr(out, "hidden_states", None),
            attentions=getattr(out, "attentions", None))
        return output.to_tuple() if return_dict is False else output


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


def offload_causal_lm(model: nn.Module, client: Client, head: str, *, create: bool = True,
                      upload: Optional[bool] = None, head_dtype: Optional[DTypeLike] = None,
                      chunk_tokens: int = 2048, streams: int = 4,
                      wire_dtype: DTypeLike = torch.bfloat16, ignore_index: int = IGNORE_INDEX,
                      label_smoothing: float = 0.0, z_loss: float = 0.0,
                      output_type: Callable[..., Any] = CausalLMOutput,
                      replicas: int = 1, shards: Optional[int] = None,
                      matmul_precision: Optional[str] = None) -> OffloadedHead:
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
    (`chunk_tokens`, `streams`, `wire_dtype`; the loss options: `ignore_index`, the config's
    final-logit soft-cap, `label_smoothing`, `z_loss`, overriding the head's defaults); the loss
    is `reduce_loss` of the server's sum, and `output_type(loss=..., logits=None, ...)` is
    returned (its `to_tuple()` with return_dict=False). Without labels, or when logits are
    asked for, it raises ValueError. dW accumulates on the server as the token sum; RemoteAdamW
    (or RemoteHeadOptimizer) divides it by the tokens of the window.
    """
    lm_head = _check_offloadable(model)
    vocab_size, hidden_size = lm_head.weight.shape
    dtype = _wire.to_torch_dtype(head_dtype if head_dtype is not None else lm_head.weight.dtype)
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"losshead: a head's weights are bf16, fp16 or fp32, not {dtype}")
    if matmul_precision is not None:
        to_matmul_precision(matmul_precision)  # refused here, before anything is sent
    elif dtype == torch.float32:
        matmul_precision = torch.get_float32_matmul_precision()
    softcap = logit_softcap(getattr(model, "config", None))
    created = False
    if create:
        info = client.create_head(head, vocab_size, hidden_size, weight_dtype=dtype,
                                  replicas=replicas, shards=shards,
                                  matmul_precision=matmul_precision)
        created = True
    else:
        info = client.get_head(head)
        if (info.spec.vocab_size, info.spec.hidden_size) != (vocab_size, hidden_size):
            raise ValueError(
                f"losshead: head {head!r} is {info.spec.vocab_size} x {info.spec.hidden_size}, "
                f"the model's lm_head {vocab_size} x {hidden_size}")
    version = info.weights_version
    if upload if upload is not None else create:
        try:
            version = client.push_weights(head, lm_head.weight, dtype=dtype,
                                          expected_weights_version=version)
        except BaseException:
            if created:
                with contextlib.suppress(LossheadError):
                    client.delete_head(head)
            raise
    remote = RemoteLMHead(client, head, reduction="sum", ignore_index=ignore_index,
                          label_smoothing=label_smoothing, z_loss=z_loss, logit_softcap=softcap,
                          wire_dtype=wire_dtype, chunk_tokens=chunk_tokens, streams=streams)
    offloaded = OffloadedHead(client=client, head=head, remote=remote, linear=lm_head,
                              output_type=output_type, ignore_index=ignore_index,
                              weights_version=version, head_dtype=dtype)
    offloaded._install(model)
    return offloaded
