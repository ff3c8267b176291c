"""Host tensors that every process of one replica maps: the host pool.

The driver creates a file-backed shared mapping (in /dev/shm when there is
one) and hands its `SharedTensorHandle` to the ranks, which map the same file;
once every rank has mapped it the driver unlinks the name, so nothing is left
behind when the processes exit, whichever way they exit. Writes by one
process are visible to all at once (one physical copy): the host pool is
written once, by rank 0's mirrors, and read by every rank.

On CUDA each rank page-locks its mapping with `cudaHostRegister` (mapped and
portable), which makes it pinned memory for that rank: copies run at DMA speed
and GPU kernels read it through UVA, as they read the single-rank pinned pool.
All processes of a replica must share one node (its placement group packs
them), and /dev/shm must be large enough for the host pool.
"""

from __future__ import annotations

import logging
import os
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_HOST_REGISTER_PORTABLE_MAPPED = 0x01 | 0x02  # cudaHostRegisterPortable | cudaHostRegisterMapped


@dataclass(frozen=True)
class SharedTensorHandle:
    """Names a shared host tensor so another process of the replica can map it."""

    path: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    def attach(self, pin: bool) -> torch.Tensor:
        """Maps the tensor; `pin` page-locks it for this process's CUDA device."""
        numel = 1
        for n in self.shape:
            numel *= n
        tensor = torch.from_file(self.path, shared=True, size=numel, dtype=self.dtype).view(self.shape)
        if pin:
            _register(tensor)
        return tensor


class SharedTensor:
    """The creating side: owns the name until `unlink`."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        root = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
        self.handle = SharedTensorHandle(str(root / f"hisparse-{os.getpid()}-{uuid.uuid4().hex}"), shape, dtype)
        self.tensor = self.handle.attach(pin=False)  # zero-filled: the file is created sparse

    def unlink(self) -> None:
        """Drops the name; mappings stay valid until their processes unmap them."""
        Path(self.handle.path).unlink(missing_ok=True)


def _register(tensor: torch.Tensor) -> None:
    nbytes = tensor.numel() * tensor.element_size()
    err = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), nbytes, _HOST_REGISTER_PORTABLE_MAPPED)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} shared bytes failed with CUDA error {int(err)}")
    logger.info("page-locked %.2f GiB of shared host memory", nbytes / 2**30)
