// What the sparse MLA decode kernels over FP8 rows share (sparse_mla_fp8.cu at up to 8 heads,
// sparse_mla_fp8_h64.cu at up to 64): the launch's parameters, as kernels/sparse_mla_cuda.py passes them, and
// the shared-memory, mbarrier and bulk-copy primitives of their gathers. Included by both; kernels/cubin.py
// hashes it with each into the cubin cache's key.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

extern "C" {
// Mirrored field for field by kernels/sparse_mla_cuda.py (`_Params`).
struct SparseMLAParams {
  const __nv_bfloat16* q;  // [N, H, DL + DR]
  const uint8_t* kv;       // one layer's page view [pages, page_size, ROW]
  const int* slots;        // [N, K]
  const int* lens;         // [N]
  void* out;               // [N, H, DL], bf16 or float32
  float* part;             // [N, splits, H, DL] with more than one split
  float* lse;              // [N, splits, H]
  long long q_stride_n, q_stride_h;      // elements
  long long kv_stride_page, kv_stride_tok;  // bytes
  long long slots_stride_n;              // elements
  long long out_stride_n, out_stride_h;  // elements
  int num_heads, num_splits, split_len, page_shift;  // pages hold 2^page_shift rows
  int out_bf16;
  float scale_log2;
};
}

namespace {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t phase) {
  asm volatile(
      "{\n\t.reg .pred done;\n"
      "WAIT:\n\t"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n\t"
      "@!done bra WAIT;\n}" ::"r"(bar),
      "r"(phase)
      : "memory");
}

__device__ __forceinline__ void bulk_copy(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}

// Orders this thread's generic-proxy shared-memory accesses before later async-proxy ones (bulk copies into
// bytes it read, wgmma reading bytes it wrote).
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// Four e4m3 bytes -> two fp16 pairs: bytes (0, 1) -> lo, bytes (2, 3) -> hi, the lower byte in the lower half.
__device__ __forceinline__ void e4m3x4_to_half2x2(uint32_t v, uint32_t& lo, uint32_t& hi) {
  asm("{\n\t.reg .b16 a, b;\n\t"
      "mov.b32 {a, b}, %2;\n\t"
      "cvt.rn.f16x2.e4m3x2 %0, a;\n\t"
      "cvt.rn.f16x2.e4m3x2 %1, b;\n}"
      : "=r"(lo), "=r"(hi)
      : "r"(v));
}

__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

}  // namespace
