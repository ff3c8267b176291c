"""The programmatic-dependent-launch forms of the decode kernels (kernels/pdl.py), compiled for an H200
(sm_90) here without a GPU: each carries the grid-dependency instructions, the weight-streaming ones ask L2
for their weights before the wait, and the wait comes before the first store. The plain forms (what the
interpreter and pre-Hopper GPUs run) carry none of it. What they compute is checked on the GPU
(tests/gpu/test_pdl_gpu.py)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _ptx(kernel: str, types: dict[str, str], constexprs: dict[str, object]) -> str:
    """PTX of `kernel` ("module:name" in kernels/) for sm_90: `types` of its runtime arguments (integers
    default to i32). Compiled in a fresh process: here the kernels are the interpreter's, which do not compile."""
    script = f"""
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
module, name = {kernel!r}.split(":")
kernel = getattr(importlib.import_module("kernels." + module), name)
types, constexprs = json.loads(sys.argv[1]), json.loads(sys.argv[2])
signature = {{a: "constexpr" if a in constexprs else types.get(a, "i32") for a in kernel.arg_names}}
source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
print(triton.compile(source, target=GPUTarget("cuda", 90, 32), options={{"num_warps": 4}}).asm["ptx"])
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", script, json.dumps(types), json.dumps(constexprs)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


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
    ptx = _ptx(kernel, types, {**constexprs, "PDL": True})
    assert ptx.count("griddepcontrol.launch_dependents") == 1
    assert ptx.count("griddepcontrol.wait") >= 1
    wait = ptx.index("griddepcontrol.wait")
    assert not re.search(r"\bst\.global", ptx[:wait]) and not re.search(r"\batom\.", ptx[:wait])
    assert ("prefetch.global.L2" in ptx[:wait]) == prefetches
    plain = _ptx(kernel, types, {**constexprs, "PDL": False})
    assert "griddepcontrol" not in plain and "prefetch.global" not in plain
