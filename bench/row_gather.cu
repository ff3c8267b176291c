// The gathers of the sparse MLA decode alone, as the ceiling its benchmark measures against: random rows of
// ROW_BYTES (656 for FP8 rows, 1152 for bf16) gathered by one bulk copy a row into shared memory, 16 rows a
// tile, WARPS warps each keeping STAGES tiles in flight, nothing computed (the three macros set by
// bench/kernels_attention.py, which sizes the shared memory from them). The same grid as the kernel (a CTA
// per split of K and query row). Measured on an H200 with FP8 rows (bench/NOTES.md, eighteenth session): 16
// warps of one stage, 8 of two and 5 of two are within 3 % of each other; bf16 rows fit one stage.
#include <stdint.h>

namespace {
constexpr int TILE = 16;
constexpr int WARPS = GATHER_WARPS;
constexpr int STAGES = GATHER_STAGES;
constexpr int STAGE_BYTES = TILE * ROW_BYTES;
static_assert(ROW_BYTES % 16 == 0, "bulk copies need 16-byte aligned rows");

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
}  // namespace

extern "C" {
// Mirrored field for field by bench/kernels_attention.py (`_GatherParams`).
struct RowGatherParams {
  const uint8_t* kv;  // one layer's page view [pages, page_size, ROW_BYTES]
  const int* slots;   // [N, K]
  const int* lens;    // [N]
  long long kv_stride_page, kv_stride_tok, slots_stride_n;
  int split_len, page_size;
};
}

extern "C" __global__ void __launch_bounds__(WARPS * 32, 1) row_gather(const RowGatherParams p) {
  extern __shared__ __align__(128) uint8_t smem[];
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + WARPS * STAGES * STAGE_BYTES);
  const int split = blockIdx.x, n = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) {
    for (int s = 0; s < STAGES; ++s)
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(bars + warp * STAGES + s)) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncwarp();
  const int end = min((split + 1) * p.split_len, p.lens[n]);
  const int first = split * p.split_len + warp * TILE;
  constexpr int STEP = WARPS * TILE;
  const int* srow = p.slots + n * p.slots_stride_n;
  const uint32_t ring = smem_addr(smem + warp * STAGES * STAGE_BYTES);
  auto issue = [&](int stage, int k0) {
    const int slot = lane < TILE ? srow[min(k0 + lane, end - 1)] : 0;
    const uint8_t* src = p.kv + static_cast<long long>(slot / p.page_size) * p.kv_stride_page +
                         (slot % p.page_size) * p.kv_stride_tok;
    const uint32_t bar = smem_addr(bars + warp * STAGES + stage);
    if (lane == 0) asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(STAGE_BYTES) : "memory");
    __syncwarp();
    if (lane < TILE)
      asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                       ring + stage * STAGE_BYTES + lane * ROW_BYTES),
                   "l"(src), "r"(ROW_BYTES), "r"(bar)
                   : "memory");
  };
  for (int s = 0; s < STAGES; ++s)
    if (first + s * STEP < end) issue(s, first + s * STEP);
  int it = 0;
  for (int k0 = first; k0 < end; k0 += STEP, ++it) {
    const int stage = it % STAGES;
    const uint32_t bar = smem_addr(bars + warp * STAGES + stage), phase = (it / STAGES) & 1;
    asm volatile(
        "{\n\t.reg .pred done;\nWAIT:\n\t"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n\t"
        "@!done bra WAIT;\n}" ::"r"(bar),
        "r"(phase)
        : "memory");
    __syncwarp();
    if (k0 + STAGES * STEP < end) issue(stage, k0 + STAGES * STEP);
  }
}
