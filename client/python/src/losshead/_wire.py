"""Tensor <-> wire conversions: raw little-endian, row-major bytes with an explicit dtype."""

from __future__ import annotations

import sys
from typing import Dict, Sequence, Union

import numpy as np
import torch

from losshead._proto.losshead.v1 import losshead_pb2 as pb

if sys.byteorder != "little":  # the wire is little-endian; torch/numpy buffers are host order
    raise ImportError("losshead supports little-endian hosts only")

DTypeLike = Union[torch.dtype, str, int]

_TORCH_TO_WIRE: Dict[torch.dtype, int] = {
    torch.bfloat16: pb.DTYPE_BF16,
    torch.float16: pb.DTYPE_FP16,
    torch.float32: pb.DTYPE_FP32,
    torch.int32: pb.DTYPE_INT32,
    torch.int64: pb.DTYPE_INT64,
}
_WIRE_TO_TORCH: Dict[int, torch.dtype] = {v: k for k, v in _TORCH_TO_WIRE.items()}
_NAMES: Dict[str, torch.dtype] = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
    "int32": torch.int32, "int64": torch.int64,
}
# numpy has no bfloat16: bf16 travels through numpy as its 16-bit pattern.
_NUMPY_CARRIER: Dict[torch.dtype, torch.dtype] = {torch.bfloat16: torch.int16}


def to_torch_dtype(dtype: DTypeLike) -> torch.dtype:
    """Accepts a torch dtype, a name ("bf16", "fp32", ...) or a wire DType enum value."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _TORCH_TO_WIRE:
            raise ValueError(f"losshead: dtype {dtype} has no wire encoding")
        return dtype
    if isinstance(dtype, str):
        try:
            return _NAMES[dtype.lower()]
        except KeyError:
            raise ValueError(f"losshead: unknown dtype name {dtype!r}") from None
    try:
        return _WIRE_TO_TORCH[int(dtype)]
    except KeyError:
        raise ValueError(f"losshead: wire dtype {dtype} has no torch equivalent") from None


def to_wire_dtype(dtype: DTypeLike) -> int:
    """The proto DType enum value for a torch dtype or name."""
    return _TORCH_TO_WIRE[to_torch_dtype(dtype)]


def element_size(dtype: DTypeLike) -> int:
    return _ELEMENT_SIZES[to_torch_dtype(dtype)]


# Looked up rather than measured on an empty tensor: the device path asks once per micro-batch.
_ELEMENT_SIZES = {t: torch.empty((), dtype=t).element_size() for t in _TORCH_TO_WIRE}


def nbytes(tensor: torch.Tensor) -> int:
    """The bytes a tensor's elements take."""
    return tensor.numel() * tensor.element_size()


def encode(tensor: torch.Tensor, dtype: DTypeLike) -> bytes:
    """Row-major little-endian bytes of `tensor` converted to `dtype` (on the host)."""
    return bytes(byte_view(host_tensor(tensor, dtype)))


def host_tensor(tensor: torch.Tensor, dtype: DTypeLike) -> torch.Tensor:
    """`tensor` as a contiguous CPU tensor of `dtype`: itself when it already is one, so that
    its memory is read in place."""
    return tensor.detach().to(device="cpu", dtype=to_torch_dtype(dtype)).contiguous()


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    carrier = _NUMPY_CARRIER.get(tensor.dtype)
    t = tensor.view(carrier) if carrier is not None else tensor
    # Flattened first: memoryview cannot cast a shape with a zero in it.
    return memoryview(t.reshape(-1).numpy()).cast("B")


def decode(buffer: Union[bytes, bytearray, memoryview], dtype: DTypeLike,
           shape: Sequence[int]) -> torch.Tensor:
    """A CPU tensor of `dtype` and `shape` from raw bytes (copies when the buffer is read-only)."""
    dt = to_torch_dtype(dtype)
    carrier = _NUMPY_CARRIER.get(dt, dt)
    np_dtype = torch.empty((), dtype=carrier).numpy().dtype
    array = np.frombuffer(buffer, dtype=np_dtype)
    if not array.flags.writeable:
        array = array.copy()
    t = torch.from_numpy(array)
    if carrier is not dt:
        t = t.view(dt)
    return t.reshape(tuple(shape))
