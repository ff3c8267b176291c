"""The CUDA C kernels build where nvcc is (this machine needs no GPU for that): the sparse MLA kernel compiles
for sm_90 in every variant the launcher can ask for, without spilling registers (a spill would put the
kernel's accumulators in local memory), its cubin is reused from the cache, and without a GPU the kernel
says it is unavailable so the Triton kernel runs. The 64-head kernel builds for sm_90a without spills and
without ptxas serialising its wgmma (which it does, silently but for a note, when an accumulator is touched
while its product is in flight). The cluster top-K builds the same way in each variant the
benchmark times, and without a GPU leaves rows to the Triton select. The benchmark's ceiling for it (the same rows gathered
alone, bench/row_gather.cu) builds for both row formats."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import torch

from kernels import cubin, sparse_mla_cuda, topk_cuda
from kernels.sparse_mla_cuda import Variant

NVCC = cubin.find_nvcc()
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="no nvcc on this machine")
SOURCE = Path(sparse_mla_cuda.__file__).with_name("sparse_mla_fp8.cu")


@needs_nvcc
@pytest.mark.parametrize("variant", [sparse_mla_cuda.DEFAULT, Variant(warps=4, stages=2, ctas_per_sm=2)],
                         ids=["default", "w4c2"])
def test_sparse_mla_kernel_builds_without_spills(variant: Variant, tmp_path: Path) -> None:
    out = tmp_path / "k.cubin"
    done = subprocess.run([NVCC, *cubin.nvcc_flags("sm_90", variant.defines), "-Xptxas", "-v", "-o", str(out),
                           str(SOURCE)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    report = done.stderr
    assert "sparse_mla_fp8_h8" in report
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", report)]
    assert spills and not any(spills), report
    assert out.read_bytes()[:4] == b"\x7fELF"


@needs_nvcc
def test_the_64_head_kernel_builds_without_spills_or_serialised_wgmma(tmp_path: Path) -> None:
    out = tmp_path / "k.cubin"
    source = SOURCE.with_name("sparse_mla_fp8_h64.cu")
    done = subprocess.run([NVCC, *cubin.nvcc_flags("sm_90a", sparse_mla_cuda.WIDE.defines), "-Xptxas", "-v",
                           "-o", str(out), str(source)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    report = done.stderr
    assert "sparse_mla_fp8_h64" in report
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", report)]
    assert spills and not any(spills), report
    assert "serialized" not in report and "injected" not in report, report
    assert out.read_bytes()[:4] == b"\x7fELF"


@needs_nvcc
@pytest.mark.parametrize("row_bytes", [656, 1152], ids=["fp8-rows", "bf16-rows"])
def test_the_benchmarks_row_gather_builds(row_bytes: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HISPARSE_CACHE", str(tmp_path))
    source = Path(__file__).resolve().parents[1] / "bench" / "row_gather.cu"
    defines = (("ROW_BYTES", row_bytes), ("GATHER_WARPS", 8), ("GATHER_STAGES", 2 if row_bytes <= 704 else 1))
    assert cubin.compile_cubin(source, "sm_90", NVCC, defines)[:4] == b"\x7fELF"


@needs_nvcc
def test_cubin_is_built_once_and_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HISPARSE_CACHE", str(tmp_path))
    first = cubin.compile_cubin(SOURCE, "sm_90", NVCC, sparse_mla_cuda.DEFAULT.defines)
    files = list((tmp_path / "cubin").iterdir())
    assert len(files) == 1 and files[0].read_bytes() == first
    files[0].write_bytes(b"cached")  # a second build would overwrite it
    assert cubin.compile_cubin(SOURCE, "sm_90", NVCC, sparse_mla_cuda.DEFAULT.defines) == b"cached"
    # other macros, another file
    other = cubin.compile_cubin(SOURCE, "sm_90", NVCC, Variant(warps=4, ctas_per_sm=2).defines)
    assert other[:4] == b"\x7fELF" and len(list((tmp_path / "cubin").iterdir())) == 2


@needs_nvcc
def test_a_changed_local_header_builds_anew(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The two sparse MLA kernels share `sparse_mla_common.cuh`: the cache's key covers it."""
    monkeypatch.setenv("HISPARSE_CACHE", str(tmp_path / "cache"))
    header = tmp_path / "common.cuh"
    header.write_text("#define VALUE 1\n")
    source = tmp_path / "k.cu"
    source.write_text('#include "common.cuh"\nextern "C" __global__ void k(int* out) { *out = VALUE; }\n')
    assert cubin.source_with_headers(source) == source.read_bytes() + header.read_bytes()
    first = cubin.compile_cubin(source, "sm_90", NVCC)
    header.write_text("#define VALUE 2\n")
    assert cubin.compile_cubin(source, "sm_90", NVCC) != first
    assert len(list((tmp_path / "cache" / "cubin").iterdir())) == 2


@needs_nvcc
def test_an_unwritable_cache_still_builds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")  # the cache directory would have to be created under a file
    monkeypatch.setenv("HISPARSE_CACHE", str(blocker))
    assert cubin.compile_cubin(SOURCE, "sm_90", NVCC, sparse_mla_cuda.DEFAULT.defines)[:4] == b"\x7fELF"


@needs_nvcc
def test_a_build_failure_names_the_compiler_messages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HISPARSE_CACHE", str(tmp_path))
    bad = tmp_path / "bad.cu"
    bad.write_text('extern "C" __global__ void k() { undefined_name(); }\n')
    with pytest.raises(RuntimeError, match="undefined_name"):
        cubin.compile_cubin(bad, "sm_90", NVCC)


@pytest.mark.parametrize("heads", [8, 64])
def test_without_a_gpu_the_kernel_is_unavailable(heads: int) -> None:
    assert not sparse_mla_cuda.available(torch.device("cpu"), heads)
    q = torch.zeros(2, heads, 576, dtype=torch.bfloat16)
    kv = torch.zeros(4, 64, 656, dtype=torch.uint8)
    out = torch.zeros(2, heads, 512, dtype=torch.bfloat16)
    assert not sparse_mla_cuda.supports(q, kv, out, "fp8", 512, 64)


@needs_nvcc
@pytest.mark.parametrize("variant", [topk_cuda.DEFAULT, topk_cuda.Variant(256, 8), topk_cuda.Variant(1024, 2),
                                     topk_cuda.Variant(list_cap=0)],
                         ids=lambda v: f"{v.threads}x{v.cluster}-list{v.list_cap}")
def test_the_cluster_topk_builds_without_spills(variant: topk_cuda.Variant, tmp_path: Path) -> None:
    source = Path(topk_cuda.__file__).with_name("topk_cluster.cu")
    done = subprocess.run([NVCC, *cubin.nvcc_flags("sm_90", variant.defines), "-Xptxas", "-v", "-o",
                           str(tmp_path / "k.cubin"), str(source)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", done.stderr)]
    assert "topk_cluster" in done.stderr and spills and not any(spills), done.stderr


def test_the_cluster_size_is_the_one_measured_fastest() -> None:
    h200 = {8: 15, 4: 30, 2: 66}  # clusters an H200 runs at once (the driver's count)
    assert topk_cuda.variant_for(1, 131072, h200).cluster == 8  # one wave at most: the smallest share
    assert topk_cuda.variant_for(16, 131072, h200).cluster == 4  # 8 would take two waves
    assert topk_cuda.variant_for(64, 131072, h200).cluster == 2  # one wave, a share read again from L2
    assert topk_cuda.variant_for(1, 1 << 20, h200).cluster == 8
    assert topk_cuda.variant_for(64, 12288, h200).cluster == 2
    assert topk_cuda.variant_for(8, 131072, {8: 0, 4: 30}).cluster == 4  # a size that cannot run is skipped
    assert topk_cuda.variant_for(8, 131072, {}) == topk_cuda.DEFAULT


def test_without_a_gpu_rows_take_the_triton_select() -> None:
    scores = torch.zeros(2, 20000)
    assert not topk_cuda.supports(scores, torch.zeros(2, 16, dtype=torch.int64))
