// Sparse MLA decode over FP8 rows at up to 8 heads (one rank of GLM-5.3 at TP 8), written where shared memory
// and asynchronous copies are explicit: the Triton kernel of kernels/sparse_mla.py issues about 140 warp
// instructions a 656-byte row and cannot pipeline a tile that feeds two products (bench/NOTES.md, ninth and
// eleventh sessions), so it reads 18-20 % of the HBM bandwidth; this one spends about 45 (44 % at B = 64,
// 59-61 % at B = 128 on an H200; bench/RESULTS.md, fifteenth session).
//
// Work: one CTA per (split of K, query row), WARPS warps, each warp an independent flash-decoding stream over
// its own 16-row tiles (tile i of the split goes to warp i % WARPS). A warp gathers a tile's rows with one
// bulk copy per row (the copy engine, completing on the stage's mbarrier) two stages ahead, and reads each
// raw FP8 tile straight into the tensor cores (mma.sync m16n8k16, fp16 operands, float32 accumulators):
//  - scores, S^T[row, head] (rows on M, the 8 heads on N, no padding): the tile's latent bytes are loaded
//    with ldmatrix as if they were 16-bit pairs, so each thread holds four consecutive e4m3 values of a row;
//    they convert to two fp16 pairs that the MMA reads as K positions (2q, 2q+1) and (2q+8, 2q+9). The dot
//    product does not depend on the order of K, so the query's fp16 copy in shared memory is read in the
//    same order (4 consecutive values, one 8-byte load). Each 128-column block accumulates apart and its
//    float32 scale multiplies the block's partial score (no per-value scaling); the bf16 rope part runs as
//    bf16 products on the raw rope bytes.
//  - output, O^T[column, head] (the 512 columns on M, 128 float32 accumulators a thread): ldmatrix .trans
//    gives each thread two rows of two adjacent columns; a byte permute and two conversions make the A
//    fragments of an even-column and an odd-column tile. The probabilities, times each row's block scale
//    (one B operand per block), are transposed into the B layout with movmatrix.
//  - online softmax in base 2 with a lazy rescale (the running maximum moves only when a tile's maximum
//    exceeds it by more than TAU, so the 128 accumulators are rarely touched; probabilities stay <= 2^TAU).
// At the end the warps of a CTA merge through shared memory, and the CTA writes the output (one split) or
// its normalised partial and log-sum-exp (base 2) for kernels/sparse_mla.py's combine kernel.
//
// A warp reads the slots of its tile after next while it computes (no gather waits on its slot loads), and
// the query's loads and fp16 conversion overlap the first gathers.
//
// Rows past a query's length (or its split's end) repeat the last row in range in the gather and are masked
// to -inf (so garbage never reaches a product as NaN); a query of length 0 gets zeros. Layout of a row
// (kernels/fp8_rows.py): 512 e4m3 values, four float32 block scales, 64 bf16 rope values; every row starts
// 16-byte aligned (the launcher checks the pool's base and strides).

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace {

constexpr int DL = 512;                    // latent values a row
constexpr int DR = 64;                     // rope values a row
constexpr int NB = DL / 128;               // block scales a row
constexpr int ROW = DL + 4 * NB + 2 * DR;  // 656 bytes
constexpr int HEADS = 8;                   // the MMA's N
constexpr int TILE = 16;                   // rows a warp tile (the MMA's M for scores, K for the output)
#ifndef SMLA_WARPS  // kernels/sparse_mla_cuda.py's Variant sets these three
#define SMLA_WARPS 8
#endif
#ifndef SMLA_STAGES
#define SMLA_STAGES 2
#endif
#ifndef SMLA_CTAS_PER_SM
#define SMLA_CTAS_PER_SM 1
#endif
constexpr int WARPS = SMLA_WARPS;
constexpr int STAGES = SMLA_STAGES;
constexpr int STAGE_BYTES = TILE * ROW;
constexpr int Q_STRIDE = DL + 16;  // fp16 values a head row in shared memory (padding spreads the banks)
constexpr int Q_BYTES = HEADS * Q_STRIDE * 2;
constexpr int RING_BYTES = WARPS * STAGES * STAGE_BYTES;
constexpr float TAU = 8.0f;

static_assert(ROW % 16 == 0 && Q_BYTES % 16 == 0, "bulk copies need 16-byte aligned rows");
static_assert(WARPS * HEADS * (DL + 2) * 4 <= RING_BYTES, "the merge reuses the ring");

}  // namespace

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
  int num_heads, num_splits, split_len, page_size;
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

// Orders this thread's generic-proxy shared-memory accesses before later bulk copies into the same bytes.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

__device__ __forceinline__ void ldsm_x4(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}

__device__ __forceinline__ void ldsm_x4_trans(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2,
                                              uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}

__device__ __forceinline__ void lds64(uint32_t addr, uint32_t& lo, uint32_t& hi) {
  asm volatile("ld.shared.v2.b32 {%0, %1}, [%2];" : "=r"(lo), "=r"(hi) : "r"(addr));
}

// Four e4m3 bytes -> two fp16 pairs: bytes (0, 1) -> lo, bytes (2, 3) -> hi, the lower byte in the lower half.
__device__ __forceinline__ void e4m3x4_to_half2x2(uint32_t v, uint32_t& lo, uint32_t& hi) {
  asm("{\n\t.reg .b16 a, b;\n\t"
      "mov.b32 {a, b}, %2;\n\t"
      "cvt.rn.f16x2.e4m3x2 %0, a;\n\t"
      "cvt.rn.f16x2.e4m3x2 %1, b;\n}"
      : "=r"(lo), "=r"(hi)
      : "r"(v));
}

__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t v) {
  uint32_t r;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(r) : "r"(v));
  return r;
}

__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

// D += A B, m16n8k16 with float32 accumulators, operands of `type` ("f16" or "bf16").
#define SMLA_MMA(name, type)                                                                                 \
  __device__ __forceinline__ void name(float(&c)[4], const uint32_t(&a)[4], uint32_t b0, uint32_t b1) {      \
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." type "." type                                      \
                 ".f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"                      \
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                                            \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));                            \
  }
SMLA_MMA(mma_f16, "f16")
SMLA_MMA(mma_bf16, "bf16")
#undef SMLA_MMA

__device__ __forceinline__ float max_over_rows(float v) {  // over the 8 lanes that share a head pair
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 4));
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 8));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 16));
}

__device__ __forceinline__ float sum_over_rows(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 4);
  v += __shfl_xor_sync(0xffffffffu, v, 8);
  return v + __shfl_xor_sync(0xffffffffu, v, 16);
}

}  // namespace

extern "C" __global__ void __launch_bounds__(WARPS * 32, SMLA_CTAS_PER_SM) sparse_mla_fp8_h8(const SparseMLAParams p) {
  extern __shared__ __align__(128) uint8_t smem[];
  __half* qs = reinterpret_cast<__half*>(smem);  // [HEADS, Q_STRIDE] the latent query in fp16
  uint8_t* ring = smem + Q_BYTES;                 // [WARPS, STAGES, TILE, ROW] raw rows
  uint64_t* bars = reinterpret_cast<uint64_t*>(ring + RING_BYTES);

  const int split = blockIdx.x;
  const int n = blockIdx.y;
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2;  // the MMA's group: a row (scores) or a head (B operands)
  const int q4 = lane & 3;  // the thread in its group

  if (lane == 0) {  // each warp owns its stages' barriers
#pragma unroll
    for (int s = 0; s < STAGES; ++s) mbar_init(smem_addr(bars + warp * STAGES + s), 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncwarp();

  const int end = min((split + 1) * p.split_len, p.lens[n]);
  const int first = split * p.split_len + warp * TILE;
  constexpr int STEP = WARPS * TILE;
  const int* srow = p.slots + n * p.slots_stride_n;
  const uint32_t ring_warp = smem_addr(ring + warp * STAGES * STAGE_BYTES);
  const uint8_t* ring_warp_ptr = ring + warp * STAGES * STAGE_BYTES;

  // The slot of this lane's row of the tile at k0 (lanes < TILE; rows past the end repeat the last row).
  auto slot_of = [&](int k0) { return lane < TILE && k0 < end ? srow[min(k0 + lane, end - 1)] : 0; };
  // Gather the 16 rows at k0.. (this lane's slot `slot`) into `stage`.
  auto issue = [&](int stage, int slot) {
    const uint8_t* src = p.kv;
    if (lane < TILE) {
      const int page = slot / p.page_size;
      const int tok = slot - page * p.page_size;
      src = p.kv + page * p.kv_stride_page + tok * p.kv_stride_tok;
    }
    const uint32_t bar = smem_addr(bars + warp * STAGES + stage);
    if (lane == 0) mbar_expect_tx(bar, STAGE_BYTES);
    __syncwarp();
    if (lane < TILE) bulk_copy(ring_warp + stage * STAGE_BYTES + lane * ROW, src, ROW, bar);
  };
#pragma unroll
  for (int s = 0; s < STAGES; ++s)
    if (first + s * STEP < end) issue(s, slot_of(first + s * STEP));
  // Slots are read a tile ahead of their gather, so no gather waits on the load of its slots.
  int next_slot = slot_of(first + STAGES * STEP);

  // The query's loads and conversion overlap the first gathers.
  const __nv_bfloat16* qrow = p.q + n * p.q_stride_n;
  for (int i = threadIdx.x; i < HEADS * DL / 4; i += WARPS * 32) {
    const int h = i / (DL / 4), c = 4 * (i % (DL / 4));
    float2 v0 = make_float2(0.f, 0.f), v1 = v0;
    if (h < p.num_heads) {
      v0 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(qrow + h * p.q_stride_h + c));
      v1 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(qrow + h * p.q_stride_h + c + 2));
    }
    *reinterpret_cast<__half2*>(qs + h * Q_STRIDE + c) = __float22half2_rn(v0);
    *reinterpret_cast<__half2*>(qs + h * Q_STRIDE + c + 2) = __float22half2_rn(v1);
  }
  uint32_t q_rope[DR / 16][2];  // B fragments of the rope products: head g, dims 16j + 2q4 (+1) and +8 (+9)
#pragma unroll
  for (int j = 0; j < DR / 16; ++j) {
    q_rope[j][0] = q_rope[j][1] = 0;
    if (g < p.num_heads) {
      const __nv_bfloat16* r = qrow + g * p.q_stride_h + DL + 16 * j + 2 * q4;
      q_rope[j][0] = *reinterpret_cast<const uint32_t*>(r);
      q_rope[j][1] = *reinterpret_cast<const uint32_t*>(r + 8);
    }
  }
  __syncthreads();

  // ldmatrix row addresses of this lane. Plain: matrices (rows 0-7, chunk c), (rows 8-15, c), (0-7, c+1),
  // (8-15, c+1). Transposed: (rows 0-7, bytes b..b+15), (0-7, b+16..), (8-15, b..), (8-15, b+16..).
  const uint32_t a_off = ((lane & 7) + 8 * ((lane >> 3) & 1)) * ROW + 16 * (lane >> 4);
  const uint32_t v_off = ((lane & 7) + 8 * (lane >> 4)) * ROW + 16 * ((lane >> 3) & 1);
  const uint32_t q_addr = smem_addr(qs + g * Q_STRIDE + 4 * q4);

  float o[DL / 32][2][4];  // O^T tiles: [32-column span][even / odd columns][fragment]
#pragma unroll
  for (int sp = 0; sp < DL / 32; ++sp)
#pragma unroll
    for (int t = 0; t < 2; ++t)
#pragma unroll
      for (int i = 0; i < 4; ++i) o[sp][t][i] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY};  // heads 2q4, 2q4 + 1
  float l_part[2] = {0.f, 0.f};             // this thread's rows only; summed over the warp at the end

  int it = 0;
  for (int k0 = first; k0 < end; k0 += STEP, ++it) {
    const int stage = it % STAGES;
    mbar_wait(smem_addr(bars + warp * STAGES + stage), (it / STAGES) & 1);
    const uint32_t tile = ring_warp + stage * STAGE_BYTES;
    const uint8_t* tile_ptr = ring_warp_ptr + stage * STAGE_BYTES;

    // Scores: per scale block over the latent, then the rope.
    float sb[NB][4];
    float sr[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int b = 0; b < NB; ++b) sb[b][0] = sb[b][1] = sb[b][2] = sb[b][3] = 0.f;
#pragma unroll
    for (int step = 0; step < DL / 32; ++step) {
      const int cc = 4 * (step % NB) + step / NB;  // the four blocks' chains of products interleaved
      uint32_t r0, r1, r2, r3, a[4], b0, b1;
      ldsm_x4(tile + a_off + 32 * cc, r0, r1, r2, r3);
      e4m3x4_to_half2x2(r0, a[0], a[2]);
      e4m3x4_to_half2x2(r1, a[1], a[3]);
      lds64(q_addr + 64 * cc, b0, b1);
      mma_f16(sb[cc / 4], a, b0, b1);
      e4m3x4_to_half2x2(r2, a[0], a[2]);
      e4m3x4_to_half2x2(r3, a[1], a[3]);
      lds64(q_addr + 64 * cc + 32, b0, b1);
      mma_f16(sb[cc / 4], a, b0, b1);
    }
#pragma unroll
    for (int j = 0; j < DR / 16; ++j) {
      uint32_t a[4];
      ldsm_x4(tile + a_off + DL + 4 * NB + 32 * j, a[0], a[1], a[2], a[3]);
      mma_bf16(sr, a, q_rope[j][0], q_rope[j][1]);
    }
    const float4 sc_lo = *reinterpret_cast<const float4*>(tile_ptr + g * ROW + DL);        // row g
    const float4 sc_hi = *reinterpret_cast<const float4*>(tile_ptr + (g + 8) * ROW + DL);  // row g + 8
    const float scl[NB] = {sc_lo.x, sc_lo.y, sc_lo.z, sc_lo.w};
    const float sch[NB] = {sc_hi.x, sc_hi.y, sc_hi.z, sc_hi.w};
    float s[4] = {sr[0], sr[1], sr[2], sr[3]};  // (row g, head 2q4), (g, 2q4+1), (g+8, 2q4), (g+8, 2q4+1)
#pragma unroll
    for (int b = 0; b < NB; ++b) {
      s[0] += scl[b] * sb[b][0];
      s[1] += scl[b] * sb[b][1];
      s[2] += sch[b] * sb[b][2];
      s[3] += sch[b] * sb[b][3];
    }
    const bool lo_ok = k0 + g < end, hi_ok = k0 + g + 8 < end;
    s[0] = lo_ok ? s[0] * p.scale_log2 : -INFINITY;
    s[1] = lo_ok ? s[1] * p.scale_log2 : -INFINITY;
    s[2] = hi_ok ? s[2] * p.scale_log2 : -INFINITY;
    s[3] = hi_ok ? s[3] * p.scale_log2 : -INFINITY;

    const float mx0 = max_over_rows(fmaxf(s[0], s[2]));
    const float mx1 = max_over_rows(fmaxf(s[1], s[3]));
    if (__any_sync(0xffffffffu, mx0 > m_run[0] + TAU || mx1 > m_run[1] + TAU)) {
      const float n0 = fmaxf(m_run[0], mx0), n1 = fmaxf(m_run[1], mx1);
      const float al0 = exp2f(m_run[0] - n0), al1 = exp2f(m_run[1] - n1);
      m_run[0] = n0;
      m_run[1] = n1;
      l_part[0] *= al0;
      l_part[1] *= al1;
#pragma unroll
      for (int sp = 0; sp < DL / 32; ++sp)
#pragma unroll
        for (int t = 0; t < 2; ++t) {
          o[sp][t][0] *= al0;
          o[sp][t][1] *= al1;
          o[sp][t][2] *= al0;
          o[sp][t][3] *= al1;
        }
    }
    const float pr0 = exp2f(s[0] - m_run[0]), pr1 = exp2f(s[1] - m_run[1]);
    const float pr2 = exp2f(s[2] - m_run[0]), pr3 = exp2f(s[3] - m_run[1]);
    l_part[0] += pr0 + pr2;
    l_part[1] += pr1 + pr3;

    // P^T as the output's B operand, once per scale block: rows 0-7 (b0) and 8-15 (b1) of this tile, head g.
    uint32_t pb[NB][2];
#pragma unroll
    for (int b = 0; b < NB; ++b) {
      pb[b][0] = movmatrix_trans(pack_half2(pr0 * scl[b], pr1 * scl[b]));
      pb[b][1] = movmatrix_trans(pack_half2(pr2 * sch[b], pr3 * sch[b]));
    }
#pragma unroll
    for (int sp = 0; sp < DL / 32; ++sp) {
      uint32_t r[4], even[4], odd[4];
      ldsm_x4_trans(tile + v_off + 32 * sp, r[0], r[1], r[2], r[3]);
#pragma unroll
      for (int i = 0; i < 4; ++i) e4m3x4_to_half2x2(__byte_perm(r[i], 0, 0x3120), even[i], odd[i]);
      mma_f16(o[sp][0], even, pb[sp / 4][0], pb[sp / 4][1]);
      mma_f16(o[sp][1], odd, pb[sp / 4][0], pb[sp / 4][1]);
    }

    __syncwarp();
    fence_proxy_async();  // this warp's reads of the stage come before the next gather into it
    if (k0 + STAGES * STEP < end) issue(stage, next_slot);
    next_slot = slot_of(k0 + (STAGES + 1) * STEP);
  }

  // Merge the warps: each writes its unnormalised output, running maximum and sum; the CTA combines them.
  const float l0 = sum_over_rows(l_part[0]), l1 = sum_over_rows(l_part[1]);
  __syncthreads();  // every warp is done with the ring
  float* obuf = reinterpret_cast<float*>(ring);  // [WARPS, HEADS, DL]
  float* mbuf = obuf + WARPS * HEADS * DL;        // [WARPS, HEADS]
  float* lbuf = mbuf + WARPS * HEADS;
#pragma unroll
  for (int sp = 0; sp < DL / 32; ++sp)
#pragma unroll
    for (int t = 0; t < 2; ++t)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int head = 2 * q4 + (i & 1);
        const int col = 32 * sp + 2 * g + t + 16 * (i >> 1);
        obuf[(warp * HEADS + head) * DL + col] = o[sp][t][i];
      }
  if (g == 0) {
    mbuf[warp * HEADS + 2 * q4] = m_run[0];
    mbuf[warp * HEADS + 2 * q4 + 1] = m_run[1];
    lbuf[warp * HEADS + 2 * q4] = l0;
    lbuf[warp * HEADS + 2 * q4 + 1] = l1;
  }
  __syncthreads();

  for (int i = threadIdx.x; i < p.num_heads * DL; i += WARPS * 32) {
    const int h = i / DL, col = i % DL;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) mx = fmaxf(mx, mbuf[w * HEADS + h]);
    float total = 0.f, val = 0.f;
    if (mx > -INFINITY) {
#pragma unroll
      for (int w = 0; w < WARPS; ++w) {
        const float e = exp2f(mbuf[w * HEADS + h] - mx);
        total += e * lbuf[w * HEADS + h];
        val += e * obuf[(w * HEADS + h) * DL + col];
      }
    }
    const float res = total > 0.f ? val / total : 0.f;
    if (p.num_splits == 1) {
      const long long at = n * p.out_stride_n + h * p.out_stride_h + col;
      if (p.out_bf16)
        reinterpret_cast<__nv_bfloat16*>(p.out)[at] = __float2bfloat16(res);
      else
        reinterpret_cast<float*>(p.out)[at] = res;
    } else {
      const long long base = (static_cast<long long>(n) * p.num_splits + split) * p.num_heads + h;
      p.part[base * DL + col] = res;
      if (col == 0) p.lse[base] = total > 0.f ? mx + log2f(total) : -INFINITY;
    }
  }
}
