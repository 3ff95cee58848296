"""What a causal LM must look like for its head to be offloaded, and what stands in for the head.

`check_offloadable` reads the model (its `.model` trunk, its `.lm_head` Linear, its
configuration) and refuses, before anything is sent, what the server cannot compute as the
model would: a tie to an input embedding it cannot serve, weights that are not there. A bias
(Phi's lm_head) goes to the server with W: the head is created with an output bias. `model_logit_scale` reads the
scale a model puts on its logits (Cohere, Granite), which the head takes as its default.
`tied_embedding` finds the input embedding a tied head serves too. `OffloadedLMHead` takes
`lm_head`'s place while W lives on the server.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Protocol, Tuple

import torch
from torch import nn


class _WeightOwner(Protocol):
    """What loading a state dict into the placeholder hands W (and b) to (OffloadedHead)."""

    def upload_weight(self, weight: Optional[torch.Tensor],
                      bias: Optional[torch.Tensor] = None) -> int: ...


TIED_EMBEDDINGS_ERROR = (
    "losshead: the model ties its LM head to its input embeddings (tie_word_embeddings), and an "
    "offloaded tied head serves the embedding too, which needs the input embedding as an "
    "nn.Embedding of the head's V x D (model.get_input_embeddings(), or model.model.embed_tokens) "
    "holding the same matrix as lm_head.weight. {found} Keep the head local, or untie it first "
    "(config.tie_word_embeddings = False and lm_head.weight a copy of the embedding).")

# Configuration fields of models that rescale the logits between the head and the loss: Cohere's
# logit_scale multiplies them, Granite's logits_scaling divides them. The head computes the same
# logits with its default LossOptions.logit_scale (the product of the multipliers over the
# divisors).
_LOGIT_MULTIPLIERS = ("logit_scale",)
_LOGIT_DIVISORS = ("logits_scaling",)

OFFLOAD_ATTR = "_losshead_offloaded_head"  # on the model: its OffloadedHead, while offloaded


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


def check_offloadable(model: nn.Module) -> nn.Linear:
    """The model's lm_head when it can be offloaded; a clear error otherwise (nothing changed)."""
    if getattr(model, OFFLOAD_ATTR, None) is not None or isinstance(
            getattr(model, "lm_head", None), OffloadedLMHead):
        raise ValueError("losshead: this model's LM head is offloaded already")
    trunk = getattr(model, "model", None)
    lm_head = getattr(model, "lm_head", None)
    if not isinstance(trunk, nn.Module) or not isinstance(lm_head, nn.Linear):
        raise TypeError(
            f"losshead: {type(model).__name__} is not a causal LM of the expected layout: it "
            "needs `.model` (a module returning hidden states) and `.lm_head` (an nn.Linear over "
            f"them); found model={type(trunk).__name__}, lm_head={type(lm_head).__name__}")
    for name, tensor in (("weight", lm_head.weight), ("bias", lm_head.bias)):
        if tensor is not None and tensor.device.type == "meta":
            raise ValueError(f"losshead: lm_head.{name} is on the meta device (not materialised, "
                             "or dispatched elsewhere): there is nothing to upload")
    tied_embedding(model, lm_head)  # a tie the head cannot serve is refused here
    model_logit_scale(getattr(model, "config", None))  # a scale the head cannot take, too
    return lm_head


def model_logit_scale(config: Any) -> float:
    """The factor the model puts on its logits before the loss: Cohere's config.logit_scale
    multiplies them, Granite's config.logits_scaling divides them (1 when the model has
    neither). A value that is not finite and > 0 (or whose scale is not a normal fp32 number)
    is a ValueError naming it."""
    scale = 1.0
    for c in _configs(config):
        found = False
        for name in _LOGIT_MULTIPLIERS + _LOGIT_DIVISORS:
            value = getattr(c, name, None)
            if value is None:
                continue
            found = True
            v = float(value)
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"losshead: config.{name} = {value} is not a logit scale (it "
                                 "must be finite and > 0)")
            scale = scale * v if name in _LOGIT_MULTIPLIERS else scale / v
        if found:
            break  # the first configuration that has them (the model's, or its text model's)
    if not (_FP32_TINY <= scale <= _FP32_MAX):
        raise ValueError(f"losshead: the model's logit scale {scale} is outside fp32's normal "
                         "range")
    return scale


_FP32_TINY = 1.1754943508222875e-38
_FP32_MAX = 3.4028234663852886e38


def tied_embedding(model: nn.Module, lm_head: nn.Linear) -> Optional[Tuple[str, nn.Embedding]]:
    """The model's input embedding (its module path and module) when it is tied to `lm_head`
    (config.tie_word_embeddings, or the two sharing one tensor); None when untied. A tie the
    head cannot serve (no nn.Embedding of lm_head's shape, or one holding another matrix) is a
    ValueError naming what was found."""
    weight = lm_head.weight
    configs = _configs(getattr(model, "config", None))
    tied_in_config = any(getattr(c, "tie_word_embeddings", False) for c in configs)
    trunk = getattr(model, "model", None)
    shared = isinstance(trunk, nn.Module) and any(
        p is weight or (p.numel() and p.data_ptr() == weight.data_ptr())
        for p in trunk.parameters())
    if not (tied_in_config or shared):
        return None
    embedding: Any = None
    get = getattr(model, "get_input_embeddings", None)
    if callable(get):
        try:
            embedding = get()
        except (NotImplementedError, AttributeError):
            embedding = None
    if embedding is None and isinstance(trunk, nn.Module):
        embedding = getattr(trunk, "embed_tokens", None)
    path = None
    if isinstance(embedding, nn.Module):
        path = next((name for name, m in model.named_modules() if m is embedding), None)
    if not isinstance(embedding, nn.Embedding) or path is None:
        raise ValueError(TIED_EMBEDDINGS_ERROR.format(
            found=f"Found {type(embedding).__name__} instead."))
    if embedding.weight is not weight and (
            tuple(embedding.weight.shape) != tuple(weight.shape)
            or not torch.equal(embedding.weight.detach(), weight.detach())):
        raise ValueError(TIED_EMBEDDINGS_ERROR.format(
            found=f"The embedding's weight ({tuple(embedding.weight.shape)}) is not lm_head's "
                  f"({tuple(weight.shape)})."))
    if embedding.max_norm is not None or embedding.scale_grad_by_freq or embedding.sparse:
        raise ValueError(TIED_EMBEDDINGS_ERROR.format(
            found="The embedding uses max_norm, scale_grad_by_freq or sparse gradients, which "
                  "the server does not compute."))
    return path, embedding


def embedding_scale(embedding: nn.Module) -> Optional[torch.Tensor]:
    """The factor an embedding module multiplies its rows by in its own forward (Gemma 3's
    scaled word embedding: `embed_scale`), or None. Gemma 1/2 scale in the trunk's forward
    instead, which goes on working unchanged."""
    scale = getattr(embedding, "embed_scale", None)
    if scale is None:
        return None
    return torch.as_tensor(scale).detach().clone()


class OffloadedLMHead(nn.Module):
    """Stands in for `lm_head` while W lives on the server: no parameters, no V x D memory.

    `weight` is an empty (0 x D) tensor on the meta device kept outside the parameters and
    buffers, so that optimizers, state_dict and model.to() never see it; `bias` likewise an
    empty (0,) one for a head with an output bias, None without (as nn.Linear's). Calling the
    module raises: the model's forward computes the loss without it. Loading a state dict that
    holds `lm_head.weight` (and `lm_head.bias`: a checkpoint's, `from_pretrained`'s own weights,
    the Trainer's resume) uploads it to the server's head instead (`OffloadedHead.upload_weight`,
    W and b in one push; one of them alone goes up with the server's other); without them, a
    strict load reports the keys missing.
    """

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype, head: str,
                 target: str, bias_dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.head = head
        self.target = target
        self.weight = torch.empty((0, in_features), dtype=dtype, device="meta")
        self.bias: Optional[torch.Tensor] = None
        if bias_dtype is not None:
            self.bias = torch.empty((0,), dtype=bias_dtype, device="meta")
        self._owner: Optional[_WeightOwner] = None
        # Set while loading a checkpoint whose W is beside the model's weights rather than among
        # them (FSDP's sharded checkpoints: hf_trainer uploads it from its own file).
        self.weight_elsewhere = False
        # A tied head: a tied model's checkpoint holds W under the embedding's key, whose
        # placeholder uploads it, so lm_head.weight is not missing without it.
        self.tied = False

    def _load_from_state_dict(self, state_dict: Dict[str, Any], prefix: str, local_metadata: Any,
                              strict: bool, missing_keys: List[str], unexpected_keys: List[str],
                              error_msgs: List[str]) -> None:
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        key, bias_key = prefix + "weight", prefix + "bias"
        has_bias = self.bias is not None
        for k in (key, bias_key) if has_bias else (key,):
            if k in unexpected_keys:
                unexpected_keys.remove(k)
        if strict and not self.weight_elsewhere:
            if key not in state_dict and not self.tied:
                missing_keys.append(key)
            if has_bias and bias_key not in state_dict:
                missing_keys.append(bias_key)
        weight = state_dict.get(key)
        bias = state_dict.get(bias_key) if has_bias else None
        if weight is not None and tuple(weight.shape) != (self.out_features, self.in_features):
            error_msgs.append(f"size mismatch for {key}: copying a param with shape "
                              f"{tuple(weight.shape)}, the offloaded head is "
                              f"{self.out_features} x {self.in_features}")
            return
        if bias is not None and tuple(bias.shape) != (self.out_features,):
            error_msgs.append(f"size mismatch for {bias_key}: copying a param with shape "
                              f"{tuple(bias.shape)}, the offloaded head's bias is "
                              f"({self.out_features},)")
            return
        if (weight is not None or bias is not None) and self._owner is not None:
            self._owner.upload_weight(weight, bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"head={self.head!r}, target={self.target!r}")

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise RuntimeError(
            f"losshead: lm_head lives on the losshead server ({self.target}, head "
            f"{self.head!r}) and has no local weights. The model's forward computes the loss "
            "there when given labels; for logits, bring W back with "
            "`with offloaded.local_head(model): ...` or `offloaded.restore(model)`")
