"""The programmatic-dependent-launch forms of the decode kernels (kernels/pdl.py), compiled for an H200
(sm_90) here without a GPU: each carries the grid-dependency instructions, the weight-streaming ones ask L2
for their weights before the wait, and the wait comes before the first store. The plain forms (what the
interpreter and pre-Hopper GPUs run) carry none of it. What they compute is checked on the GPU
(tests/gpu/test_pdl_gpu.py)."""

from __future__ import annotations

import re

import pytest

from tests.helpers import sm90_ptx

GEMV = ("fp8_gemm:_fp8_gemv_kernel", {"a_ptr": "*fp8e4nv", "as_ptr": "*fp32", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32",
                           "out_ptr": "*bf16"},
        {"BLOCK_N": 4, "BLOCK_K": 2048, "K_TILES": 3, "EVEN_K": True})
GEMM = ("fp8_gemm:_fp8_gemm_kernel", {"a_ptr": "*fp8e4nv", "as_ptr": "*fp32", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32",
                           "c_ptr": "*fp32", "out_ptr": "*bf16", "arrivals_ptr": "*i32"},
        {"BLOCK_M": 16, "BLOCK_N": 64, "GROUP_M": 1, "SWAP_AB": True, "EVEN_K": True, "SPLIT": True})
ROUTER = ("router:_router_logits_fma_kernel", {"x_ptr": "*bf16", "w_ptr": "*fp32", "part_ptr": "*fp32",
                                               "logits_ptr": "*fp32", "arrivals_ptr": "*i32"},
          {"BLOCK_E": 16, "BLOCK_K": 128, "BLOCK_S": 64})
NORM = ("rmsnorm:_rmsnorm_kernel", {"x_ptr": "*bf16", "r_ptr": "*bf16", "sum_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16",
                          "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "eps": "fp32"},
        {"BLOCK": 8192, "CHUNK": 1024, "ADD": True, "QUANT": True, "PAIR": False, "SOFT_CVT": False})


@pytest.mark.parametrize("kernel, types, constexprs, prefetches", [(*GEMV, True), (*GEMM, True), (*ROUTER, False),
                                                                   (*NORM, False)],
                         ids=["fp8-gemv", "fp8-gemm-split", "router-logits", "rmsnorm"])
def test_pdl_forms_wait_before_storing(kernel, types, constexprs, prefetches) -> None:
    ptx = sm90_ptx(kernel, types, {**constexprs, "PDL": True})
    assert ptx.count("griddepcontrol.launch_dependents") == 1
    assert ptx.count("griddepcontrol.wait") >= 1
    wait = ptx.index("griddepcontrol.wait")
    assert not re.search(r"\bst\.global", ptx[:wait]) and not re.search(r"\batom\.", ptx[:wait])
    assert ("prefetch.global.L2" in ptx[:wait]) == prefetches
    plain = sm90_ptx(kernel, types, {**constexprs, "PDL": False})
    assert "griddepcontrol" not in plain and "prefetch.global" not in plain
