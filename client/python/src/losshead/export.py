"""A trained head out of the server, and back in: safetensors files.

The server holds the only copy of a head's W and optimizer state; its checkpoint files
(``--checkpoint_dir``) are the training run's copy. ``export_checkpoint`` turns one into a
safetensors file that Hugging Face and torch load as they are (W as ``lm_head.weight``, optionally
the optimizer's master weights and moments), with a manifest JSON beside it, offline: it runs
``losshead export``, which reads the file with the server's own reader (every checksum verified)
and needs no running server. ``load_safetensors`` reads such a file (any safetensors file of the
dtypes below) into CPU tensors, and ``import_safetensors`` seeds a head on a running server from
one.

    manifest = export_checkpoint("/var/lib/losshead/checkpoints/lm.lhck", "lm_head.safetensors")
    tensors = load_safetensors("lm_head.safetensors")      # {"lm_head.weight": V x D, ...}
    import_safetensors(client, "lm-copy", "lm_head.safetensors")
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
from pathlib import Path
from typing import Any, Dict, Optional, Union

import grpc
import torch

from losshead.errors import LossheadError

PathLike = Union[str, "os.PathLike[str]"]

# The safetensors dtype names this package reads, and their torch dtypes.
_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32,
           "F64": torch.float64, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
           "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
_HEAD_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_MAX_HEADER_BYTES = 100_000_000  # what the reference implementation accepts


def _cli(cli: Optional[PathLike]) -> str:
    """The `losshead` tool: `cli`, else $LOSSHEAD_CLI, else `losshead` on PATH."""
    found = str(cli) if cli else os.environ.get("LOSSHEAD_CLI") or shutil.which("losshead")
    if not found or not os.access(found, os.X_OK):
        raise FileNotFoundError(
            "the `losshead` tool was not found: pass cli=, set LOSSHEAD_CLI or put it on PATH "
            "(it is build/client/losshead, and /usr/local/bin/losshead in the server image)")
    return found


def _error_of(stderr: str) -> LossheadError:
    """The tool's "error: CODE: message" as the package's exception."""
    m = re.search(r"error: ([A-Z_]+): (.*)", stderr, re.S)
    if not m:
        return LossheadError(grpc.StatusCode.UNKNOWN, stderr.strip())
    code = getattr(grpc.StatusCode, m.group(1), grpc.StatusCode.UNKNOWN)
    return LossheadError(code, m.group(2).strip())


def export_checkpoint(path: PathLike, out: PathLike, *, head: Optional[str] = None,
                      tag: Optional[str] = None, tensor: str = "lm_head.weight", optimizer: bool = False,
                      gradient: bool = False, manifest: Optional[PathLike] = None,
                      cli: Optional[PathLike] = None) -> Dict[str, Any]:
    """Writes the head of a server checkpoint file to the safetensors file `out`; returns the
    manifest (also written beside `out`: its name with .safetensors replaced by .manifest.json,
    or `manifest`).

    `path` is a checkpoint file (``<head>.lhck``), or the server's checkpoint directory with
    `head` (and `tag` for the head's named snapshot of that tag instead of its checkpoint). The file holds W as `tensor` in the head's dtype; with `optimizer` also the server-side
    optimizer's fp32 master weights (bf16/fp16 heads) and state as ``<tensor>.optimizer.<name>``
    (``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``: torch.optim's names), with `gradient` the
    open gradient window as ``<tensor>.grad``. Its ``__metadata__`` and the manifest say which
    head, weights version and optimizer step it is; the manifest has each tensor's SHA-256. A
    head with an output bias adds b (fp32, V) as `bias_name(tensor)` ("lm_head.bias"), with its
    optimizer state and db under that name as W's are under `tensor`.
    Both files are written atomically. Raises LossheadError with the tool's status: NOT_FOUND
    (no such file), DATA_LOSS (a corrupt or torn checkpoint), FAILED_PRECONDITION (`optimizer`
    on a head without one), INVALID_ARGUMENT."""
    args = [_cli(cli), "export", f"--checkpoint={os.fspath(path)}", f"--out={os.fspath(out)}",
            f"--tensor={tensor}", f"--with_optimizer={str(optimizer).lower()}",
            f"--with_gradient={str(gradient).lower()}"]
    if head is not None:
        args.append(f"--head={head}")
    if tag is not None:
        args.append(f"--tag={tag}")
    if manifest is not None:
        args.append(f"--manifest={os.fspath(manifest)}")
    done = subprocess.run(args, capture_output=True, text=True)
    if done.returncode != 0:
        raise _error_of(done.stderr)
    written = Path(manifest) if manifest is not None else Path(
        re.sub(r"\.safetensors$", "", os.fspath(out)) + ".manifest.json")
    return json.loads(written.read_text())


def load_safetensors(path: PathLike) -> Dict[str, torch.Tensor]:
    """Every tensor of a safetensors file as a CPU tensor, by name (the file's ``__metadata__``
    under that key as a dict of strings, if it has one). Checks the format's rules: the header
    inside the file, JSON, each tensor's bytes matching its dtype and shape, the tensors covering
    the data with no gap or overlap; ValueError says what is wrong."""
    raw = Path(path).read_bytes()
    if len(raw) < 8:
        raise ValueError(f"{path}: not a safetensors file (shorter than its header length)")
    (n,) = struct.unpack("<Q", raw[:8])
    if n > _MAX_HEADER_BYTES or 8 + n > len(raw):
        raise ValueError(f"{path}: header length {n} exceeds the file")
    try:
        header = json.loads(raw[8:8 + n].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: the header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: the header is not a JSON object")
    data = memoryview(raw)[8 + n:]
    out: Dict[str, Any] = {}
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            out[name] = dict(info)
            continue
        dtype = _DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise ValueError(f"{path}: tensor {name!r} has dtype {info.get('dtype')!r}")
        shape = [int(s) for s in info["shape"]]
        begin, end = (int(o) for o in info["data_offsets"])
        count = 1
        for s in shape:
            count *= s
        if not 0 <= begin <= end <= len(data) or end - begin != count * torch.empty(
                0, dtype=dtype).element_size():
            raise ValueError(f"{path}: tensor {name!r} has offsets {begin}..{end} that do not "
                             f"hold {shape} of {info['dtype']}")
        spans.append((begin, end))
        flat = torch.frombuffer(bytearray(data[begin:end]), dtype=dtype) if count else \
            torch.empty(0, dtype=dtype)
        out[name] = flat.reshape(shape)
    covered = 0
    for begin, end in sorted(spans):
        if begin != covered:
            raise ValueError(f"{path}: the tensors leave a gap or overlap at byte {begin}")
        covered = end
    if covered != len(data):
        raise ValueError(f"{path}: {len(data) - covered} bytes after the last tensor")
    return out


def bias_name(tensor: str) -> str:
    """Where an export keeps the output bias of W named `tensor`: "lm_head.weight" ->
    "lm_head.bias", as nn.Linear's state dict names them; another name gets ".bias" appended."""
    return tensor[:-len(".weight")] + ".bias" if tensor.endswith(".weight") else tensor + ".bias"


def import_safetensors(client: Any, head: str, path: PathLike, *,
                       tensor: str = "lm_head.weight", create: bool = True,
                       **create_kwargs: Any) -> int:
    """Seeds head `head` of `client`'s server with `tensor` of a safetensors file as W; returns
    the new weights version. With `create` (default) the head is created first (V x D and dtype
    of the tensor; `create_kwargs` go to Client.create_head: replicas, shards, matmul_precision,
    ...), and deleted again if the server refuses the weights (NaN, Inf); otherwise W of an
    existing head is replaced. The server's optimizer state is not in a safetensors file: a
    created head's optimizer starts afresh (Client.set_optimizer). A file that holds an output
    bias beside W (`bias_name(tensor)`, V values: an export of a head with one) gives the created
    head a bias, and W and b go up in one push (in fp32 when their dtypes differ, so b is not
    rounded to W's)."""
    tensors = load_safetensors(path)
    if tensor not in tensors or tensor == "__metadata__":
        names = sorted(k for k in tensors if k != "__metadata__")
        raise LossheadError(grpc.StatusCode.NOT_FOUND,
                            f"{path} has no tensor {tensor!r} (it has: {', '.join(names)})")
    w = tensors[tensor]
    if w.dim() != 2 or w.dtype not in _HEAD_DTYPES or min(w.shape) < 1:
        raise LossheadError(grpc.StatusCode.INVALID_ARGUMENT,
                            f"{path}: tensor {tensor!r} is {w.dtype} {list(w.shape)}; a head "
                            "needs a bf16, fp16 or fp32 matrix [V, D]")
    b = tensors.get(bias_name(tensor))
    if b is not None and (b.dim() != 1 or b.shape[0] != w.shape[0] or b.dtype not in _HEAD_DTYPES):
        raise LossheadError(grpc.StatusCode.INVALID_ARGUMENT,
                            f"{path}: tensor {bias_name(tensor)!r} is {b.dtype} {list(b.shape)}; "
                            f"the output bias of a head of V = {w.shape[0]} is a bf16, fp16 or "
                            "fp32 vector [V]")
    if create:
        create_kwargs.setdefault("weight_dtype", w.dtype)
        if b is not None:
            create_kwargs.setdefault("bias", True)
        client.create_head(head, w.shape[0], w.shape[1], **create_kwargs)
    try:
        wire = w.dtype if b is None or b.dtype == w.dtype else torch.float32
        return client.push_weights(head, w, dtype=wire, bias=b)
    except LossheadError:
        if create:
            client.delete_head(head)
        raise
