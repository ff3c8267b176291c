"""CUDA C kernels built with nvcc at first use and launched through the driver API.

Some kernels need what Triton's language does not expose: a shared-memory ring fed by the copy engine,
`ldmatrix` / `movmatrix`, operands converted once into the layout two products read. Those live as `.cu`
files beside their launchers. A `CudaKernel` compiles its file for the GPU it first runs on with nvcc
(`$CUDA_HOME/bin/nvcc`, else the one on PATH), keeps the cubin under `$HISPARSE_CACHE/cubin` (default
`~/.cache/hisparse/cubin`) named by a hash of the source (with the local headers it includes), the flags and
the compiler, loads it into the device's primary context (the one PyTorch uses) and launches on PyTorch's
current stream, so a CUDA graph being captured records the launch like any other. Where there is no nvcc,
no GPU of the kernel's compute capability or the build fails, `available` says no (once, with the reason
logged) and the caller keeps its Triton kernel.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_MAX_DYNAMIC_SHARED = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
_driver: ctypes.CDLL | None = None


def _cuda() -> ctypes.CDLL:
    global _driver
    if _driver is None:
        lib = ctypes.CDLL("libcuda.so.1")
        lib.cuLaunchKernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [
            ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_void_p)]
        lib.cuModuleLoadData.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p]
        lib.cuModuleGetFunction.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_char_p]
        lib.cuFuncSetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
        lib.cuCtxGetCurrent.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        lib.cuCtxSetCurrent.argtypes = [ctypes.c_void_p]
        lib.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]
        lib.cuOccupancyMaxActiveClusters.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_void_p,
                                                     ctypes.POINTER(_LaunchConfig)]
        _driver = lib
    return _driver


class _LaunchConfig(ctypes.Structure):
    """The driver's `CUlaunchConfig`, field for field (no launch attributes)."""

    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_bytes", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.c_void_p), ("num_attrs", ctypes.c_uint)]


def _check(result: int, call: str) -> None:
    if result != 0:
        name = ctypes.c_char_p()
        _cuda().cuGetErrorName(result, ctypes.byref(name))
        raise RuntimeError(f"{call} failed: {(name.value or b'?').decode()} ({result})")


def device_index(device: torch.device) -> int:
    """The CUDA device index of `device` (the current device where it names none)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def find_nvcc() -> str | None:
    """nvcc under $CUDA_HOME, else on PATH, else None."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and (Path(home) / "bin" / "nvcc").is_file():
        return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def _cache_dir() -> Path:
    root = os.environ.get("HISPARSE_CACHE") or Path.home() / ".cache" / "hisparse"
    return Path(root) / "cubin"


def nvcc_flags(arch: str, defines: tuple[tuple[str, int], ...] = ()) -> list[str]:
    """nvcc's flags for a cubin of `arch` with the macros `defines`."""
    flags = ["-cubin", "-O3", "-std=c++17", f"-gencode=arch=compute_{arch[3:]},code={arch}"]
    return flags + [f"-D{name}={value}" for name, value in defines]


_LOCAL_INCLUDE = re.compile(rb'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def source_with_headers(source: Path) -> bytes:
    """`source`'s bytes followed by those of the local headers it includes (`#include "..."`, beside it, and
    theirs in turn): what a cached cubin was built from, so a changed header builds anew."""
    seen: list[Path] = []
    pending = [source]
    while pending:
        path = pending.pop(0)
        if path in seen or not path.is_file():
            continue
        seen.append(path)
        pending += [path.parent / name.decode() for name in _LOCAL_INCLUDE.findall(path.read_bytes())]
    return b"".join(path.read_bytes() for path in seen)


def compile_cubin(source: Path, arch: str, nvcc: str, defines: tuple[tuple[str, int], ...] = ()) -> bytes:
    """The cubin of `source` for `arch` (e.g. "sm_90", or "sm_90a" for its arch-specific features) with the
    macros `defines`, from the cache or built now. Raises on a failed build with nvcc's messages."""
    flags = nvcc_flags(arch, defines)
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    text = source_with_headers(source)
    key = hashlib.sha256(text + " ".join(flags).encode() + version.encode()).hexdigest()[:20]
    cached = _cache_dir() / f"{source.stem}-{arch}-{key}.cubin"
    if cached.is_file():
        return cached.read_bytes()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "kernel.cubin"
        done = subprocess.run([nvcc, *flags, "-o", str(out), str(source)], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"nvcc failed on {source.name}:\n{done.stderr}")
        data = out.read_bytes()
    log.info("built %s for %s (%d bytes)", source.name, arch, len(data))
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        partial = cached.with_suffix(f".{os.getpid()}.tmp")
        partial.write_bytes(data)
        partial.replace(cached)  # atomic: another process may be building the same file
    except OSError as exc:  # a read-only home: build again next time
        log.warning("cubin cache %s not writable (%s)", cached.parent, exc)
    return data


class CudaKernel:
    """One `extern "C"` kernel of a .cu file taking one struct parameter, launched on the current stream."""

    def __init__(self, source: Path, name: str, shared_bytes: int, defines: tuple[tuple[str, int], ...] = (),
                 min_capability: tuple[int, int] = (9, 0), arch_specific: bool = False):
        """`arch_specific`: the kernel uses features of exactly `min_capability` (sm_90a's wgmma), so it is
        built for that architecture's "a" target and runs on no other."""
        self.source = source
        self.defines = defines
        self.name = name
        self.shared_bytes = shared_bytes
        self.min_capability = min_capability
        self.arch_specific = arch_specific
        self._functions: dict[int, ctypes.c_void_p | None] = {}  # device index -> function, None: unavailable
        self._contexts: dict[int, ctypes.c_void_p] = {}
        self._lock = threading.Lock()

    def available(self, device: torch.device) -> bool:
        """Whether the kernel runs on `device` (built and loaded on first ask)."""
        if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
            return False
        index = device_index(device)
        if index not in self._functions:
            with self._lock:
                if index not in self._functions:
                    self._functions[index] = self._load(index)
        return self._functions[index] is not None

    def _load(self, index: int) -> ctypes.c_void_p | None:
        major, minor = torch.cuda.get_device_capability(index)
        if (major, minor) < self.min_capability or (self.arch_specific and (major, minor) != self.min_capability):
            log.info("%s needs compute capability %s%s; device %d has %d.%d", self.name, self.min_capability,
                     " exactly" if self.arch_specific else "", index, major, minor)
            return None
        nvcc = find_nvcc()
        if nvcc is None:
            log.warning("no nvcc found: %s falls back to its Triton kernel", self.name)
            return None
        try:
            arch = f"sm_{major}{minor}" + ("a" if self.arch_specific else "")
            data = compile_cubin(self.source, arch, nvcc, self.defines)
            self._make_current(index)
            module, function = ctypes.c_void_p(), ctypes.c_void_p()
            _check(_cuda().cuModuleLoadData(ctypes.byref(module), data), "cuModuleLoadData")
            _check(_cuda().cuModuleGetFunction(ctypes.byref(function), module, self.name.encode()),
                   "cuModuleGetFunction")
            _check(_cuda().cuFuncSetAttribute(function, _MAX_DYNAMIC_SHARED, self.shared_bytes),
                   "cuFuncSetAttribute")
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            log.warning("%s unavailable (%s): its Triton kernel is used", self.name, exc)
            return None
        return function

    def _make_current(self, index: int) -> None:
        """Make the device's primary context (PyTorch's) current on this thread."""
        ctx = self._contexts.get(index)
        if ctx is None:
            torch.cuda.init()
            ctx = ctypes.c_void_p()
            _check(_cuda().cuDevicePrimaryCtxRetain(ctypes.byref(ctx), index), "cuDevicePrimaryCtxRetain")
            self._contexts[index] = ctx
        current = ctypes.c_void_p()
        _check(_cuda().cuCtxGetCurrent(ctypes.byref(current)), "cuCtxGetCurrent")
        if current.value != ctx.value:
            _check(_cuda().cuCtxSetCurrent(ctx), "cuCtxSetCurrent")

    def max_active_clusters(self, device: torch.device, cluster: int, threads: int) -> int:
        """How many clusters of `cluster` CTAs of `threads` threads the GPU runs at once (the driver's count:
        a cluster's CTAs share a GPC, so it is not the SMs over the cluster size). Call `available` first."""
        index = device_index(device)
        self._make_current(index)
        config = _LaunchConfig((ctypes.c_uint * 3)(cluster, 1, 1), (ctypes.c_uint * 3)(threads, 1, 1),
                               self.shared_bytes, None, None, 0)
        count = ctypes.c_int()
        _check(_cuda().cuOccupancyMaxActiveClusters(ctypes.byref(count), self._functions[index],
                                                    ctypes.byref(config)), "cuOccupancyMaxActiveClusters")
        return count.value

    def launch(self, device: torch.device, grid: tuple[int, int, int], threads: int,
               params: ctypes.Structure) -> None:
        """Launch on `device`'s current PyTorch stream (call `available` first)."""
        index = device_index(device)
        function = self._functions[index]
        self._make_current(index)
        stream = torch.cuda.current_stream(device).cuda_stream
        args = (ctypes.c_void_p * 1)(ctypes.cast(ctypes.pointer(params), ctypes.c_void_p))
        _check(_cuda().cuLaunchKernel(function, *grid, threads, 1, 1, self.shared_bytes, stream, args, None),
               f"cuLaunchKernel({self.name})")
