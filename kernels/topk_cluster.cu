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
//    and added to their bin as a whole. The first pass reads the CTA's share coalesced (a warp's loads
//    are 512 contiguous bytes) and stores each group of four keys where its thread's later visits read it;
//  - after the first pass, where the row's keys at or above T's first digit fit a list (TOPK_LIST_CAP: fewer
//    than K above it, and the usual K-th key's 12-bit bin holds a small share of the row) and a thread's span
//    of 16 to 128 keys fits a 128-bit mask, one more read of the share lists their positions (in any order,
//    one atomic a warp); the last two passes read only the list, and the list's keys above T and ties set bits
//    in their thread's masks.
//    Otherwise (many equal keys, short or very wide rows) the passes and the counts visit every key again;
//  - placement: a block scan and the earlier CTAs' totals give each thread how many keys above T and ties
//    lie before its span; it writes its keys above T and its ties among the row's first `need` ties, from its
//    masks in bit order, or visiting its keys in position order.
// Visits skip a group of four keys whose largest cannot matter. Five cluster barriers (the first overlaps the
// first pass): no host synchronisation, fixed shapes, so CUDA graphs capture it.

#include <cooperative_groups.h>
#include <stdint.h>

namespace cg = cooperative_groups;

#ifndef TOPK_THREADS  // kernels/topk_cuda.py's Variant sets these five
#define TOPK_THREADS 1024
#endif
#ifndef TOPK_CLUSTER
#define TOPK_CLUSTER 8
#endif
#ifndef TOPK_CACHE_KEYS
#define TOPK_CACHE_KEYS 32768
#endif
#ifndef TOPK_LIST_CAP
#define TOPK_LIST_CAP 8192
#endif
#ifndef TOPK_SHARED_BYTES
#define TOPK_SHARED_BYTES 213344
#endif

namespace {

constexpr int THREADS = TOPK_THREADS;
constexpr int WARPS = THREADS / 32;
constexpr int CLUSTER = TOPK_CLUSTER;
constexpr int CACHE_KEYS = TOPK_CACHE_KEYS;  // keys a CTA keeps in shared memory
constexpr int LIST_CAP = TOPK_LIST_CAP;      // positions of keys at or above T's first digit a CTA can list
constexpr int BINS = 4096;                   // the widest digit's bins (12 bits)
constexpr int LOADS = 4;                     // groups of four scores a thread has in flight in the first pass
constexpr uint32_t ZERO_KEY = 0x80000000u;   // the key of 0.0 and -0.0
constexpr uint32_t NEG_INF_KEY = 0x007FFFFFu;
static_assert(THREADS % 32 == 0 && THREADS <= 1024 && BINS % THREADS == 0, "bins must spread evenly");
static_assert(CLUSTER >= 1 && CLUSTER <= 8, "a portable cluster holds at most 8 CTAs");
static_assert(CACHE_KEYS % (4 * THREADS) == 0, "the key cache holds whole groups of four a thread");
constexpr int MASK_BITS = 128;              // a span's keys a thread's masks cover
constexpr int LIST_MIN_SPAN = 16;            // shorter spans: the visits the list saves cost less than listing
static_assert(4 * THREADS * 8 <= 2 * BINS * 4, "the masks of keys above T and ties fit the cluster histograms");

struct TopKParams {
  const float* scores;
  void* out;            // int64 or int32 [rows, stride_o]
  long long stride_s;   // elements
  long long stride_o;
  int width;
  int k;
  int span;             // scores a thread, a multiple of 4
  int out_int64;
  const int* limits;    // [rows] or null: positions at or past a row's limit are written as 0
};

struct Shared {
  uint32_t hist[BINS];             // this CTA's counts by digit in the current pass
  uint32_t cluster_hist[2][BINS];  // the cluster's counts, by pass parity
  unsigned long long warp_sums[WARPS];
  uint32_t specials[2];         // this CTA's keys equal to ZERO_KEY, NEG_INF_KEY
  uint32_t found[3];            // the digit holding the K-th key, the row's keys above it and in it
  uint32_t listed;              // positions in this CTA's list
  uint32_t totals[CLUSTER][2];  // keys above T and ties of each earlier CTA (written by that CTA)
};
constexpr int CACHE_OFFSET = (sizeof(Shared) + 15) / 16 * 16;
constexpr int LIST_OFFSET = CACHE_OFFSET + 4 * CACHE_KEYS;
static_assert(LIST_OFFSET + 4 * LIST_CAP == TOPK_SHARED_BYTES, "kernels/topk_cuda.py sizes shared memory so");

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

// This thread's keys in position order: f(key, position) for each inside the row whose group of four has a
// key at or above `least` (a group wholly below it cannot matter to the caller). From the shared-memory cache
// (group g of thread t at g * THREADS + t, so a warp's loads never share a bank) or the scores.
struct Span {
  const float* row;
  const uint4* cache;  // null: read the scores
  int start, end, width, span, first;  // first: the CTA's first position (its thread 0's start)

  template <typename F>
  __device__ __forceinline__ void visit(uint32_t least, F&& f) const {
    for (int q = start, g = 0; q < end; q += 4, ++g) visit_group(q, g * THREADS + threadIdx.x, end, least, f);
  }

  // f(key, position) for every key of the CTA's share in a group of four whose largest is at or above `least`,
  // each thread reading its part in any order: its own groups from the cache, else every THREADS-th group of
  // the share (coalesced).
  template <typename F>
  __device__ __forceinline__ void visit_share(uint32_t least, F&& f) const {
    for (int j = 0; j < span / 4; ++j) {
      const int q = cache ? start + 4 * j : first + 4 * (j * THREADS + static_cast<int>(threadIdx.x));
      if (q < width) visit_group(q, j * THREADS + threadIdx.x, width, least, f);
    }
  }

  // f for each key before `limit` of the group at position q (cache slot `slot`), unless all are below `least`.
  template <typename F>
  __device__ __forceinline__ void visit_group(int q, int slot, int limit, uint32_t least, F&& f) const {
    const uint4 v = cache ? cache[slot] : load4(row, q, width);
    if (max(max(v.x, v.y), max(v.z, v.w)) < least) return;
    const uint32_t key[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i)
      if (q + i < limit) f(key[i], q + i);
  }

  // The thread of this CTA whose span holds position `pos`, and the key there.
  __device__ __forceinline__ int owner(int pos) const { return (pos - first) / span; }
  __device__ __forceinline__ uint32_t key_at(int pos) const {
    if (!cache) return key_of(__ldg(row + pos));
    const int t = owner(pos), j = pos - first - t * span;
    return reinterpret_cast<const uint32_t*>(cache)[((j >> 2) * THREADS + t) * 4 + (j & 3)];
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
// the cluster's counts; found[] gets d, the count above it and its own. Clears the counts for their next use.
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
    if (owner && running < need && running + c[i] >= need) {
      sh.found[0] = first + i;
      sh.found[1] = running;
      sh.found[2] = c[i];
    }
    running += c[i];
  }
  __syncthreads();  // found is written and every read of counts done
#pragma unroll
  for (int i = 0; i < PER; ++i)
    if (owner) counts[first + i] = 0;
}

// Adds this CTA's counts of the pass (its histograms, and the special keys' counts into their bins where the
// pass can see them: `special_bin` -1 where not) into every CTA's cluster histogram, clearing its own; waits at
// the cluster barrier; fixes T's next BITS bits (after FIXED) and the count of matching keys still needed.
template <int FIXED, int BITS>
__device__ __forceinline__ void merge_and_find(Shared& sh, int rank, const int (&special_bin)[2], uint32_t& prefix,
                                               uint32_t& need) {
  constexpr int BINS_NOW = 1 << BITS;
  const int tid = threadIdx.x;
  __syncthreads();
  if constexpr (FIXED == 0) cluster_wait();  // the arrival after clearing: every CTA runs, counts cleared
  uint32_t* counts = sh.cluster_hist[(FIXED == 0 || FIXED > 12) ? 0 : 1];  // alternate by pass
#pragma unroll
  for (int j = 0; j < (BINS_NOW + THREADS - 1) / THREADS; ++j) {
    const int b = tid + j * THREADS;
    if (BINS_NOW % THREADS != 0 && b >= BINS_NOW) break;
    const uint32_t count = sh.hist[b] + (b == special_bin[0] ? sh.specials[0] : 0u)
                           + (b == special_bin[1] ? sh.specials[1] : 0u);
    sh.hist[b] = 0;
    if (count)
      for (int i = 0; i < CLUSTER; ++i)  // every CTA's copy, each thread starting at another
        remote_add(remote(counts + b, (rank + i) % CLUSTER), count);
  }
  cluster_arrive();
  cluster_wait();  // every CTA's counts are in this CTA's copy
  find_digit<BINS_NOW>(sh, counts, need);
  prefix = (prefix << BITS) | sh.found[0];
  need -= sh.found[1];
}

// The first pass: every key of the CTA's share, by its first 12 bits (the specials counted apart). The loads
// are coalesced: a thread reads every THREADS-th group of four of the share, not its own span, and stores each
// group into the cache slot of the thread whose span holds it.
__device__ __forceinline__ void first_pass(Shared& sh, const Span& span, uint4* cache, bool cached, int rank,
                                           uint32_t& prefix, uint32_t& need) {
  constexpr int SHIFT = 20;
  const int tid = threadIdx.x, lane = tid & 31;
  const int groups = span.span / 4;  // a thread's groups
  uint32_t zeros = 0, neg_infs = 0;
  for (int g0 = 0; g0 < groups; g0 += LOADS) {
    uint4 v[LOADS];  // LOADS groups in flight before any is used: the first read comes from L2 or HBM
#pragma unroll
    for (int j = 0; j < LOADS; ++j) {
      const int q = span.first + 4 * ((g0 + j) * THREADS + tid);
      v[j] = g0 + j < groups && q < span.width ? load4(span.row, q, span.width) : uint4{};
    }
#pragma unroll
    for (int j = 0; j < LOADS; ++j) {
      if (g0 + j >= groups) break;
      const int group = (g0 + j) * THREADS + tid, q = span.first + 4 * group;
      if (cached) {
        const int owner = group / groups;
        cache[(group - owner * groups) * THREADS + owner] = v[j];
      }
      const uint32_t key[4] = {v[j].x, v[j].y, v[j].z, v[j].w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        if (q + i >= span.width) continue;
        zeros += key[i] == ZERO_KEY;
        neg_infs += key[i] == NEG_INF_KEY;
        if (key[i] != ZERO_KEY && key[i] != NEG_INF_KEY) atomicAdd(&sh.hist[key[i] >> SHIFT], 1u);
      }
    }
  }
  zeros = __reduce_add_sync(0xFFFFFFFFu, zeros);
  neg_infs = __reduce_add_sync(0xFFFFFFFFu, neg_infs);
  if (lane == 0) { atomicAdd(&sh.specials[0], zeros); atomicAdd(&sh.specials[1], neg_infs); }
  const int special_bin[2] = {static_cast<int>(ZERO_KEY >> SHIFT), static_cast<int>(NEG_INF_KEY >> SHIFT)};
  merge_and_find<0, 12>(sh, rank, special_bin, prefix, need);
}

// A later pass over every key of the span: those matching the bits fixed so far, by their next digit.
template <int FIXED, int BITS>
__device__ __forceinline__ void span_pass(Shared& sh, const Span& span, int rank, uint32_t& prefix, uint32_t& need) {
  constexpr int SHIFT = 32 - FIXED - BITS, BINS_NOW = 1 << BITS;
  // Where the prefix lets a special key match, its bin (else -1); it is counted apart, never key by key.
  int special_bin[2] = {-1, -1};
  const uint32_t special_key[2] = {ZERO_KEY, NEG_INF_KEY};
#pragma unroll
  for (int s = 0; s < 2; ++s)
    if ((special_key[s] >> (32 - FIXED)) == prefix) special_bin[s] = (special_key[s] >> SHIFT) & (BINS_NOW - 1);
  const uint32_t least = prefix << (32 - FIXED);  // a smaller key cannot match
  const bool skip_specials = special_bin[0] >= 0 || special_bin[1] >= 0;
  span.visit(least, [&](uint32_t key, int) {
    if ((key >> (32 - FIXED)) == prefix && !(skip_specials && (key == ZERO_KEY || key == NEG_INF_KEY)))
      atomicAdd(&sh.hist[(key >> SHIFT) & (BINS_NOW - 1)], 1u);
  });
  merge_and_find<FIXED, BITS>(sh, rank, special_bin, prefix, need);
}

// A later pass over the listed positions (the specials among them counted like any key).
template <int FIXED, int BITS>
__device__ __forceinline__ void list_pass(Shared& sh, const Span& span, const int* list, int rank, uint32_t& prefix,
                                          uint32_t& need) {
  constexpr int SHIFT = 32 - FIXED - BITS, BINS_NOW = 1 << BITS;
  for (int i = threadIdx.x; i < static_cast<int>(sh.listed); i += THREADS) {
    const uint32_t key = span.key_at(list[i]);
    if ((key >> (32 - FIXED)) == prefix) atomicAdd(&sh.hist[(key >> SHIFT) & (BINS_NOW - 1)], 1u);
  }
  const int no_special[2] = {-1, -1};
  merge_and_find<FIXED, BITS>(sh, rank, no_special, prefix, need);
}

}  // namespace

extern "C" __global__ void __cluster_dims__(TOPK_CLUSTER, 1, 1) __launch_bounds__(TOPK_THREADS, 1)
topk_cluster(const TopKParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  Shared& sh = *reinterpret_cast<Shared*>(smem);
  uint4* cache = reinterpret_cast<uint4*>(smem + CACHE_OFFSET);
  int* list = reinterpret_cast<int*>(smem + LIST_OFFSET);
  const int rank = static_cast<int>(cg::this_cluster().block_rank());
  const int tid = threadIdx.x, lane = tid & 31;
  const bool cached = p.span * THREADS <= CACHE_KEYS;
  const int first = rank * THREADS * p.span, start = first + tid * p.span;
  const Span span{p.scores + static_cast<long long>(blockIdx.y) * p.stride_s, cached ? cache : nullptr,
                  start, min(start + p.span, p.width), p.width, p.span, first};

  for (int b = tid; b < BINS; b += THREADS) { sh.hist[b] = 0; sh.cluster_hist[0][b] = 0; sh.cluster_hist[1][b] = 0; }
  if (tid < 2) sh.specials[tid] = 0;
  if (tid == 0) sh.listed = 0;
  __syncthreads();
  cluster_arrive();  // waited for before the first remote add: every CTA runs, its counts cleared

  uint32_t prefix = 0, need = static_cast<uint32_t>(p.k);
  first_pass(sh, span, cache, cached, rank, prefix, need);
  uint32_t above = 0, ties = 0;  // this thread's keys above T and equal to it
  // The same choice in every CTA: found[] holds the row's counts.
  const bool listed = p.span >= LIST_MIN_SPAN && p.span <= MASK_BITS && sh.found[1] + sh.found[2] <= LIST_CAP;
  unsigned long long* above_mask = reinterpret_cast<unsigned long long*>(sh.cluster_hist);  // [THREADS][2]
  unsigned long long* tie_mask = above_mask + 2 * THREADS;
  if (listed) {
    span.visit_share(prefix << 20, [&](uint32_t key, int pos) {
      if (key >> 20 >= prefix) {  // one atomic for the lanes listing together
        const cg::coalesced_group lanes = cg::coalesced_threads();
        uint32_t at = 0;
        if (lanes.thread_rank() == 0) at = atomicAdd(&sh.listed, lanes.size());
        list[lanes.shfl(at, 0) + lanes.thread_rank()] = pos;
      }
    });
    __syncthreads();
    list_pass<12, 10>(sh, span, list, rank, prefix, need);
    list_pass<22, 10>(sh, span, list, rank, prefix, need);
    __syncthreads();  // every clear of the cluster histograms done: they hold the masks now
    for (int i = tid; i < static_cast<int>(sh.listed); i += THREADS) {
      const int pos = list[i], owner = span.owner(pos), bit = pos - first - owner * p.span;
      const uint32_t key = span.key_at(pos);
      if (key >= prefix)
        atomicOr(&(key > prefix ? above_mask : tie_mask)[2 * owner + (bit >> 6)], 1ull << (bit & 63));
    }
    __syncthreads();
#pragma unroll
    for (int w = 0; w < 2; ++w) {
      above += __popcll(above_mask[2 * tid + w]);
      ties += __popcll(tie_mask[2 * tid + w]);
    }
  } else {
    span_pass<12, 10>(sh, span, rank, prefix, need);
    span_pass<22, 10>(sh, span, rank, prefix, need);
    span.visit(prefix, [&](uint32_t key, int) { above += key > prefix; ties += key == prefix; });
  }

  // Placement: T = prefix; keys above T all go, ties only the row's first `need`.
  const uint32_t kth = prefix;
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
  const int limit = p.limits != nullptr ? p.limits[blockIdx.y] : p.width;
  const auto place = [&](bool is_above, int pos) {
    int at = -1;
    if (is_above) {
      at = above_before + min(ties_before, need);
      ++above_before;
    } else {
      if (ties_before < need) at = above_before + ties_before;
      ++ties_before;
    }
    if (at >= 0) {
      const int value = pos < limit ? pos : 0;
      if (p.out_int64) out64[at] = value;
      else out32[at] = value;
    }
  };
  if (listed) {
#pragma unroll
    for (int w = 0; w < 2; ++w) {
      const unsigned long long a = above_mask[2 * tid + w];
      for (unsigned long long m = a | tie_mask[2 * tid + w]; m; m &= m - 1) {
        const int bit = __ffsll(static_cast<long long>(m)) - 1;
        place((a >> bit) & 1, start + 64 * w + bit);
      }
    }
  } else {
    span.visit(kth, [&](uint32_t key, int pos) {
      if (key >= kth) place(key > kth, pos);
    });
  }
}
