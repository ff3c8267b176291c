"""Programmatic dependent launch (PDL, Hopper and later): a kernel starts while the one before it drains.

A one-token decode layer is about twenty launches of a few microseconds each, and between two of them the
GPU idles: the last programs of one kernel finish, the next kernel's programs are scheduled, they issue
their first loads and wait a memory round trip. With PDL a kernel is launched as soon as every program of
the kernel before it has started (each calls `gdc_launch_dependents` first), so its programs are resident
and waiting when the previous kernel ends, and a kernel that streams weights issues those loads before it
waits: weights are never written during a step, so reading them early is safe.

The contract every kernel launched with `launch_options` keeps: `begin(PDL)` first, then only loads of
data no kernel of the step writes (weights, their scales, rotary tables), then `wait(PDL)` before any other
load and before any store. Weight-streaming kernels also ask L2 for the rest of their weights before the
wait (`prefetch_l2`: a prefetch per 128-byte line, no registers held), so the bytes arrive while the kernel
before finishes and the kernel's own loads after the wait hit L2. `gdc_wait` returns once the previous
kernel has completed and its writes are visible, so a chain of such kernels keeps stream order; a kernel
launched without the attribute (PyTorch's, cuBLAS's, NCCL's) waits for the one before it to complete, as
always. CUDA graphs capture the launches as programmatic edges.

Kernels launch with PDL only inside `launches(True)` and where the hardware has it (compute capability 9.0
and up). The decode graphs of small batches take it (engine/rank/decode_graphs.py): on an H200 a 76-layer
step at one rank's GLM-5.3 shapes took 7% less at B = 1, the same at B = 8 and 2% more at B = 32, where a
kernel's programs, started early on whichever SMs the previous kernel left first, spread less evenly.
`HISPARSE_PDL=0` in the environment, or `configure(False)`, turns it off everywhere. Under the Triton
interpreter `PDL` is false and the kernels run unchanged.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

_allowed: bool = os.environ.get("HISPARSE_PDL", "1") != "0"
_active: ContextVar[bool] = ContextVar("pdl_active", default=False)
_capable: dict[torch.device, bool] = {}


def configure(allowed: bool) -> bool:
    """Allow PDL (inside `launches(True)`) or forbid it everywhere, for launches from now on (graphs already
    captured keep how they were launched); returns the previous setting."""
    global _allowed
    previous, _allowed = _allowed, allowed
    return previous


@contextmanager
def launches(on: bool) -> Iterator[None]:
    """Kernels launched inside (this thread or task) use PDL when `on` and allowed."""
    token = _active.set(on)
    try:
        yield
    finally:
        _active.reset(token)


def enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL now: allowed, inside `launches(True)`, a CUDA device of
    compute capability >= 9.0, and not the Triton interpreter."""
    if not (_allowed and _active.get()) or device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    capable = _capable.get(device)
    if capable is None:
        capable = _capable[device] = torch.cuda.get_device_capability(device)[0] >= 9
    return capable


def launch_options(device: torch.device) -> dict:
    """Keyword arguments of a Triton launch on `device`: `PDL` for the kernel's constexpr and, when on,
    `launch_pdl` for the launcher."""
    on = enabled(device)
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


@triton.jit
def begin(PDL: tl.constexpr):
    """Let the next kernel launch once every program of this one has started."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def wait(PDL: tl.constexpr):
    """Block until the previous kernel has completed and its writes are visible."""
    if PDL:
        gdc_wait()


@triton.jit
def prefetch_l2(ptrs, mask, base, PDL: tl.constexpr):
    """With PDL, asks L2 for the line of each pointer where `mask` (one pointer per 128-byte line is
    enough; masked-out lanes ask for `base`'s). Without PDL nothing is issued."""
    if PDL:
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [tl.where(mask, ptrs, base)],
                                  dtype=tl.int32, is_pure=False, pack=1)
