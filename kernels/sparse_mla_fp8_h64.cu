// Sparse MLA decode over FP8 rows at 9 to 64 heads (GLM-5.3's 64 heads on one GPU, e.g. attention data
// parallel): there the work is the tensor cores' (2 x 64 x 1,088 flops a 656-byte row, about 200 flops a
// byte), and a kernel that feeds them from registers (mma.sync, the Triton kernels) spills or re-reads every
// row once per 16 heads. Here the Hopper warpgroup MMA (wgmma) reads both operands of the scores and the
// rows of the output straight from shared memory, 64 heads a product.
//
// Work: one CTA per (split of K, query row), three warpgroups. A tile is 32 selected rows. The producer
// (warpgroup 2, 72 registers a thread) gathers and converts; the two consumers (216 registers) compute, on
// tile i while the producer converts tile i + 1 (bench/NOTES.md: with everyone doing every phase in turn the
// gathers' issue and the conversion held up the products, 91 -> 82 us at B = 64):
//  - gathered raw by one bulk copy a row (the copy engine, completing on the stage's mbarrier), STAGES tiles
//    ahead, eight rows by each producer warp;
//  - converted once into fp16 with its block scales applied, laid out in the wgmma's canonical no-swizzle
//    form: 8 x 8 "core matrices" of 128 contiguous bytes, [row / 8][column / 8][row % 8][column % 8]. The same
//    tile is the K-major B operand of the scores (columns are K) and the MN-major B operand of the output
//    (rows are K), so one copy serves both products. Two tile buffers, each with a "full" mbarrier (the
//    producer's) and an "empty" one (the consumers');
//  - scores S[head, row] = Q K^T: consumer w takes half of the 576 columns (18 steps of m64n32k16, the query
//    in the same layout in shared memory as the A operand), the halves are added through shared memory in
//    the same order in both warpgroups, so both hold the same scores and make the same softmax decisions;
//  - online softmax in base 2 with a lazy rescale (the running maximum moves only when a tile's maximum
//    exceeds it by more than TAU, so the accumulators are rarely touched; probabilities stay <= 2^TAU, well
//    inside fp16);
//  - output O[head, column] += P V: consumer w owns 256 of the 512 columns (128 float32 accumulators a
//    thread); P goes from the scores' accumulators straight into A fragments (registers), V is the tile.
// At the end each consumer writes its columns: the output (one split) or its normalised partial and
// log-sum-exp (base 2) for kernels/sparse_mla.py's combine kernel.
//
// Rows past a query's length (or its split's end) repeat the last row in range in the gather and are masked
// to -inf; a query of length 0 gets zeros. Heads past `num_heads` are zero queries whose outputs are not
// written. Row layout (kernels/fp8_rows.py): 512 e4m3 values, four float32 block scales, 64 bf16 rope
// values; every row starts 16-byte aligned and a page holds a power of two rows (the launcher checks both).
// Built for sm_90a (wgmma, setmaxnreg).

#include "sparse_mla_common.cuh"

namespace {

constexpr int DL = 512;                    // latent values a row
constexpr int DR = 64;                     // rope values a row
constexpr int D = DL + DR;                 // the scores' K
constexpr int NB = DL / 128;               // block scales a row
constexpr int ROW = DL + 4 * NB + 2 * DR;  // 656 bytes
constexpr int HEADS = 64;                  // wgmma's M
constexpr int TILE = 32;                   // rows a tile: the scores' N, two K steps of the output
constexpr int THREADS = 384;               // two consumer warpgroups and a producer
constexpr int CONSUMERS = 256;
// Registers a thread after the split: 2 x 128 x 216 + 128 x 72 is the launch's 384 x 168 (setmaxnreg.inc
// waits for registers the producer's dec gives back, so more would never return).
constexpr int CONSUMER_REGISTERS = 216;
constexpr int PRODUCER_REGISTERS = 72;
static_assert(CONSUMERS * CONSUMER_REGISTERS + (THREADS - CONSUMERS) * PRODUCER_REGISTERS == THREADS * 168,
              "the register split must give back exactly what the launch allocated");
constexpr int CORE = 128;                  // bytes of a core matrix: 8 rows of 8 fp16 values
constexpr int CHUNKS = D / 8;              // core matrices along a row of 576 values
constexpr int ROW_BLOCK = CHUNKS * CORE;   // bytes between core matrices 8 rows apart (9,216)
constexpr int Q_BYTES = HEADS * D * 2;
constexpr int KT_BYTES = TILE * D * 2;
#ifndef SMLA64_STAGES  // kernels/sparse_mla_cuda.py sets it (and the shared memory, checked below)
#define SMLA64_STAGES 3
#endif
constexpr int STAGES = SMLA64_STAGES;
constexpr int STAGE_BYTES = TILE * ROW;
constexpr int SCORE_STEPS = D / 16 / 2;      // k16 steps of a warpgroup's half of the scores
constexpr int X_BYTES = 2 * 4 * 128 * 16;  // [consumer][4][thread] float4: the partial scores
constexpr int OUT_COLS = DL / 2;             // columns of the output a warpgroup owns
constexpr int OUT_BLOCKS = OUT_COLS / 64;    // m64n64k16 products a K step
constexpr float TAU = 8.0f;

static_assert(ROW % 16 == 0, "bulk copies need 16-byte aligned rows");
#ifdef SMLA64_SHARED_BYTES
static_assert(SMLA64_SHARED_BYTES == Q_BYTES + 2 * KT_BYTES + STAGES * STAGE_BYTES + X_BYTES + (STAGES + 4) * 8,
              "the launcher's shared memory must be the kernel's layout: query, two tiles, stages, scores, "
              "barriers (a stage's, two tiles' full and empty)");
#endif


// A shared-memory matrix descriptor, no swizzle: start address, the byte distance between core matrices
// adjacent along K (leading) and along M or N (stride). So for K-major and MN-major operands alike (checked
// on an H200 against both readings: the other gives wrong products).
__device__ __forceinline__ uint64_t descriptor(uint32_t addr, uint32_t leading, uint32_t stride) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>(leading >> 4) << 16) |
         (static_cast<uint64_t>(stride >> 4) << 32);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }

// Keeps the compiler from reading or writing accumulators across a wgmma wait (they are written
// asynchronously).
template <int N>
__device__ __forceinline__ void fence_registers(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

// D (+)= A B, m64n32k16, A and B K-major in shared memory, fp16 operands, float32 accumulators.
__device__ __forceinline__ void wgmma_scores(float (&d)[16], uint64_t a, uint64_t b, int accumulate) {
  asm volatile(
      "{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %18, 0;\n\t"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1, 0, 0;\n}"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "l"(a), "l"(b), "r"(accumulate));
}

// D += A B, m64n64k16, A in registers, B MN-major in shared memory, fp16 operands, float32 accumulators.
__device__ __forceinline__ void wgmma_output(float (&d)[32], const uint32_t (&a)[4], uint64_t b) {
  asm volatile(
      "{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %37, 0;\n\t"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "{%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
}


__device__ __forceinline__ uint32_t half2_scaled(uint32_t h, float scale) {
  const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h));
  return pack_half2(f.x * scale, f.y * scale);
}

// Four e4m3 bytes times `scale` -> two fp16 pairs (e4m3x4_to_half2x2's order), the products in float32.
__device__ __forceinline__ void e4m3x4_scaled(uint32_t v, float scale, uint32_t& lo, uint32_t& hi) {
  e4m3x4_to_half2x2(v, lo, hi);
  lo = half2_scaled(lo, scale);
  hi = half2_scaled(hi, scale);
}

// e4m3x4_scaled with the scale in fp16: the products in fp16.
__device__ __forceinline__ void e4m3x4_times(uint32_t v, __half2 scale, uint32_t& lo, uint32_t& hi) {
  e4m3x4_to_half2x2(v, lo, hi);
  const __half2 l = __hmul2(*reinterpret_cast<const __half2*>(&lo), scale);
  const __half2 h = __hmul2(*reinterpret_cast<const __half2*>(&hi), scale);
  lo = *reinterpret_cast<const uint32_t*>(&l);
  hi = *reinterpret_cast<const uint32_t*>(&h);
}

// Whether a positive scale is a normal fp16 number (a subnormal one would lose its precision).
__device__ __forceinline__ bool fp16_normal(float x) { return x >= 6.2e-5f && x <= 65504.f; }

__device__ __forceinline__ uint32_t bf16x2_to_half2(uint32_t v) {
  const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v));
  return pack_half2(f.x, f.y);
}

__device__ __forceinline__ uint4 bf16x8_to_half8(uint4 v) {
  return make_uint4(bf16x2_to_half2(v.x), bf16x2_to_half2(v.y), bf16x2_to_half2(v.z), bf16x2_to_half2(v.w));
}

__device__ __forceinline__ float max_over_quad(float v) {  // over the 4 lanes that hold one head's columns
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

__device__ __forceinline__ float sum_over_quad(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

// The named barriers: 0 is __syncthreads, 1 the producer's 128 threads, 2 the consumers' 256.
__device__ __forceinline__ void named_sync(int id, int count) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(count) : "memory");
}

// One row's latent chunks col, col + 4, ..., col + 60 (scale block i / 4 for the i-th) into its fp16
// core-matrix rows at dst: each value times its block's scale, the products in fp16 or in float32.
template <bool FP16_PRODUCTS>
__device__ __forceinline__ void convert_latent(const uint8_t* raw, uint8_t* dst, const float (&sc)[NB], int col) {
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const int c = col + 4 * i;
    const uint2 v = *reinterpret_cast<const uint2*>(raw + 8 * c);
    uint4 h;
    if constexpr (FP16_PRODUCTS) {
      const __half2 scale = __float2half2_rn(sc[i / 4]);
      e4m3x4_times(v.x, scale, h.x, h.y);
      e4m3x4_times(v.y, scale, h.z, h.w);
    } else {
      e4m3x4_scaled(v.x, sc[i / 4], h.x, h.y);
      e4m3x4_scaled(v.y, sc[i / 4], h.z, h.w);
    }
    *reinterpret_cast<uint4*>(dst + c * CORE) = h;
  }
}

}  // namespace

extern "C" __global__ void __launch_bounds__(THREADS, 1) sparse_mla_fp8_h64(const SparseMLAParams p) {
  extern __shared__ __align__(128) uint8_t smem[];
  uint8_t* qs = smem;                                              // [HEADS / 8][CHUNKS][8][8] fp16
  uint8_t* tiles_s = qs + Q_BYTES;                                 // 2 x [TILE / 8][CHUNKS][8][8] fp16
  uint8_t* ring = tiles_s + 2 * KT_BYTES;                          // [STAGES][TILE][ROW] raw rows
  float4* xbuf = reinterpret_cast<float4*>(ring + STAGES * STAGE_BYTES);        // [2][4][128]
  uint64_t* raw_full = reinterpret_cast<uint64_t*>(ring + STAGES * STAGE_BYTES + X_BYTES);  // [STAGES]
  uint64_t* tile_full = raw_full + STAGES;   // [2] a converted tile is ready
  uint64_t* tile_empty = tile_full + 2;      // [2] the consumers are done with a tile buffer

  const int split = blockIdx.x;
  const int n = blockIdx.y;
  const int tid = threadIdx.x;
  const int wg = tid >> 7;
  const int t = tid & 127;
  const int warp = tid >> 5;
  const int lane = tid & 31;

  const int start = split * p.split_len;
  const int end = min(start + p.split_len, p.lens[n]);
  const int num_tiles = end > start ? (end - start + TILE - 1) / TILE : 0;
  const int* srow = p.slots + n * p.slots_stride_n;

  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < STAGES; ++s) mbar_init(smem_addr(raw_full + s), 1);
    for (int b = 0; b < 2; ++b) {
      mbar_init(smem_addr(tile_full + b), 1);
      mbar_init(smem_addr(tile_empty + b), CONSUMERS);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (wg == 2) {  // the producer: gathers and converts tile j while the consumers compute tile j - 1
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(PRODUCER_REGISTERS));
    const int pw = warp - 8;
    const int my_row = 8 * pw + (lane & 7);
    auto slot_of = [&](int j) { return j < num_tiles ? srow[min(start + j * TILE + my_row, end - 1)] : 0; };
    auto issue = [&](int j, int slot) {
      const uint8_t* src = p.kv + (slot >> p.page_shift) * p.kv_stride_page +
                           (slot & ((1 << p.page_shift) - 1)) * p.kv_stride_tok;
      const uint32_t bar = smem_addr(raw_full + j % STAGES);
      if (t == 0) mbar_expect_tx(bar, STAGE_BYTES);
      if (lane < 8) bulk_copy(smem_addr(ring + (j % STAGES) * STAGE_BYTES + my_row * ROW), src, ROW, bar);
    };
    for (int j = 0; j < STAGES && j < num_tiles; ++j) issue(j, slot_of(j));
    int next_slot = slot_of(STAGES);
    // A thread converts one row's every fourth core column from conv_col (16 latent chunks, two of the
    // rope); the 8 threads of a row block store one core matrix, 128 contiguous bytes.
    const int r8 = t & 7, pg = t >> 3;
    const int conv_row = 8 * (pg & 3) + r8;
    const int conv_col = pg >> 2;
    for (int j = 0; j < num_tiles; ++j) {
      const int b = j & 1;
      if (j >= 2) mbar_wait(smem_addr(tile_empty + b), ((j >> 1) - 1) & 1);
      mbar_wait(smem_addr(raw_full + j % STAGES), (j / STAGES) & 1);
      const uint8_t* raw = ring + (j % STAGES) * STAGE_BYTES + conv_row * ROW;
      uint8_t* dst = tiles_s + b * KT_BYTES + (conv_row >> 3) * ROW_BLOCK + r8 * 16;
      const float4 scales = *reinterpret_cast<const float4*>(raw + DL);
      const float sc[NB] = {scales.x, scales.y, scales.z, scales.w};
      // Each value times its block's scale in fp16 (one multiply a pair) when the scales are normal fp16
      // numbers, as with real latents; else in float32.
      if (fp16_normal(scales.x) && fp16_normal(scales.y) && fp16_normal(scales.z) && fp16_normal(scales.w)) {
        convert_latent<true>(raw, dst, sc, conv_col);
      } else {
        convert_latent<false>(raw, dst, sc, conv_col);
      }
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        const int c = conv_col + 4 * k;
        const uint4 rope = *reinterpret_cast<const uint4*>(raw + DL + 4 * NB + 16 * c);
        *reinterpret_cast<uint4*>(dst + (DL / 8 + c) * CORE) = bf16x8_to_half8(rope);
      }
      fence_proxy_async();
      named_sync(1, 128);  // the tile is written, its stage read
      if (t == 0) mbar_arrive(smem_addr(tile_full + b));
      if (j + STAGES < num_tiles) issue(j + STAGES, next_slot);
      next_slot = slot_of(j + STAGES + 1);
    }
    return;
  }

  // The consumers: the query into fp16 core matrices (a thread stores row r8 of a core matrix, 8 threads one
  // matrix), then the tiles in turn.
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(CONSUMER_REGISTERS));
  const int g = lane >> 2;                    // heads 16 (warp % 4) + g and + 8
  const int q4 = lane & 3;                    // columns 8 i + 2 q4, + 1 of each 8 of an accumulator
  const int h0 = 16 * (warp & 3) + g;
  {
    const int r8 = tid & 7, grp = tid >> 3;
    const __nv_bfloat16* qrow = p.q + n * p.q_stride_n;
#pragma unroll 6
    for (int j = 0; j < HEADS / 8 * CHUNKS / (CONSUMERS / 8); ++j) {
      const int item = grp + (CONSUMERS / 8) * j, hb = item & 7, c = item >> 3, h = 8 * hb + r8;
      uint4 v = make_uint4(0u, 0u, 0u, 0u);
      if (h < p.num_heads) v = *reinterpret_cast<const uint4*>(qrow + h * p.q_stride_h + 8 * c);
      *reinterpret_cast<uint4*>(qs + (hb * CHUNKS + c) * CORE + r8 * 16) = bf16x8_to_half8(v);
    }
  }
  fence_proxy_async();  // the query, for the scores' wgmma
  named_sync(2, CONSUMERS);

  const uint32_t q_addr = smem_addr(qs) + wg * SCORE_STEPS * 2 * CORE;
  const uint32_t tiles_addr = smem_addr(tiles_s);
  float o[OUT_BLOCKS][32];
#pragma unroll
  for (int b = 0; b < OUT_BLOCKS; ++b)
#pragma unroll
    for (int i = 0; i < 32; ++i) o[b][i] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY};  // heads h0, h0 + 8
  float l_part[2] = {0.f, 0.f};             // this thread's columns only; summed over the quad at the end

  for (int i = 0; i < num_tiles; ++i) {
    const int k0 = start + i * TILE;
    const uint32_t tile = tiles_addr + (i & 1) * KT_BYTES;
    mbar_wait(smem_addr(tile_full + (i & 1)), (i >> 1) & 1);
    float s[16];
#pragma unroll
    for (int e = 0; e < 16; ++e) s[e] = 0.f;
    wgmma_fence();
#pragma unroll
    for (int st = 0; st < SCORE_STEPS; ++st) {
      const uint32_t col = (wg * SCORE_STEPS + st) * 2 * CORE;
      wgmma_scores(s, descriptor(q_addr + st * 2 * CORE, CORE, ROW_BLOCK), descriptor(tile + col, CORE, ROW_BLOCK),
                   st > 0);
    }
    wgmma_commit();
    wgmma_wait_all();
    fence_registers(s);
    float4* mine = xbuf + wg * 4 * 128 + t;
    named_sync(2, CONSUMERS);  // both warpgroups have read the last tile's partial scores
#pragma unroll
    for (int c = 0; c < 4; ++c) mine[c * 128] = make_float4(s[4 * c], s[4 * c + 1], s[4 * c + 2], s[4 * c + 3]);
    named_sync(2, CONSUMERS);  // both partials written
    const float4* other = xbuf + (1 - wg) * 4 * 128 + t;
#pragma unroll
    for (int c = 0; c < 4; ++c) {  // the same sum in both warpgroups (addition commutes)
      const float4 x = other[c * 128];
      s[4 * c] += x.x;
      s[4 * c + 1] += x.y;
      s[4 * c + 2] += x.z;
      s[4 * c + 3] += x.w;
    }
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int e = 0; e < 16; ++e) {
      const int row = 8 * (e >> 2) + 2 * q4 + (e & 1);
      s[e] = k0 + row < end ? s[e] * p.scale_log2 : -INFINITY;
      mx[(e >> 1) & 1] = fmaxf(mx[(e >> 1) & 1], s[e]);
    }
    mx[0] = max_over_quad(mx[0]);
    mx[1] = max_over_quad(mx[1]);
    if (__any_sync(0xffffffffu, mx[0] > m_run[0] + TAU || mx[1] > m_run[1] + TAU)) {
      float alpha[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float nm = fmaxf(m_run[r], mx[r]);
        alpha[r] = exp2f(m_run[r] - nm);
        m_run[r] = nm;
        l_part[r] *= alpha[r];
      }
#pragma unroll
      for (int b = 0; b < OUT_BLOCKS; ++b)
#pragma unroll
        for (int e = 0; e < 32; ++e) o[b][e] *= alpha[(e >> 1) & 1];
    }
#pragma unroll
    for (int e = 0; e < 16; ++e) {
      s[e] = exp2f(s[e] - m_run[(e >> 1) & 1]);
      l_part[(e >> 1) & 1] += s[e];
    }
    uint32_t a[TILE / 16][4];  // the A fragments of P: rows 16 ks.. of the tile
#pragma unroll
    for (int ks = 0; ks < TILE / 16; ++ks)
#pragma unroll
      for (int r = 0; r < 4; ++r) a[ks][r] = pack_half2(s[8 * ks + 2 * r], s[8 * ks + 2 * r + 1]);
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < TILE / 16; ++ks) {
#pragma unroll
      for (int b = 0; b < OUT_BLOCKS; ++b) {
        const uint32_t at = tile + 2 * ks * ROW_BLOCK + (wg * OUT_COLS / 8 + 8 * b) * CORE;
        wgmma_output(o[b], a[ks], descriptor(at, ROW_BLOCK, CORE));
      }
    }
    wgmma_commit();
    // Waited here rather than after the next tile's scores are issued: with a product in flight across the
    // loop's back edge ptxas serialises every wgmma of the kernel.
    wgmma_wait_all();
    fence_registers(o[0]);
    fence_registers(o[1]);
    fence_registers(o[2]);
    fence_registers(o[3]);
    mbar_arrive(smem_addr(tile_empty + (i & 1)));  // this thread's products are done with the buffer
  }

  const float l[2] = {sum_over_quad(l_part[0]), sum_over_quad(l_part[1])};
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int h = h0 + 8 * r;
    if (h >= p.num_heads) continue;
    const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
    if (p.num_splits == 1) {
      const long long row_at = n * p.out_stride_n + h * p.out_stride_h + wg * OUT_COLS + 2 * q4;
#pragma unroll
      for (int b = 0; b < OUT_BLOCKS; ++b)
#pragma unroll
        for (int c = 0; c < 8; ++c) {
          const long long at = row_at + 64 * b + 8 * c;
          const float x = o[b][4 * c + 2 * r] * inv, y = o[b][4 * c + 2 * r + 1] * inv;
          if (p.out_bf16) {
            *reinterpret_cast<__nv_bfloat162*>(reinterpret_cast<__nv_bfloat16*>(p.out) + at) =
                __floats2bfloat162_rn(x, y);
          } else {
            *reinterpret_cast<float2*>(reinterpret_cast<float*>(p.out) + at) = make_float2(x, y);
          }
        }
    } else {
      const long long base = (static_cast<long long>(n) * p.num_splits + split) * p.num_heads + h;
      float* dst = p.part + base * DL + wg * OUT_COLS + 2 * q4;
#pragma unroll
      for (int b = 0; b < OUT_BLOCKS; ++b)
#pragma unroll
        for (int c = 0; c < 8; ++c)
          *reinterpret_cast<float2*>(dst + 64 * b + 8 * c) =
              make_float2(o[b][4 * c + 2 * r] * inv, o[b][4 * c + 2 * r + 1] * inv);
      if (wg == 0 && q4 == 0) p.lse[base] = l[r] > 0.f ? m_run[r] + log2f(l[r]) : -INFINITY;
    }
  }
}
