"""`OffloadedEmbedding`: an input embedding whose table is a losshead head's W.

A model that ties its LM head to its input embedding (Gemma, Llama-3.2 1B/3B, small Qwen) uses
one V x D matrix twice. With the head offloaded, the server holds that matrix, so the lookup is
served by it too: forward reads the rows of the batch's ids (`Client.embedding_rows`; each
distinct id once), backward sends their gradient back (`Client.embedding_grad`), which the
server adds into the same dW window as the head's micro-batches. One optimizer apply then steps
W with dW = dW_head + scatter_add(ids, dE), as a tied model's autograd computes it, and the
trainer keeps nothing of W.

Units: the server's window holds the gradient of the *sum* of token losses (losshead.torch_bridge
explains why), and an apply divides it by the window's token count. The head's dH reaches the
trunk multiplied by the head loss's factor (the upstream gradient over the reduction's count),
so dE carries that factor too. `grad_divisor="head"` (what a tied model wants) divides dE by the
factor of the head's last backward, which always runs before the embedding's: both
contributions then land in the window's units, and an apply over both equals the local tied
model's step. A float divides by that value; None sends dE as it is (an embedding whose window
nothing else shares). The embedding's gradient must come from the head's loss alone for "head"
to be exact (an auxiliary loss on the trunk would be divided by the head's factor too).

Sends run on one background thread per module, in order, so that the upload overlaps the rest
of the backward pass; the optimizers of the head (`HeadStepper`: RemoteAdamW, RemoteSGD,
JointOptimizer) wait for every one of them before they apply or discard the window, and
`flush()` does so by hand. A failed send raises there. In eval() mode or under no_grad the
lookup sends nothing.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
from torch import nn

from losshead._window import tracker
from losshead._wire import DTypeLike
from losshead.client import Client

__all__ = ["OffloadedEmbedding"]


class _Lookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, ids: torch.Tensor,  # type: ignore[override]
                module: "OffloadedEmbedding") -> torch.Tensor:
        ctx.module = module
        rows, ctx.unique, ctx.inverse = module._fetch(ids)
        ctx.ids_shape = ids.shape
        return rows

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor  # type: ignore[override]
                 ) -> Tuple[Optional[torch.Tensor], ...]:
        ctx.module._send(ctx.unique, ctx.inverse, grad)
        return None, None, None


class OffloadedEmbedding(nn.Module):
    """nn.Embedding's forward over a losshead head's W (see the module docstring).

    `client`, `head`: the server's head whose W is the table (V x D). `dtype`: of the rows
    returned (default the head's weight dtype); `device`: where they go (default: the ids').
    `grad_divisor`: "head" (default), a float or None. `grad_dtype`: the wire dtype of dE
    (default fp32: exact for any trunk dtype). `padding_idx`: as nn.Embedding's, its rows get no
    gradient. The module has no parameters: optimizers, state_dict and model.to() never see W.
    """

    def __init__(self, client: Client, head: str, num_embeddings: int, embedding_dim: int, *,
                 dtype: Optional[torch.dtype] = None, device: Optional[torch.device] = None,
                 grad_divisor: Union[str, float, None] = "head",
                 grad_dtype: DTypeLike = torch.float32,
                 padding_idx: Optional[int] = None,
                 scale: Optional[torch.Tensor] = None) -> None:
        super().__init__()
        if grad_divisor is not None and not isinstance(grad_divisor, (int, float)) \
                and grad_divisor != "head":
            raise ValueError(f"losshead: grad_divisor is 'head', a number or None, got "
                             f"{grad_divisor!r}")
        self.client = client
        self.head = head
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.dtype = dtype
        self.device = torch.device(device) if device is not None else None
        self.grad_divisor = grad_divisor
        self.grad_dtype = grad_dtype
        self.padding_idx = padding_idx
        # Rows are multiplied by it (cast to their dtype) after the lookup, as Gemma 3's scaled
        # word embedding does in its own forward; autograd carries it into dE.
        self.scale = scale
        # Set by OffloadedHead: loading a state dict with this module's `weight` uploads it.
        self._owner: Any = None
        self.last_version: Optional[int] = None  # the weights version of the last lookup
        # Not a parameter (see the class docstring): only there so that autograd calls backward.
        self._anchor = torch.empty(0, requires_grad=True)
        self._sender: Optional[concurrent.futures.ThreadPoolExecutor] = None

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, head={self.head!r}, "
                f"target={self.client.target!r}")

    @property
    def weight(self) -> torch.Tensor:
        """W lives on the server: download it with `client.download_weights(head)`."""
        raise AttributeError(
            f"losshead: the embedding's table is the head {self.head!r} on {self.client.target}; "
            "download it with client.download_weights(head)")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.training and torch.is_grad_enabled():
            rows = _Lookup.apply(self._anchor, ids, self)
        else:
            with torch.no_grad():
                rows = self._fetch(ids)[0]
        if self.scale is not None:
            rows = rows * self.scale.to(device=rows.device, dtype=rows.dtype)
        return rows

    def _load_from_state_dict(self, state_dict: Dict[str, Any], prefix: str, local_metadata: Any,
                              strict: bool, missing_keys: List[str], unexpected_keys: List[str],
                              error_msgs: List[str]) -> None:
        # A tied model's checkpoint holds W under the embedding's key (or lm_head's, or both):
        # whichever is there is uploaded, and neither placeholder reports the other missing.
        key = prefix + "weight"
        if key not in state_dict:
            return
        weight = state_dict[key]
        if tuple(weight.shape) != (self.num_embeddings, self.embedding_dim):
            error_msgs.append(f"size mismatch for {key}: copying a param with shape "
                              f"{tuple(weight.shape)}, the offloaded embedding is "
                              f"{self.num_embeddings} x {self.embedding_dim}")
            return
        if self._owner is not None:
            self._owner.upload_weight(weight)

    def _fetch(self, ids: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        flat = ids.reshape(-1)
        unique, inverse = torch.unique(flat.cpu(), return_inverse=True)
        got = self.client.embedding_rows(self.head, unique, dtype=self.dtype)
        self.last_version = got.version
        device = self.device if self.device is not None else ids.device
        rows = got.rows.to(device)[inverse.to(device)]
        return rows.reshape(*ids.shape, self.embedding_dim), unique, inverse

    def _send(self, unique: torch.Tensor, inverse: torch.Tensor, grad: torch.Tensor) -> None:
        window = tracker(self.client.target, self.head)
        divisor: Optional[float]
        if self.grad_divisor == "head":
            scale = window.last_grad_scale
            divisor = None if scale is None else float(scale)
            if divisor is None or divisor == 0.0:
                raise RuntimeError(
                    "losshead: the embedding's gradient is divided by the factor the head's loss "
                    "gave its dH (grad_divisor='head'), but no head backward with a scalar loss "
                    f"and a non-zero gradient ran before it (factor {divisor}); use "
                    "grad_divisor=None or a number for an embedding trained on another loss")
        else:
            divisor = float(self.grad_divisor) if self.grad_divisor is not None else None
        # Each distinct id's rows summed in fp32 here (deterministically, on the CPU), so that
        # the wire carries one row per id, as the lookup did.
        g = grad.detach().reshape(-1, self.embedding_dim).to("cpu", torch.float32)
        if divisor is not None:
            g = g / divisor
        summed = torch.zeros(unique.numel(), self.embedding_dim, dtype=torch.float32)
        summed.index_add_(0, inverse, g)
        ids = unique
        if self.padding_idx is not None:
            keep = unique != self.padding_idx
            ids, summed = unique[keep], summed[keep]
        if ids.numel() == 0:
            return
        sequence = self.client.next_sequence()  # taken now: the key is fixed before the send
        if self._sender is None:
            self._sender = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="losshead-embedding")
        window.note_embedding_send(self._sender.submit(
            self.client.embedding_grad, self.head, ids, summed, grad_dtype=self.grad_dtype,
            sequence=sequence))

    def flush(self) -> None:
        """Waits until every gradient this process sent to the head is in its window; raises
        the first send's error."""
        tracker(self.client.target, self.head).wait_embedding_grads()

    def __getstate__(self) -> Any:
        raise TypeError("losshead: an OffloadedEmbedding holds a live connection and cannot be "
                        "copied or pickled")
