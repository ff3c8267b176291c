// Top-K positions of each row of float32 scores, one thread-block cluster a row (kernels/topk.py's contract:
// the K largest in ascending position order, ties to the smaller position, -0.0 equal to 0.0).
//
// The Triton radix select of kernels/topk.py needs five launches for a row wider than one program, and each
// launch's last arrival scans the row's chunk histograms alone: 52-56 us for one 128K row on an H200
// (bench/NOTES.md). Here a cluster of CTAs shares a row and meets at the cluster barrier, so the whole
// selection is one launch with no global counters:
//  - each thread owns a contiguous span of the row (so thread order is position order); the first pass
//    converts its scores to keys whose unsigned order is the float order and, where the CTA's share fits
//    (TOPK_CACHE_KEYS), keeps them in shared memory for the later passes, else they are read again;
//  - three passes fix the K-th largest key T 12, 10 and 10 bits at a time: every CTA builds a shared-memory
//    histogram of its keys that match the bits fixed so far, by their next digit, and adds its non-empty bins
//    into every CTA's cluster histogram through distributed shared memory; after one cluster barrier each
//    CTA finds the same digit that holds the K-th key (two cluster histograms alternate by pass, so a CTA
//    clearing one never races another's next adds). The indexer's common values, 0.0 (ReLU) and -inf (past a
//    row's length), would make every lane of a warp add to one bin; they are counted once by warp reductions
//    and added to their bin as a whole;
//  - placement: a block scan and the earlier CTAs' totals give each thread how many keys above T and ties
//    lie before its span; it writes its keys above T and its ties among the row's first `need` ties.
// Five cluster barriers (the first overlaps the first pass): no host synchronisation, fixed shapes, so CUDA
// graphs capture it.

#include <cooperative_groups.h>
#include <stdint.h>

namespace cg = cooperative_groups;

#ifndef TOPK_THREADS  // kernels/topk_cuda.py's Variant sets these four
#define TOPK_THREADS 1024
#endif
#ifndef TOPK_CLUSTER
#define TOPK_CLUSTER 8
#endif
#ifndef TOPK_CACHE_KEYS
#define TOPK_CACHE_KEYS 32768
#endif
#ifndef TOPK_SHARED_BYTES
#define TOPK_SHARED_BYTES 180560
#endif

namespace {

constexpr int THREADS = TOPK_THREADS;
constexpr int WARPS = THREADS / 32;
constexpr int CLUSTER = TOPK_CLUSTER;
constexpr int CACHE_KEYS = TOPK_CACHE_KEYS;  // keys a CTA keeps in shared memory
constexpr int BINS = 4096;                   // the widest digit's bins (12 bits)
constexpr int LOADS = 4;                     // groups of four scores a thread has in flight in the first pass
constexpr uint32_t ZERO_KEY = 0x80000000u;   // the key of 0.0 and -0.0
constexpr uint32_t NEG_INF_KEY = 0x007FFFFFu;
static_assert(THREADS % 32 == 0 && THREADS <= 1024 && BINS % THREADS == 0, "bins must spread evenly");
static_assert(CLUSTER >= 1 && CLUSTER <= 8, "a portable cluster holds at most 8 CTAs");
static_assert(CACHE_KEYS % (4 * THREADS) == 0, "the key cache holds whole groups of four a thread");

struct TopKParams {
  const float* scores;
  void* out;            // int64 or int32 [rows, stride_o]
  long long stride_s;   // elements
  long long stride_o;
  int width;
  int k;
  int span;             // scores a thread, a multiple of 4
  int out_int64;
};

struct Shared {
  uint32_t hist[BINS];          // this CTA's counts by digit in the current pass
  uint32_t cluster_hist[2][BINS];  // the cluster's counts, by pass parity
  unsigned long long warp_sums[WARPS];
  uint32_t specials[2];         // this CTA's keys equal to ZERO_KEY, NEG_INF_KEY
  uint32_t found[2];            // the digit holding the K-th key, keys above it
  uint32_t totals[CLUSTER][2];  // keys above T and ties of each earlier CTA (written by that CTA)
};
constexpr int CACHE_OFFSET = (sizeof(Shared) + 15) / 16 * 16;
static_assert(CACHE_OFFSET + 4 * CACHE_KEYS == TOPK_SHARED_BYTES, "kernels/topk_cuda.py sizes shared memory so");

__device__ __forceinline__ uint32_t key_of(float s) {
  uint32_t u = __float_as_uint(s == 0.0f ? 0.0f : s);
  return u ^ ((u >> 31) ? 0xFFFFFFFFu : 0x80000000u);
}

// The keys at positions p..p+3 of a row (past the width: key 0, below every real key).
__device__ __forceinline__ uint4 load4(const float* row, int p, int width) {
  if (p + 3 < width) {
    float4 v = __ldg(reinterpret_cast<const float4*>(row + p));
    return make_uint4(key_of(v.x), key_of(v.y), key_of(v.z), key_of(v.w));
  }
  uint32_t k[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) k[i] = p + i < width ? key_of(__ldg(row + p + i)) : 0u;
  return make_uint4(k[0], k[1], k[2], k[3]);
}

// This thread's keys in position order: f(key, position) for each inside the row. From the shared-memory
// cache (group g of thread t at g * THREADS + t, so a warp's loads never share a bank) or the scores.
struct Span {
  const float* row;
  const uint4* cache;  // null: read the scores
  int start, end, width;

  template <typename F>
  __device__ __forceinline__ void visit(F&& f) const {
    for (int q = start, g = 0; q < end; q += 4, ++g) {
      const uint4 v = cache ? cache[g * THREADS + threadIdx.x] : load4(row, q, width);
      const uint32_t key[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int i = 0; i < 4; ++i)
        if (q + i < end) f(key[i], q + i);
    }
  }
};

// Distributed shared memory by its 32-bit address: `mapa` maps a local shared address to CTA `rank`'s copy,
// and the add and store name the shared::cluster window (generic pointers make the compiler treat them as
// global memory operations).
__device__ __forceinline__ uint32_t remote(const void* local, uint32_t rank) {
  uint32_t mapped;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;"
               : "=r"(mapped) : "r"(static_cast<uint32_t>(__cvta_generic_to_shared(local))), "r"(rank));
  return mapped;
}
__device__ __forceinline__ void remote_add(uint32_t address, uint32_t value) {
  asm volatile("red.relaxed.cluster.shared::cluster.add.u32 [%0], %1;" :: "r"(address), "r"(value) : "memory");
}
__device__ __forceinline__ void remote_store(uint32_t address, uint32_t value) {
  asm volatile("st.shared::cluster.u32 [%0], %1;" :: "r"(address), "r"(value) : "memory");
}

__device__ __forceinline__ void cluster_arrive() {
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() {
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// The largest digit d whose keys, with those of the digits above it, reach `need`, from this CTA's copy of
// the cluster's counts; found[] gets d and the count above it. Clears the counts for their next use.
template <int BINS_NOW>
__device__ __forceinline__ void find_digit(Shared& sh, uint32_t* counts, uint32_t need) {
  constexpr int PER = BINS_NOW >= THREADS ? BINS_NOW / THREADS : 1;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int first = tid * PER;
  const bool owner = first < BINS_NOW;
  uint32_t c[PER], mine = 0;
#pragma unroll
  for (int i = 0; i < PER; ++i) { c[i] = owner ? counts[first + i] : 0u; mine += c[i]; }
  uint32_t suffix = mine;  // this and later lanes of the warp
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    uint32_t t = __shfl_down_sync(0xFFFFFFFFu, suffix, off);
    if (lane + off < 32) suffix += t;
  }
  if (lane == 0) sh.warp_sums[warp] = suffix;
  __syncthreads();
  uint32_t later = lane < WARPS ? static_cast<uint32_t>(sh.warp_sums[lane]) : 0u;  // suffix over warps
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    uint32_t t = __shfl_down_sync(0xFFFFFFFFu, later, off);
    if (lane + off < 32) later += t;
  }
  later = __shfl_sync(0xFFFFFFFFu, later, warp + 1 < 32 ? warp + 1 : 31);
  uint32_t running = suffix - mine + (warp + 1 < WARPS ? later : 0u);  // keys of every later bin
#pragma unroll
  for (int i = PER - 1; i >= 0; --i) {
    if (owner && running < need && running + c[i] >= need) { sh.found[0] = first + i; sh.found[1] = running; }
    running += c[i];
  }
  __syncthreads();  // found is written and every read of counts done
#pragma unroll
  for (int i = 0; i < PER; ++i)
    if (owner) counts[first + i] = 0;
}

// One pass: T's next BITS bits (after FIXED) and the count of matching keys still needed.
template <int FIXED, int BITS>
__device__ __forceinline__ void radix_pass(Shared& sh, const Span& span, uint4* cache, bool cached, int rank,
                                           uint32_t& prefix, uint32_t& need) {
  constexpr int SHIFT = 32 - FIXED - BITS, BINS_NOW = 1 << BITS;
  const int tid = threadIdx.x, lane = tid & 31;
  // Where the prefix lets a special key match, its bin (else -1); it is counted apart, never key by key.
  int special_bin[2] = {-1, -1};
  const uint32_t special_key[2] = {ZERO_KEY, NEG_INF_KEY};
#pragma unroll
  for (int s = 0; s < 2; ++s) {
    if constexpr (FIXED == 0) special_bin[s] = (special_key[s] >> SHIFT) & (BINS_NOW - 1);
    else if ((special_key[s] >> (32 - FIXED)) == prefix) special_bin[s] = (special_key[s] >> SHIFT) & (BINS_NOW - 1);
  }
  if constexpr (FIXED == 0) {  // every key: count the specials, fill the cache
    uint32_t zeros = 0, neg_infs = 0;
    for (int q0 = span.start, g0 = 0; q0 < span.end; q0 += 4 * LOADS, g0 += LOADS) {
      uint4 v[LOADS];  // LOADS groups in flight before any is used: the first read comes from L2 or HBM
#pragma unroll
      for (int j = 0; j < LOADS; ++j) v[j] = q0 + 4 * j < span.end ? load4(span.row, q0 + 4 * j, span.width) : uint4{};
#pragma unroll
      for (int j = 0; j < LOADS; ++j) {
        const int q = q0 + 4 * j;
        if (q >= span.end) break;
        if (cached) cache[(g0 + j) * THREADS + tid] = v[j];
        const uint32_t key[4] = {v[j].x, v[j].y, v[j].z, v[j].w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          if (q + i >= span.end) continue;
          zeros += key[i] == ZERO_KEY;
          neg_infs += key[i] == NEG_INF_KEY;
          if (key[i] != ZERO_KEY && key[i] != NEG_INF_KEY) atomicAdd(&sh.hist[key[i] >> SHIFT], 1u);
        }
      }
    }
    zeros = __reduce_add_sync(0xFFFFFFFFu, zeros);
    neg_infs = __reduce_add_sync(0xFFFFFFFFu, neg_infs);
    if (lane == 0) { atomicAdd(&sh.specials[0], zeros); atomicAdd(&sh.specials[1], neg_infs); }
  } else if (special_bin[0] >= 0 || special_bin[1] >= 0) {
    span.visit([&](uint32_t key, int) {
      if (key != ZERO_KEY && key != NEG_INF_KEY && (key >> (32 - FIXED)) == prefix)
        atomicAdd(&sh.hist[(key >> SHIFT) & (BINS_NOW - 1)], 1u);
    });
  } else {
    span.visit([&](uint32_t key, int) {
      if ((key >> (32 - FIXED)) == prefix) atomicAdd(&sh.hist[(key >> SHIFT) & (BINS_NOW - 1)], 1u);
    });
  }
  __syncthreads();
  if constexpr (FIXED == 0) cluster_wait();  // the arrival after clearing: every CTA runs, counts cleared
  uint32_t* counts = sh.cluster_hist[(FIXED == 0 || FIXED > 12) ? 0 : 1];  // alternate by pass
#pragma unroll
  for (int j = 0; j < (BINS_NOW + THREADS - 1) / THREADS; ++j) {
    const int b = tid + j * THREADS;
    if (BINS_NOW % THREADS != 0 && b >= BINS_NOW) break;
    const uint32_t count = sh.hist[b] + (b == special_bin[0] ? sh.specials[0] : 0u)
                           + (b == special_bin[1] ? sh.specials[1] : 0u);
    if (count)
      for (int i = 0; i < CLUSTER; ++i)  // every CTA's copy, each thread starting at another
        remote_add(remote(counts + b, (rank + i) % CLUSTER), count);
    sh.hist[b] = 0;
  }
  cluster_arrive();
  cluster_wait();  // every CTA's counts are in this CTA's copy
  find_digit<BINS_NOW>(sh, counts, need);
  prefix = (prefix << BITS) | sh.found[0];
  need -= sh.found[1];
}

}  // namespace

extern "C" __global__ void __cluster_dims__(TOPK_CLUSTER, 1, 1) __launch_bounds__(TOPK_THREADS, 1)
topk_cluster(const TopKParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  Shared& sh = *reinterpret_cast<Shared*>(smem);
  uint4* cache = reinterpret_cast<uint4*>(smem + CACHE_OFFSET);
  const int rank = static_cast<int>(cg::this_cluster().block_rank());
  const int tid = threadIdx.x, lane = tid & 31;
  const bool cached = p.span * THREADS <= CACHE_KEYS;
  const int start = (rank * THREADS + tid) * p.span;
  const Span span{p.scores + static_cast<long long>(blockIdx.y) * p.stride_s, cached ? cache : nullptr,
                  start, min(start + p.span, p.width), p.width};

  for (int b = tid; b < BINS; b += THREADS) { sh.hist[b] = 0; sh.cluster_hist[0][b] = 0; sh.cluster_hist[1][b] = 0; }
  if (tid < 2) sh.specials[tid] = 0;
  __syncthreads();
  cluster_arrive();  // waited for before the first remote add: every CTA runs, its counts cleared

  uint32_t prefix = 0, need = static_cast<uint32_t>(p.k);
  radix_pass<0, 12>(sh, span, cache, cached, rank, prefix, need);
  radix_pass<12, 10>(sh, span, cache, cached, rank, prefix, need);
  radix_pass<22, 10>(sh, span, cache, cached, rank, prefix, need);

  // Placement: T = prefix; keys above T all go, ties only the row's first `need`.
  const uint32_t kth = prefix;
  uint32_t above = 0, ties = 0;
  span.visit([&](uint32_t key, int) { above += key > kth; ties += key == kth; });
  // Block exclusive scan of (above, ties) packed as two 32-bit halves.
  const unsigned long long mine = above | (static_cast<unsigned long long>(ties) << 32);
  unsigned long long incl = mine;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    unsigned long long t = __shfl_up_sync(0xFFFFFFFFu, incl, off);
    if (lane >= off) incl += t;
  }
  const int warp = tid >> 5;
  if (lane == 31) sh.warp_sums[warp] = incl;
  __syncthreads();
  unsigned long long earlier = lane < warp ? sh.warp_sums[lane] : 0ull;  // the earlier warps' totals
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) earlier += __shfl_xor_sync(0xFFFFFFFFu, earlier, off);
  const unsigned long long before = incl - mine + earlier;
  if (tid == THREADS - 1) {  // this CTA's totals, to every later CTA
    for (int r = rank + 1; r < CLUSTER; ++r) {
      remote_store(remote(&sh.totals[rank][0], r), static_cast<uint32_t>(before + mine));
      remote_store(remote(&sh.totals[rank][1], r), static_cast<uint32_t>((before + mine) >> 32));
    }
  }
  cluster_arrive();
  cluster_wait();  // no shared memory of another CTA is touched after this
  uint32_t above_before = static_cast<uint32_t>(before), ties_before = static_cast<uint32_t>(before >> 32);
  for (int r = 0; r < rank; ++r) { above_before += sh.totals[r][0]; ties_before += sh.totals[r][1]; }
  if (above == 0 && (ties == 0 || ties_before >= need)) return;
  long long* out64 = static_cast<long long*>(p.out) + static_cast<long long>(blockIdx.y) * p.stride_o;
  int* out32 = static_cast<int*>(p.out) + static_cast<long long>(blockIdx.y) * p.stride_o;
  span.visit([&](uint32_t key, int pos) {
    int place = -1;
    if (key > kth) {
      place = above_before + min(ties_before, need);
      ++above_before;
    } else if (key == kth) {
      if (ties_before < need) place = above_before + ties_before;
      ++ties_before;
    }
    if (place >= 0) {
      if (p.out_int64) out64[place] = pos;
      else out32[place] = pos;
    }
  });
}
