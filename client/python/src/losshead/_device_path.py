"""The same-node device path from Python (docs/same-node.md, "The device path").

A native client whose server runs on this host and computes on CUDA devices can hand it hidden
states and targets in device memory: a region of this process's CUDA memory, shared with the
server through its IPC handle (torch gives it: the storage's ``_share_cuda_()``), registered
once through the C ABI (version 6) and reused. The server copies the tensors out of the region
and writes dH into it; nothing of them crosses the host or the socket.

A buffer on a device qualifies when the server computes on that very device (the same PCI bus
id) or on a peer of it (``torch.cuda.can_device_access_peer``); otherwise, or when registering
is refused (a server without CUDA devices: FAILED_PRECONDITION), the client keeps to the host
path (shared memory, else the network) and does not ask again for that device.

Ordering contract: the copies into and out of a region are queued on the caller's stream
(Microbatch.device_stream), whichever thread sends the micro-batches. The copies in are
synchronised before the micro-batches are sent; dH is in the region once the call returns (the
server synchronised its copy before answering); the copies out of it are not waited for: the
caller's stream orders what reads dH after them, and the next call that takes the region waits
for them on the device (`Region.reusable`) before it writes it. On the server's own GPU a host
wait there would sit behind the server's kernels (BENCHMARKS.md, "The trainer's host waits").

The region's memory comes from torch's caching allocator and is shared as torch.multiprocessing
shares storage, so torch keeps it for the process's lifetime once it was shared: regions are
kept and reused (one or a few per device and client, each a power of two of at least 1 MiB)
rather than made per call.

On by default; ``LOSSHEAD_DEVICE_PATH=0`` turns it off (CUDA tensors then take the host path).
The server still stages the tensors through its host memory (docs/same-node.md), and measured
so, the path is as fast as the host path at four streams and well ahead of it at one
(BENCHMARKS.md, "The same-node paths from Python").
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Dict, List, Optional, Tuple

import torch

from losshead._native_abi import _DEVICE_VERSION, _SameNodeDevice, _Status

_c = ctypes
_p = ctypes.c_void_p
_MIN_REGION = 1 << 20
# torch's _share_cuda_() is not safe to call from two threads at once: a step's lanes, each
# making its first region at the same moment, crashed the process inside it (a segmentation
# fault, torch 2.11). Every region of every client of the process is made under this lock.
_SHARE_LOCK = threading.Lock()
_IPC_HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)
ALIGN = 256  # offsets inside a region: any dtype's alignment, and a DMA's


def aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _bus_key(bus: str) -> Optional[Tuple[int, int, int]]:
    """(domain, bus, device) of "dddd:bb:dd.f" in any case and domain width; None if not one."""
    try:
        domain, bus_, rest = bus.strip().split(":")
        return int(domain, 16), int(bus_, 16), int(rest.split(".")[0], 16)
    except ValueError:
        return None


def _local_bus(index: int) -> Optional[Tuple[int, int, int]]:
    """This process's CUDA device `index` as (domain, bus, device), when torch tells it."""
    props = torch.cuda.get_device_properties(index)
    try:
        return (int(props.pci_domain_id), int(props.pci_bus_id),  # type: ignore[attr-defined]
                int(props.pci_device_id))  # type: ignore[attr-defined]
    except AttributeError:  # a torch without the PCI ids: the device cannot be matched
        return None


def _ipc_handle(shared: bytes) -> Optional[bytes]:
    """The cudaIpcMemHandle_t in what torch's ``_share_cuda_()`` gives: the 64 bytes themselves
    (older torch), or a version byte, a kind byte and then them, where the kind ``c`` is memory
    from cudaMalloc (others, such as expandable segments, are not runtime IPC handles: None)."""
    if len(shared) == _IPC_HANDLE_BYTES:
        return shared
    if len(shared) == _IPC_HANDLE_BYTES + 2 and shared[1:2] == b"c":
        return shared[2:]
    return None


class Region:
    """A registered region: a CUDA uint8 tensor of this process and the C ABI's handle."""

    def __init__(self, tensor: torch.Tensor, handle: int) -> None:
        self.tensor = tensor
        self.handle = handle
        # Recorded after the last call's copies out of the region: the next writer waits for it.
        self.reusable: Optional[torch.cuda.Event] = None

    @property
    def size(self) -> int:
        return self.tensor.numel()


class DevicePath:
    """One native client's device regions, by torch device index."""

    def __init__(self, lib: ctypes.CDLL, live) -> None:  # live(): the C client handle
        self._lib = lib
        self._live = live
        self._lock = threading.Lock()
        self._server: Optional[List[Tuple[Tuple[int, int, int], str]]] = None
        self._bus: Dict[int, Optional[str]] = {}  # device index -> bus id to register; None: off
        self._free: Dict[int, List[Region]] = {}

    @property
    def library_has_it(self) -> bool:
        """Whether the library has the device path's calls (C ABI 6), which also report every
        micro-batch's path, device regions or not."""
        return self._lib.lh_capi_version() >= _DEVICE_VERSION

    @property
    def supported(self) -> bool:
        """Whether CUDA tensors may take the device path: the library has it and
        LOSSHEAD_DEVICE_PATH is not "0"."""
        return self.library_has_it and os.environ.get("LOSSHEAD_DEVICE_PATH", "1") != "0"

    def _server_devices(self) -> List[Tuple[Tuple[int, int, int], str]]:
        if self._server is None:
            out, count, status = (_SameNodeDevice * 64)(), _c.c_size_t(), _Status()
            found: List[Tuple[Tuple[int, int, int], str]] = []
            if not self._lib.lh_same_node_devices(self._live(), out, 64, _c.byref(count),
                                                  _c.byref(status)):
                for d in out[:min(64, count.value)]:
                    bus = d.pci_bus_id.decode()
                    key = _bus_key(bus)
                    if key is not None:
                        found.append((key, bus))
            self._server = found
        return self._server

    def bus_for(self, device: torch.device) -> Optional[str]:
        """The bus id to register a buffer on `device` with when the server can open it (its
        own device, or a peer of one), else None (the host path)."""
        if not self.supported or device.type != "cuda":
            return None
        index = device.index if device.index is not None else torch.cuda.current_device()
        with self._lock:
            if index in self._bus:
                return self._bus[index]
        server = self._server_devices()
        mine = _local_bus(index)
        bus: Optional[str] = None
        if mine is not None and server:
            if any(key == mine for key, _ in server):
                bus = next(b for key, b in server if key == mine)
            else:
                # A peer: one of the server's devices that this process sees too, with access.
                local = {_local_bus(i): i for i in range(torch.cuda.device_count())}
                for key, _ in server:
                    j = local.get(key)
                    if j is not None and torch.cuda.can_device_access_peer(j, index):
                        bus = "%04x:%02x:%02x.0" % mine
                        break
        with self._lock:
            self._bus[index] = bus
        return bus

    def take(self, device: torch.device, nbytes: int) -> Optional[Region]:
        """A free registered region of at least `nbytes` on `device` (reused, or registered now);
        None when registering is refused (the device is then off for this client)."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        with self._lock:
            free = self._free.setdefault(index, [])
            fits = [r for r in free if r.size >= nbytes]
            if fits:
                region = min(fits, key=lambda r: r.size)
                free.remove(region)
                return region
            bus = self._bus.get(index)
        if bus is None:
            return None
        size = max(_MIN_REGION, 1 << max(0, nbytes - 1).bit_length())
        # The allocation too: the crash was in one lane's share while the others allocated.
        with _SHARE_LOCK:
            tensor = torch.empty(size, dtype=torch.uint8, device=torch.device("cuda", index))
            storage = (tensor.untyped_storage() if hasattr(tensor, "untyped_storage")
                       else tensor.storage())
            # (device, handle, size in bytes, offset of the storage in its allocation, ...)
            shared = storage._share_cuda_()  # type: ignore[attr-defined]
        ipc, offset = _ipc_handle(bytes(shared[1])), int(shared[3])
        if ipc is None:  # memory the runtime's IPC cannot share: the host path for this device
            with self._lock:
                self._bus[index] = None
            return None
        handle, status = _p(), _Status()
        if self._lib.lh_device_region_register(self._live(), ipc, len(ipc), offset, size,
                                               bus.encode(), _c.byref(handle), _c.byref(status)):
            with self._lock:
                self._bus[index] = None  # refused: the host path from now on
            return None
        return Region(tensor, int(handle.value))

    def give(self, region: Region) -> None:
        """Back to the pool, once nothing reads or writes it any more."""
        index = region.tensor.device.index
        with self._lock:
            free = self._free.setdefault(index, [])
            free.append(region)
            # Keep the largest few: a smaller one is not used again once a larger one exists.
            free.sort(key=lambda r: r.size)
            while len(free) > 4:
                self._lib.lh_device_region_free(free.pop(0).handle)

    def close(self) -> None:
        with self._lock:
            for free in self._free.values():
                for region in free:
                    self._lib.lh_device_region_free(region.handle)
            self._free.clear()
