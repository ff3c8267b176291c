// Sparse MLA decode over FP8 rows at up to 8 heads (one rank of GLM-5.3 at TP 8), written where shared memory
// and asynchronous copies are explicit: the Triton kernel of kernels/sparse_mla.py issues about 140 warp
// instructions a 656-byte row and cannot pipeline a tile that feeds two products (bench/NOTES.md, ninth and
// eleventh sessions), so it reads 18-20 % of the HBM bandwidth.
//
// Work: one CTA per (split of K, query row). Its warps come in pairs; each pair is an independent
// flash-decoding stream over its own 16-row tiles (tile i of the split goes to pair i % PAIRS), and the two
// warps of a pair share each tile: the even warp computes the scores over the latent's scale blocks 0-1 and
// the rope's first half, the odd warp over blocks 2-3 and the rope's second half, they add their halves
// through shared memory (one named barrier a tile), and each accumulates the output's 256 columns of its
// own blocks. Splitting the work of a tile halves the accumulators a thread holds (64), so twice the warps
// fit an SM: the kernel is bound by the latency of each warp's ldmatrix -> convert -> MMA chains, not by
// any one unit (bench/NOTES.md, eighteenth session). A tile's rows are gathered by one bulk copy per row
// (the copy engine, completing on the stage's mbarrier) STAGES - 1 tiles ahead, issued by whichever warp
// of the pair finishes the stage last; each raw FP8 tile feeds the tensor cores (mma.sync m16n8k16, fp16
// operands, float32 accumulators) from shared memory:
//  - scores, S^T[row, head] (rows on M, the 8 heads on N, no padding): the tile's latent bytes are loaded
//    with ldmatrix as if they were 16-bit pairs, so each thread holds four consecutive e4m3 values of a row;
//    they convert to two fp16 pairs that the MMA reads as K positions (2q, 2q+1) and (2q+8, 2q+9). The dot
//    product does not depend on the order of K, so the query's fp16 copy in shared memory is read in the
//    same order (4 consecutive values, one 8-byte load). Each 128-column block accumulates apart and its
//    float32 scale multiplies the block's partial score (no per-value scaling); the bf16 rope part runs as
//    bf16 products on the raw rope bytes. Both warps add the two halves in the same order, so they keep the
//    same running maximum and probabilities.
//  - output, O^T[column, head] (a warp's 256 columns on M): ldmatrix .trans gives each thread two rows of
//    two adjacent columns; a byte permute and two conversions make the A fragments of an even-column and an
//    odd-column tile. The probabilities, times each row's block scale (one B operand per block), are
//    transposed into the B layout with movmatrix.
//  - online softmax in base 2 with a lazy rescale (the running maximum moves only when a tile's maximum
//    exceeds it by more than TAU, so the accumulators are rarely touched; probabilities stay <= 2^TAU).
// At the end the pairs of a CTA merge through shared memory (one weight per pair and head, then one
// weighted sum per four outputs), and the CTA writes the output (one split) or its normalised partial and
// log-sum-exp (base 2) for kernels/sparse_mla.py's combine kernel.
//
// Each warp reads the slots of its pair's tile after next while it computes (no gather waits on its slot
// loads); the query's loads are issued before the first gathers and converted after them.
//
// Rows past a query's length (or its split's end) repeat the last row in range in the gather and are masked
// to -inf (so garbage never reaches a product as NaN); a query of length 0 gets zeros. Layout of a row
// (kernels/fp8_rows.py): 512 e4m3 values, four float32 block scales, 64 bf16 rope values; every row starts
// 16-byte aligned and a page holds a power of two rows (the launcher checks both).

#include "sparse_mla_common.cuh"

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
constexpr int PAIRS = WARPS / 2;        // two warps share a tile: scores split by blocks, output by columns
constexpr int HALF_DL = DL / 2;
constexpr int STAGES = SMLA_STAGES;
constexpr int STAGE_BYTES = TILE * ROW;
constexpr int Q_STRIDE = DL + 16;  // fp16 values a head row in shared memory (padding spreads the banks)
constexpr int Q_BYTES = HEADS * Q_STRIDE * 2;
constexpr int RING_BYTES = PAIRS * STAGES * STAGE_BYTES;
constexpr int X_BYTES = PAIRS * 2 * 2 * 32 * 16;  // partial scores: [pair, tile parity, half, lane] float4
constexpr float TAU = 8.0f;

static_assert(WARPS % 2 == 0, "warps come in pairs");
static_assert(ROW % 16 == 0 && Q_BYTES % 16 == 0, "bulk copies need 16-byte aligned rows");
static_assert((PAIRS * HEADS * (DL + 2) + HEADS) * 4 <= RING_BYTES, "the merge reuses the ring");
#ifdef SMLA_SHARED_BYTES  // the dynamic shared memory the launcher allocates (kernels/sparse_mla_cuda.py)
static_assert(SMLA_SHARED_BYTES == Q_BYTES + X_BYTES + RING_BYTES + PAIRS * STAGES * (8 + 4),
              "the launcher's shared memory must be the kernel's layout: query, partial scores, stages, barriers");
#endif

}  // namespace


namespace {


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


__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t v) {
  uint32_t r;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(r) : "r"(v));
  return r;
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
  uint8_t* ring = smem + Q_BYTES;                 // [PAIRS, STAGES, TILE, ROW] raw rows
  float4* xbuf = reinterpret_cast<float4*>(ring + RING_BYTES);  // [PAIRS, 2, 2, 32]
  uint64_t* bars = reinterpret_cast<uint64_t*>(ring + RING_BYTES + X_BYTES);  // [PAIRS, STAGES]
  uint32_t* reads = reinterpret_cast<uint32_t*>(bars + PAIRS * STAGES);       // [PAIRS, STAGES] warps done

  const int split = blockIdx.x;
  const int n = blockIdx.y;
  const int warp = threadIdx.x >> 5;
  const int pair = warp >> 1;
  const int half = warp & 1;  // scores over blocks 2 half, 2 half + 1 and half the rope; their columns
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2;  // the MMA's group: a row (scores) or a head (B operands)
  const int q4 = lane & 3;  // the thread in its group

  if (half == 0 && lane == 0) {  // the even warp of a pair sets up its stages' barriers and counters
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(smem_addr(bars + pair * STAGES + s), 1);
      reads[pair * STAGES + s] = 0;
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncwarp();

  // The query's loads are issued first (nothing they feed waits on the slots), converted after the gathers
  // are on their way.
  constexpr int Q_ITEMS = (HEADS * DL / 4 + WARPS * 32 - 1) / (WARPS * 32);  // four values an item
  const __nv_bfloat16* qrow = p.q + n * p.q_stride_n;
  uint2 qv[Q_ITEMS];
#pragma unroll
  for (int j = 0; j < Q_ITEMS; ++j) {
    const int i = threadIdx.x + j * WARPS * 32, h = i / (DL / 4), c = 4 * (i % (DL / 4));
    qv[j] = make_uint2(0u, 0u);
    if (i < HEADS * DL / 4 && h < p.num_heads) qv[j] = *reinterpret_cast<const uint2*>(qrow + h * p.q_stride_h + c);
  }
  constexpr int ROPE_STEPS = DR / 32;  // K steps of the rope a warp (each warp of a pair takes half of them)
  uint32_t q_rope[ROPE_STEPS][2];      // B fragments: head g, dims 16j + 2q4 (+1) and +8 (+9) of its steps
#pragma unroll
  for (int j = 0; j < ROPE_STEPS; ++j) {
    q_rope[j][0] = q_rope[j][1] = 0;
    if (g < p.num_heads) {
      const __nv_bfloat16* r = qrow + g * p.q_stride_h + DL + 16 * (ROPE_STEPS * half + j) + 2 * q4;
      q_rope[j][0] = *reinterpret_cast<const uint32_t*>(r);
      q_rope[j][1] = *reinterpret_cast<const uint32_t*>(r + 8);
    }
  }

  const int end = min((split + 1) * p.split_len, p.lens[n]);
  const int first = split * p.split_len + pair * TILE;
  constexpr int STEP = PAIRS * TILE;
  const int* srow = p.slots + n * p.slots_stride_n;
  const uint32_t ring_pair = smem_addr(ring + pair * STAGES * STAGE_BYTES);
  const uint8_t* ring_pair_ptr = ring + pair * STAGES * STAGE_BYTES;

  // The slot of this lane's row of the tile at k0 (lanes < TILE; rows past the end repeat the last row).
  auto slot_of = [&](int k0) { return lane < TILE && k0 < end ? srow[min(k0 + lane, end - 1)] : 0; };
  // Gather the 16 rows at k0.. (this lane's slot `slot`) into `stage` (by either warp of the pair).
  auto issue = [&](int stage, int slot) {
    const uint8_t* src = p.kv;
    if (lane < TILE) {
      src = p.kv + (slot >> p.page_shift) * p.kv_stride_page + (slot & ((1 << p.page_shift) - 1)) * p.kv_stride_tok;
    }
    const uint32_t bar = smem_addr(bars + pair * STAGES + stage);
    if (lane == 0) mbar_expect_tx(bar, STAGE_BYTES);
    __syncwarp();
    if (lane < TILE) bulk_copy(ring_pair + stage * STAGE_BYTES + lane * ROW, src, ROW, bar);
  };
  if (half == 0) {
#pragma unroll
    for (int s = 0; s < STAGES; ++s)
      if (first + s * STEP < end) issue(s, slot_of(first + s * STEP));
  }
  int next_slot = slot_of(first + STAGES * STEP);

#pragma unroll
  for (int j = 0; j < Q_ITEMS; ++j) {
    const int i = threadIdx.x + j * WARPS * 32, h = i / (DL / 4), c = 4 * (i % (DL / 4));
    if (i < HEADS * DL / 4) {
      const float2 v0 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&qv[j].x));
      const float2 v1 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&qv[j].y));
      *reinterpret_cast<__half2*>(qs + h * Q_STRIDE + c) = __float22half2_rn(v0);
      *reinterpret_cast<__half2*>(qs + h * Q_STRIDE + c + 2) = __float22half2_rn(v1);
    }
  }
  __syncthreads();

  // ldmatrix row addresses of this lane. Plain: matrices (rows 0-7, chunk c), (rows 8-15, c), (0-7, c+1),
  // (8-15, c+1). Transposed: (rows 0-7, bytes b..b+15), (0-7, b+16..), (8-15, b..), (8-15, b+16..).
  const uint32_t a_off = ((lane & 7) + 8 * ((lane >> 3) & 1)) * ROW + 16 * (lane >> 4);
  const uint32_t v_off = ((lane & 7) + 8 * (lane >> 4)) * ROW + 16 * ((lane >> 3) & 1);
  const uint32_t q_addr = smem_addr(qs + g * Q_STRIDE + 4 * q4);

  float o[HALF_DL / 32][2][4];  // this warp's O^T tiles: [32-column span][even / odd columns][fragment]
#pragma unroll
  for (int sp = 0; sp < HALF_DL / 32; ++sp)
#pragma unroll
    for (int t = 0; t < 2; ++t)
#pragma unroll
      for (int i = 0; i < 4; ++i) o[sp][t][i] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY};  // heads 2q4, 2q4 + 1
  float l_part[2] = {0.f, 0.f};             // this thread's rows only; summed over the warp at the end

  int it = 0;
  for (int k0 = first; k0 < end; k0 += STEP, ++it) {
    const int stage = it % STAGES;
    mbar_wait(smem_addr(bars + pair * STAGES + stage), (it / STAGES) & 1);
    const uint32_t tile = ring_pair + stage * STAGE_BYTES;
    const uint8_t* tile_ptr = ring_pair_ptr + stage * STAGE_BYTES;

    // This warp's half of the scores: its two scale blocks and half of the rope.
    float sb[2][4];
    float sr[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int b = 0; b < 2; ++b) sb[b][0] = sb[b][1] = sb[b][2] = sb[b][3] = 0.f;
#pragma unroll
    for (int step = 0; step < DL / 64; ++step) {
      const int cc = 8 * half + 4 * (step % 2) + step / 2;  // the two blocks' chains of products interleaved
      uint32_t r0, r1, r2, r3, a[4], b0, b1;
      ldsm_x4(tile + a_off + 32 * cc, r0, r1, r2, r3);
      e4m3x4_to_half2x2(r0, a[0], a[2]);
      e4m3x4_to_half2x2(r1, a[1], a[3]);
      lds64(q_addr + 64 * cc, b0, b1);
      mma_f16(sb[step % 2], a, b0, b1);
      e4m3x4_to_half2x2(r2, a[0], a[2]);
      e4m3x4_to_half2x2(r3, a[1], a[3]);
      lds64(q_addr + 64 * cc + 32, b0, b1);
      mma_f16(sb[step % 2], a, b0, b1);
    }
#pragma unroll
    for (int j = 0; j < ROPE_STEPS; ++j) {
      uint32_t a[4];
      ldsm_x4(tile + a_off + DL + 4 * NB + 32 * (ROPE_STEPS * half + j), a[0], a[1], a[2], a[3]);
      mma_bf16(sr, a, q_rope[j][0], q_rope[j][1]);
    }
    // The block scales of rows g and g + 8 for this warp's two blocks.
    const float2 scl = *reinterpret_cast<const float2*>(tile_ptr + g * ROW + DL + 8 * half);
    const float2 sch = *reinterpret_cast<const float2*>(tile_ptr + (g + 8) * ROW + DL + 8 * half);
    float4 mine;
    mine.x = sr[0] + scl.x * sb[0][0] + scl.y * sb[1][0];
    mine.y = sr[1] + scl.x * sb[0][1] + scl.y * sb[1][1];
    mine.z = sr[2] + sch.x * sb[0][2] + sch.y * sb[1][2];
    mine.w = sr[3] + sch.x * sb[0][3] + sch.y * sb[1][3];
    float4* xs = xbuf + ((pair * 2 + (it & 1)) * 2) * 32;
    xs[half * 32 + lane] = mine;
    asm volatile("bar.sync %0, 64;" ::"r"(1 + pair) : "memory");  // the pair's partial scores are written
    const float4 other = xs[(1 - half) * 32 + lane];
    // The same sum in both warps (addition commutes), so both keep the same maximum and probabilities.
    float s[4] = {mine.x + other.x, mine.y + other.y, mine.z + other.z, mine.w + other.w};
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
      for (int sp = 0; sp < HALF_DL / 32; ++sp)
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

    // The output's scale blocks are this warp's column blocks 2 half, 2 half + 1.
    uint32_t pb[2][2];
    pb[0][0] = movmatrix_trans(pack_half2(pr0 * scl.x, pr1 * scl.x));
    pb[0][1] = movmatrix_trans(pack_half2(pr2 * sch.x, pr3 * sch.x));
    pb[1][0] = movmatrix_trans(pack_half2(pr0 * scl.y, pr1 * scl.y));
    pb[1][1] = movmatrix_trans(pack_half2(pr2 * sch.y, pr3 * sch.y));
#pragma unroll
    for (int sp = 0; sp < HALF_DL / 32; ++sp) {
      uint32_t r[4], even[4], odd[4];
      ldsm_x4_trans(tile + v_off + HALF_DL * half + 32 * sp, r[0], r[1], r[2], r[3]);
#pragma unroll
      for (int i = 0; i < 4; ++i) e4m3x4_to_half2x2(__byte_perm(r[i], 0, 0x3120), even[i], odd[i]);
      mma_f16(o[sp][0], even, pb[sp / 4][0], pb[sp / 4][1]);
      mma_f16(o[sp][1], odd, pb[sp / 4][0], pb[sp / 4][1]);
    }

    // The second warp of the pair done with the stage gathers the tile after next into it.
    __syncwarp();
    fence_proxy_async();
    uint32_t done = 0;
    if (lane == 0) done = atomicAdd(reads + pair * STAGES + stage, 1u);
    done = __shfl_sync(0xffffffffu, done, 0);
    if ((done & 1) && k0 + STAGES * STEP < end) {
      __threadfence_block();
      issue(stage, next_slot);
    }
    next_slot = slot_of(k0 + (STAGES + 1) * STEP);
  }

  // Merge the pairs: each warp writes its columns of the unnormalised output, the even warp the running
  // maximum and sum (the same in both warps); a weight per pair and head, then one weighted sum per output.
  const float l0 = sum_over_rows(l_part[0]), l1 = sum_over_rows(l_part[1]);
  __syncthreads();  // every warp is done with the ring
  float* obuf = reinterpret_cast<float*>(ring);  // [PAIRS, HEADS, DL]
  float* mbuf = obuf + PAIRS * HEADS * DL;        // [PAIRS, HEADS] running maxima, then the pairs' weights
  float* lbuf = mbuf + PAIRS * HEADS;             // [PAIRS, HEADS] sums
  float* lse_buf = lbuf + PAIRS * HEADS;          // [HEADS]
#pragma unroll
  for (int sp = 0; sp < HALF_DL / 32; ++sp)
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // columns 2g and 2g + 1 (even and odd tiles) of one head side by side
      const int head = 2 * q4 + (i & 1);
      const int col = HALF_DL * half + 32 * sp + 2 * g + 16 * (i >> 1);
      *reinterpret_cast<float2*>(obuf + (pair * HEADS + head) * DL + col) = make_float2(o[sp][0][i], o[sp][1][i]);
    }
  if (g == 0 && half == 0) {
    mbuf[pair * HEADS + 2 * q4] = m_run[0];
    mbuf[pair * HEADS + 2 * q4 + 1] = m_run[1];
    lbuf[pair * HEADS + 2 * q4] = l0;
    lbuf[pair * HEADS + 2 * q4 + 1] = l1;
  }
  __syncthreads();
  if (threadIdx.x < HEADS) {
    const int h = threadIdx.x;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < PAIRS; ++w) mx = fmaxf(mx, mbuf[w * HEADS + h]);
    float total = 0.f;
    if (mx > -INFINITY) {
#pragma unroll
      for (int w = 0; w < PAIRS; ++w) total += exp2f(mbuf[w * HEADS + h] - mx) * lbuf[w * HEADS + h];
    }
#pragma unroll
    for (int w = 0; w < PAIRS; ++w) mbuf[w * HEADS + h] = total > 0.f ? exp2f(mbuf[w * HEADS + h] - mx) / total : 0.f;
    lse_buf[h] = total > 0.f ? mx + log2f(total) : -INFINITY;
  }
  __syncthreads();

  for (int i = threadIdx.x; i < p.num_heads * DL / 4; i += WARPS * 32) {
    const int h = i / (DL / 4), col = 4 * (i % (DL / 4));
    float4 res = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int w = 0; w < PAIRS; ++w) {
      const float wt = mbuf[w * HEADS + h];
      const float4 v = *reinterpret_cast<const float4*>(obuf + (w * HEADS + h) * DL + col);
      res.x += wt * v.x;
      res.y += wt * v.y;
      res.z += wt * v.z;
      res.w += wt * v.w;
    }
    if (p.num_splits == 1) {
      const long long at = n * p.out_stride_n + h * p.out_stride_h + col;
      if (p.out_bf16) {
        __nv_bfloat162* o2 = reinterpret_cast<__nv_bfloat162*>(reinterpret_cast<__nv_bfloat16*>(p.out) + at);
        o2[0] = __floats2bfloat162_rn(res.x, res.y);
        o2[1] = __floats2bfloat162_rn(res.z, res.w);
      } else {
        *reinterpret_cast<float4*>(reinterpret_cast<float*>(p.out) + at) = res;
      }
    } else {
      const long long base = (static_cast<long long>(n) * p.num_splits + split) * p.num_heads + h;
      *reinterpret_cast<float4*>(p.part + base * DL + col) = res;
      if (col == 0) p.lse[base] = lse_buf[h];
    }
  }
}
