"""Adds tensors to a model directory written by `save_pretrained`, in the format it has.

A checkpoint of a model whose LM head is offloaded lacks `lm_head.weight` (and `lm_head.bias`:
the model holds neither); adding them makes the directory load with `from_pretrained` anywhere,
losshead or not. The directory holds one of: `model.safetensors`;
`model.safetensors.index.json` and its shards; `pytorch_model.bin`;
`pytorch_model.bin.index.json` and its shards. A single file is rewritten with the tensors added
(to a temporary file, then renamed over it); a sharded one gets them together as a shard of
their own (named after the first), added to the index's weight map and total size: one shard
is one load, so W and b reach the offloaded head in one push. Safetensors files need
the `safetensors` package (which transformers requires).
"""

from __future__ import annotations

import json
import os
from typing import Callable, Dict, Optional

import torch

__all__ = ["add_tensor", "add_tensors", "weights_format"]

SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
TORCH_WEIGHTS = "pytorch_model.bin"
TORCH_INDEX = "pytorch_model.bin.index.json"


def weights_format(directory: str) -> Optional[str]:
    """Which of the four layouts `directory` holds (its file name), or None."""
    for name in (SAFE_INDEX, SAFE_WEIGHTS, TORCH_INDEX, TORCH_WEIGHTS):
        if os.path.isfile(os.path.join(directory, name)):
            return name
    return None


def _replace(path: str, write: Callable[[str], None]) -> None:
    tmp = path + ".losshead.tmp"
    write(tmp)
    os.replace(tmp, path)


def _save_safetensors(tensors: Dict[str, torch.Tensor], path: str) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, path, metadata={"format": "pt"})


def add_tensor(directory: str, name: str, tensor: torch.Tensor) -> str:
    """Adds `name` = `tensor` (moved to the CPU) to the weights in `directory`; returns the file
    that holds it. FileNotFoundError when the directory holds no model weights."""
    return add_tensors(directory, {name: tensor})


def add_tensors(directory: str, added: Dict[str, torch.Tensor]) -> str:
    """Adds every {name: tensor} of `added` (moved to the CPU; at least one) to the weights in
    `directory`, in one file; returns it. FileNotFoundError when the directory holds no model
    weights."""
    if not added:
        raise ValueError("losshead: no tensor to add")
    added = {k: v.detach().to("cpu").contiguous() for k, v in added.items()}
    layout = weights_format(directory)
    if layout is None:
        raise FileNotFoundError(f"losshead: {directory} holds no model weights "
                                f"({SAFE_WEIGHTS}, {TORCH_WEIGHTS} or their index)")
    path = os.path.join(directory, layout)
    if layout == SAFE_WEIGHTS:
        from safetensors.torch import load_file

        tensors = load_file(path, device="cpu")
        tensors.update(added)
        _replace(path, lambda tmp: _save_safetensors(tensors, tmp))
        return path
    if layout == TORCH_WEIGHTS:
        tensors = torch.load(path, map_location="cpu")
        tensors.update(added)
        _replace(path, lambda tmp: torch.save(tensors, tmp))
        return path
    # Sharded: the tensors in a shard of their own, named like the others' prefix.
    with open(path) as f:
        index = json.load(f)
    safe = layout == SAFE_INDEX
    first = next(iter(added))
    shard = ("model" if safe else "pytorch_model") + "-" + first.replace(".", "_") + (
        ".safetensors" if safe else ".bin")
    shard_path = os.path.join(directory, shard)
    if safe:
        _replace(shard_path, lambda tmp: _save_safetensors(added, tmp))
    else:
        _replace(shard_path, lambda tmp: torch.save(added, tmp))
    weight_map = index.setdefault("weight_map", {})
    metadata = index.setdefault("metadata", {})
    for name, tensor in added.items():
        if name not in weight_map and "total_size" in metadata:
            metadata["total_size"] = int(metadata["total_size"]) + (
                tensor.numel() * tensor.element_size())
        weight_map[name] = shard
    _replace(path, lambda tmp: _write_json(index, tmp))
    return shard_path


def _write_json(obj: object, path: str) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
