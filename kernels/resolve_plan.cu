// The resolve plan of one IndexShare group, one CTA a request (kernels/resolve.py's contract: top-K positions ->
// KV slots; hot hits stamped; misses take the least recently used hot slots not used this step, empty slots
// first, then ascending stamp, ties by slot index, the victims in slot order going to the misses in top-K
// order; the reverse map, the slots' positions and stamps updated in place; a compacted copy list).
//
// The Triton plan spends its time in the order of its phases, not in bytes: at B = 100 with 1 % misses it
// took 14.1 us against 6.6 us without misses (bench/NOTES.md), its victims going to the misses through global
// memory and every block-wide sum a Triton reduction. Here the phases meet at a few `__syncthreads`:
//  - each thread owns SLOTS contiguous hot slots (their positions, stamps and physical slots loaded first,
//    while the top-K chain of loads runs) and TOPK_PER_THREAD contiguous top-K entries (so thread order is
//    top-K order and slot order);
//  - classification: the top-K position -> its page's GPU slot -> the reverse map; a hit stamps its slot in
//    global memory and sets the slot's bit in shared memory (the keys held in registers were loaded before);
//  - one block scan gives each miss its rank and, with it, the candidates' count and smallest and largest key
//    (key: -1 for an empty slot, else the stamp; candidates: keys below the step);
//  - the threshold T, the smallest key with `served` candidates at or below it, by rounds of PROBES probes
//    (the first round just above the smallest key, where a step's victims are), each round one warp
//    reduction a probe and one barrier;
//  - one block scan of the keys below T and at T ranks the victims in slot order into shared memory; each
//    miss reads its victim there.
// Slots past THREADS x SLOTS (a hot buffer larger than the default 4,096) are read from global memory at each
// pass, after the hits' stamps are visible. No host synchronisation, fixed shapes: CUDA graphs capture it.

#include <stdint.h>

#ifndef PLAN_THREADS  // kernels/resolve_cuda.py sets these
#define PLAN_THREADS 512
#endif
#ifndef PLAN_SHARED_BYTES
#define PLAN_SHARED_BYTES 114688
#endif

namespace {

constexpr int THREADS = PLAN_THREADS;
constexpr int WARPS = THREADS / 32;
constexpr int SLOTS = 8;                     // hot slots a thread keeps in registers
constexpr int CACHED = THREADS * SLOTS;      // slots held in registers; the rest are read again each pass
constexpr int TOPK_PER_THREAD = 8;           // top-K entries a thread classifies
constexpr int MAX_K = THREADS * TOPK_PER_THREAD;
constexpr int GROUPS = SLOTS * WARPS;        // a warp's 32 slots (or top-K entries) of one row: the scan's unit
constexpr int GROUPS_PER_LANE = GROUPS / 32;
constexpr int PROBES = 8;                    // thresholds counted a search round
constexpr unsigned FULL = 0xffffffffu;
static_assert(THREADS == 512 && SLOTS == TOPK_PER_THREAD, "a lane scans four groups, slots and top-K alike");
static_assert(GROUPS_PER_LANE == 4 && WARPS * PROBES == 4 * 32, "a lane reads one int4 of the probe counts");
static_assert(4 * (2 * CACHED + 5 * MAX_K) <= PLAN_SHARED_BYTES, "the tables fit the dynamic shared memory");

struct PlanParams {
  const int* topk;             // [B, K] token positions
  const int* counts;           // [B] valid entries of a row
  const int* gpu_page;         // [B, max_pages] GPU page of each logical page, negative when host-only
  const int* host_page;        // [B, max_pages] host page of each logical page
  const long long* lease;      // [B, 6] addresses of hot slots, positions, stamps, reverse map; R; capacity
  const void* step;            // [1] the stamp dtype
  int* kv;                     // [B, K] physical slot of each entry, -1 past count or unserved
  int* num_copied;             // [B]
  int* copy_src;               // [B, K] host slot of the m-th miss
  int* copy_dst;               // [B, K] hot slot of the m-th miss
  long long max_pages;
  int k;
  int page_shift;
};

struct Shared {
  unsigned hit_bits[CACHED / 32];            // slots hit this step, among those held in registers
  __align__(16) int group_sums[2][GROUPS];   // per-group counts of a scan (two scans alternate)
  __align__(16) int probe_counts[2][WARPS][PROBES];  // search rounds alternate
  int num_cand;                              // the candidates' count and key bounds, by one atomic a warp
  long long lo;
  long long hi;
};

// Thread tid holds row i of its entries at i * THREADS + tid (loads and stores coalesced); a group is the 32
// entries of one row a warp holds, and groups in order (i * WARPS + warp) are entries in order.
__device__ __forceinline__ int group_of(int i, int warp) { return i * WARPS + warp; }

__device__ __forceinline__ long long warp_min_ll(long long v) {
  for (int o = 16; o > 0; o >>= 1) v = min(v, __shfl_xor_sync(FULL, v, o));
  return v;
}

__device__ __forceinline__ long long warp_max_ll(long long v) {
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(FULL, v, o));
  return v;
}

// Exclusive prefix sums of the GROUPS group counts in `sums` (after a barrier), every warp for itself:
// `before[i]` for this warp's group of row i, and the total. Packed counts add field by field.
__device__ __forceinline__ int group_prefix(const int* sums, int lane, int warp, int before[SLOTS]) {
  const int4 mine = reinterpret_cast<const int4*>(sums)[lane];  // groups 4 lane .. 4 lane + 3
  const int e0 = 0, e1 = mine.x, e2 = e1 + mine.y, e3 = e2 + mine.z, lane_sum = e3 + mine.w;
  int incl = lane_sum;
  for (int o = 1; o < 32; o <<= 1) {
    const int up = __shfl_up_sync(FULL, incl, o);
    if (lane >= o) incl += up;
  }
  const int lane_before = incl - lane_sum;
  const int pick = warp & 3;  // this warp's groups sit at the same place in their lanes' four
  const int within = pick == 0 ? e0 : pick == 1 ? e1 : pick == 2 ? e2 : e3;
#pragma unroll
  for (int i = 0; i < SLOTS; ++i) {
    const int g = group_of(i, warp);
    before[i] = __shfl_sync(FULL, lane_before + within, g >> 2);
  }
  return __shfl_sync(FULL, incl, 31);
}

// A 4-byte copy global -> shared memory that does not hold a register while in flight.
__device__ __forceinline__ void copy_async(int* dst, const int* src) {
  const unsigned to = (unsigned)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(to), "l"(src) : "memory");
}

// A slot's key in the victim search: its LRU key (-1 for an empty slot, else its stamp) less `base`, or NONE
// (above every probe) for a slot that is not a candidate (past R, or used this step).
template <typename Key>
__device__ __forceinline__ Key search_key(long long key, bool in_buffer, long long step, long long base) {
  constexpr Key NONE = sizeof(Key) == 4 ? (Key)0x7fffffff : (Key)0x7fffffffffffffffLL;
  return in_buffer && key < step ? (Key)(key - base) : NONE;
}

// One chunk of slots past those kept in registers, read from global memory (after a barrier that made this
// step's hit stamps visible): the positions they hold and their search keys.
template <typename Key, typename Stamp>
__device__ __forceinline__ void load_chunk(const int* held_row, const Stamp* stamp_row, int c0, int R, int tid,
                                           long long step, long long base, int held[SLOTS], Key key[SLOTS]) {
#pragma unroll
  for (int s = 0; s < SLOTS; ++s) {
    const int r = c0 + s * THREADS + tid;
    held[s] = r < R ? __ldcg(&held_row[r]) : -1;
    const long long lru = held[s] >= 0 ? (long long)__ldcg(&stamp_row[r]) : -1;
    key[s] = search_key<Key>(lru, r < R, step, base);
  }
}

// Threshold probe w of a round in [lo, hi): lo + 2^w - 1 in the first round, else the w-th of PROBES even splits.
template <typename Key>
__device__ __forceinline__ Key probe_at(Key lo, Key hi, bool first, int w) {
  const long long near = (long long)lo + min((long long)hi - 1 - lo, (1LL << w) - 1);
  const unsigned long long span = (unsigned long long)((long long)hi - lo);
  const long long even = lo + (long long)(span / (PROBES + 1) * (w + 1) + span % (PROBES + 1) * (w + 1) / (PROBES + 1));
  return (Key)(first ? near : even);
}

template <typename Key>
__device__ __forceinline__ void count_probes(const Key key[SLOTS], const Key probe[PROBES], int n[PROBES]) {
#pragma unroll
  for (int s = 0; s < SLOTS; ++s) {
#pragma unroll
    for (int w = 0; w < PROBES; ++w) n[w] += key[s] <= probe[w];
  }
}

// The `served` victims: the threshold T, the smallest key with `served` candidates at or below it, by rounds of
// PROBES probes; then the victims in slot order (keys below T, then the first `quota` keyed T) into the lists,
// through one scan of packed counts a chunk. Keys are `Key` (32-bit relative to the smallest where they fit).
template <typename Key, typename Stamp>
__device__ void choose_victims(Shared& sh, const long long key[SLOTS], long long lo64, long long hi64, long long step,
                               int served, int R, const int* held_row, const Stamp* stamp_row, const int* hot_row,
                               const int* held_s, const int* hot_s, int* v_slot, int* v_old, int* v_hot) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const unsigned lanes_before = (1u << lane) - 1;
  // T: the smallest key with `served` candidates at or below it; `below` candidates lie under lo
  const long long base = sizeof(Key) == 4 ? lo64 : 0;
  Key mine[SLOTS];
#pragma unroll
  for (int s = 0; s < SLOTS; ++s) mine[s] = search_key<Key>(key[s], s * THREADS + tid < R, step, base);
  Key lo = (Key)(lo64 - base), hi = (Key)(hi64 - base);
  int below = 0;
  bool first_round = true;
  int buf = 0;
  while (lo < hi) {
    Key probe[PROBES];
    int n[PROBES];
#pragma unroll
    for (int w = 0; w < PROBES; ++w) {
      probe[w] = probe_at<Key>(lo, hi, first_round, w);
      n[w] = 0;
    }
    count_probes<Key>(mine, probe, n);
    for (int c0 = CACHED; c0 < R; c0 += CACHED) {
      int held_x[SLOTS];
      Key key_x[SLOTS];
      load_chunk<Key>(held_row, stamp_row, c0, R, tid, step, base, held_x, key_x);
      count_probes<Key>(key_x, probe, n);
    }
#pragma unroll
    for (int w = 0; w < PROBES; ++w) {
      const int total = __reduce_add_sync(FULL, n[w]);
      if (lane == w) sh.probe_counts[buf][warp][w] = total;
    }
    __syncthreads();
    // lane l sums probes 4 (l & 1) .. + 3 of warp l / 2; lanes of the same parity add up
    int4 c = reinterpret_cast<const int4*>(&sh.probe_counts[buf][0][0])[lane];
    for (int o = 2; o < 32; o <<= 1) {
      c.x += __shfl_xor_sync(FULL, c.x, o);
      c.y += __shfl_xor_sync(FULL, c.y, o);
      c.z += __shfl_xor_sync(FULL, c.z, o);
      c.w += __shfl_xor_sync(FULL, c.w, o);
    }
    Key new_lo = lo, new_hi = hi;
    int new_below = below;
#pragma unroll
    for (int w = 0; w < PROBES; ++w) {
      const int q = (w & 3) == 0 ? c.x : (w & 3) == 1 ? c.y : (w & 3) == 2 ? c.z : c.w;
      const int total = __shfl_sync(FULL, q, w >> 2);
      if (total >= served) {
        new_hi = min(new_hi, probe[w]);
      } else {
        new_lo = max(new_lo, probe[w] + 1);
        new_below = max(new_below, total);
      }
    }
    lo = new_lo;
    hi = new_hi;
    below = new_below;
    first_round = false;
    buf ^= 1;
  }
  const Key T = lo;
  const int quota = served - below;  // candidates keyed T that are victims, lowest slot first

  // victims in slot order: keys below T, then the first `quota` keyed T; one scan of packed counts a chunk
  int num_below = 0, num_at = 0;
  buf = 1;
  for (int c0 = 0; c0 < R; c0 += CACHED) {
    int held_x[SLOTS];
    Key key_x[SLOTS];
    if (c0 == 0) {
#pragma unroll
      for (int s = 0; s < SLOTS; ++s) key_x[s] = mine[s];
    } else {
      load_chunk<Key>(held_row, stamp_row, c0, R, tid, step, base, held_x, key_x);
    }
    unsigned below_ballot[SLOTS], at_ballot[SLOTS];
#pragma unroll
    for (int s = 0; s < SLOTS; ++s) {
      below_ballot[s] = __ballot_sync(FULL, key_x[s] < T);
      at_ballot[s] = __ballot_sync(FULL, key_x[s] == T);  // never a non-candidate's key
      if (lane == 0)  // a chunk has fewer than 2^16 slots
        sh.group_sums[buf][group_of(s, warp)] = __popc(below_ballot[s]) | __popc(at_ballot[s]) << 16;
    }
    __syncthreads();
    int before[SLOTS];
    const int chunk_total = group_prefix(sh.group_sums[buf], lane, warp, before);
#pragma unroll
    for (int s = 0; s < SLOTS; ++s) {
      const bool is_below = below_ballot[s] >> lane & 1, is_at = at_ballot[s] >> lane & 1;
      if (!is_below && !is_at) continue;
      const int below_upto = num_below + (before[s] & 0xFFFF) + __popc(below_ballot[s] & lanes_before)
                             + is_below;
      const int at_upto = num_at + (before[s] >> 16) + __popc(at_ballot[s] & lanes_before) + is_at;
      const int rank = below_upto + min(at_upto, quota) - 1;
      if ((is_below || at_upto <= quota) && rank < served) {
        const int r = c0 + s * THREADS + tid;
        v_slot[rank] = r;
        v_old[rank] = c0 == 0 ? held_s[r] : held_x[s];
        v_hot[rank] = c0 == 0 ? hot_s[r] : __ldcg(&hot_row[r]);
      }
    }
    num_below += chunk_total & 0xFFFF;
    num_at += chunk_total >> 16;
    buf ^= 1;
  }
  __syncthreads();  // the victim lists are complete
}

template <typename Stamp, typename Map>
__device__ void plan(const PlanParams& p, Shared& sh, int* held_s, int* hot_s, int* miss_pos_s, int* miss_host_s,
                     int* v_slot, int* v_old, int* v_hot) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const unsigned lanes_before = (1u << lane) - 1;
  const long long b = blockIdx.x;
  const long long* lease = p.lease + b * 6;
  const int* hot_row = reinterpret_cast<const int*>(lease[0]);
  int* held_row = reinterpret_cast<int*>(lease[1]);
  Stamp* stamp_row = reinterpret_cast<Stamp*>(lease[2]);
  Map* map_row = reinterpret_cast<Map*>(lease[3]);
  const int R = (int)lease[4];
  const long long step = (long long)*reinterpret_cast<const Stamp*>(p.step);
  const int K = p.k;
  const int mask = (1 << p.page_shift) - 1;

  // the head of the longest chain first: this thread's top-K positions (the row has K, whatever its count)
  const int* topk_row = p.topk + b * K;
  const int* gpu_row = p.gpu_page + b * p.max_pages;
  const int* host_row = p.host_page + b * p.max_pages;
  int pos[TOPK_PER_THREAD];
#pragma unroll
  for (int i = 0; i < TOPK_PER_THREAD; ++i) {
    const int k = i * THREADS + tid;
    pos[i] = k < K ? topk_row[k] : 0;
  }

  // this thread's slots while the chain runs: the positions they hold and their physical slots copied
  // asynchronously into shared memory (read again only for the victims), their stamps into registers
  long long key[SLOTS];
#pragma unroll
  for (int s = 0; s < SLOTS; ++s) {
    const int r = s * THREADS + tid;
    if (r < R) {
      copy_async(&held_s[r], &held_row[r]);
      copy_async(&hot_s[r], &hot_row[r]);
      key[s] = (long long)__ldcg(&stamp_row[r]);
    } else {
      held_s[r] = -1;
    }
  }
  asm volatile("cp.async.commit_group;\n" ::);
  for (int w = tid; w < CACHED / 32; w += THREADS) sh.hit_bits[w] = 0;
  if (tid == 0) {
    sh.num_cand = 0;
    sh.lo = step;
    sh.hi = -2;
  }
  const int count = min(p.counts[b], K);
  __syncthreads();  // the hit bits are clear

  // classify: resident, hot hit (stamped now, so no miss takes its slot), miss. The page and the reverse map
  // are read side by side (every position of a row lies in its reverse map).
  int* kv_row = p.kv + b * K;
  int page[TOPK_PER_THREAD], hot_of[TOPK_PER_THREAD];
#pragma unroll
  for (int i = 0; i < TOPK_PER_THREAD; ++i) {
    const bool valid = i * THREADS + tid < count;
    page[i] = valid ? gpu_row[pos[i] >> p.page_shift] : -1;
    hot_of[i] = valid && R > 0 ? (int)__ldcg(&map_row[pos[i]]) : -1;
  }
  unsigned miss_bits = 0;
  int kv[TOPK_PER_THREAD];
#pragma unroll
  for (int i = 0; i < TOPK_PER_THREAD; ++i) {
    const int k = i * THREADS + tid;
    const bool valid = k < count;
    const int h = valid && page[i] < 0 ? hot_of[i] : -1;
    kv[i] = -1;
    if (valid && page[i] >= 0) {
      kv[i] = (page[i] << p.page_shift) | (pos[i] & mask);
    } else if (h >= 0) {
      __stcg(&stamp_row[h], (Stamp)step);
      if (h < CACHED) atomicOr(&sh.hit_bits[h >> 5], 1u << (h & 31));
      kv[i] = __ldcg(&hot_row[h]);  // stored at the end: its load overlaps what follows
    } else if (valid) {  // a miss (or, without a lease, an entry the caller promised resident)
      miss_bits |= 1u << i;
      miss_pos_s[k] = pos[i];
      copy_async(&miss_host_s[k], &host_row[pos[i] >> p.page_shift]);  // this thread reads it, at the end
    }
  }
  asm volatile("cp.async.commit_group;\n" ::);
  // misses by group, in top-K order
#pragma unroll
  for (int i = 0; i < TOPK_PER_THREAD; ++i) {
    const int n = __popc(__ballot_sync(FULL, miss_bits >> i & 1));
    if (lane == 0) sh.group_sums[0][group_of(i, warp)] = n;
  }
  asm volatile("cp.async.wait_group 1;\n" ::);  // the slots' copies (the misses' host pages may still fly)
  __syncthreads();  // hit bits, hit stamps, group counts and the slots' copies visible to the block

  // candidates among this thread's registers (a hit slot carries the step); counts, bounds and miss ranks
  int my_cand = 0;
  long long my_min = step, my_max = -2;
#pragma unroll
  for (int s = 0; s < SLOTS; ++s) {
    const int r = s * THREADS + tid;
    key[s] = held_s[r] < 0 ? -1 : key[s];
    if (sh.hit_bits[r >> 5] >> (r & 31) & 1) key[s] = step;
    if (r < R && key[s] < step) {
      ++my_cand;
      my_min = min(my_min, key[s]);
      my_max = max(my_max, key[s]);
    }
  }
  for (int c0 = CACHED; c0 < R; c0 += CACHED) {  // a larger hot buffer: its other chunks from global memory
    int held_x[SLOTS];
    long long key_x[SLOTS];
    load_chunk<long long>(held_row, stamp_row, c0, R, tid, step, 0, held_x, key_x);
#pragma unroll
    for (int s = 0; s < SLOTS; ++s) {
      if (key_x[s] != 0x7fffffffffffffffLL) {
        ++my_cand;
        my_min = min(my_min, key_x[s]);
        my_max = max(my_max, key_x[s]);
      }
    }
  }
  int miss_before[TOPK_PER_THREAD];
  const int num_miss = group_prefix(sh.group_sums[0], lane, warp, miss_before);
  const int cand_sum = __reduce_add_sync(FULL, my_cand);
  const long long min_w = warp_min_ll(my_min), max_w = warp_max_ll(my_max);
  if (lane == 0) {
    atomicAdd(&sh.num_cand, cand_sum);
    atomicMin(&sh.lo, min_w);
    atomicMax(&sh.hi, max_w);
  }
  __syncthreads();
  const int num_cand = sh.num_cand;
  long long lo = sh.lo, hi = sh.hi;
  const int served = min(num_miss, num_cand);

  if (served > 0) {  // the search compares 32-bit keys where the candidates' stamps span less than 2^31
    if (hi - lo < 0x7fffffffLL)
      choose_victims<int>(sh, key, lo, hi, step, served, R, held_row, stamp_row, hot_row, held_s, hot_s, v_slot,
                          v_old, v_hot);
    else
      choose_victims<long long>(sh, key, lo, hi, step, served, R, held_row, stamp_row, hot_row, held_s, hot_s,
                                v_slot, v_old, v_hot);
  }

  // each served miss takes its victim: reverse map, slot position and stamp, copy list, slot
  if (num_miss > 0) {
    asm volatile("cp.async.wait_group 0;\n" ::);
#pragma unroll
    for (int i = 0; i < TOPK_PER_THREAD; ++i) {
      const int k = i * THREADS + tid;
      const bool is_miss = miss_bits >> i & 1;
      const unsigned ballot = __ballot_sync(FULL, is_miss);
      const int m = miss_before[i] + __popc(ballot & lanes_before);
      if (is_miss && m < served) {
        const int v = v_slot[m], old = v_old[m], vh = v_hot[m], at = miss_pos_s[k];
        // `old` is never a selected position of this row (a held selected position is a hit, not a victim)
        if (old >= 0) __stcg(&map_row[old], (Map)-1);
        __stcg(&map_row[at], (Map)v);
        __stcg(&held_row[v], at);
        __stcg(&stamp_row[v], (Stamp)step);
        p.copy_src[b * K + m] = (miss_host_s[k] << p.page_shift) | (at & mask);
        p.copy_dst[b * K + m] = vh;
        kv[i] = vh;
      }
    }
  }
#pragma unroll
  for (int i = 0; i < TOPK_PER_THREAD; ++i) {
    const int k = i * THREADS + tid;
    if (k < K) kv_row[k] = kv[i];
  }
  if (tid == 0) p.num_copied[b] = served;
}

// The tables of one request's plan in dynamic shared memory: the first CACHED slots' positions and physical
// slots; each miss's position and host page, by top-K entry; the victims in rank order: slot, the position it
// held, its physical slot.
template <typename Stamp, typename Map>
__device__ __forceinline__ void plan_with_tables(const PlanParams& p) {
  __shared__ Shared sh;
  extern __shared__ __align__(16) int dyn[];
  int* held_s = dyn;
  int* hot_s = held_s + CACHED;
  int* miss_pos_s = hot_s + CACHED;
  int* miss_host_s = miss_pos_s + MAX_K;
  int* v_slot = miss_host_s + MAX_K;
  int* v_old = v_slot + MAX_K;
  int* v_hot = v_old + MAX_K;
  plan<Stamp, Map>(p, sh, held_s, hot_s, miss_pos_s, miss_host_s, v_slot, v_old, v_hot);
}

}  // namespace

// One kernel a table dtype pair (slot stamps int32 / int64, reverse map int16 / int32), so a launch runs
// only its own code.
extern "C" __global__ void __launch_bounds__(THREADS, 1) resolve_plan_s32_m16(const PlanParams p) {
  plan_with_tables<int, int16_t>(p);
}
extern "C" __global__ void __launch_bounds__(THREADS, 1) resolve_plan_s32_m32(const PlanParams p) {
  plan_with_tables<int, int>(p);
}
extern "C" __global__ void __launch_bounds__(THREADS, 1) resolve_plan_s64_m16(const PlanParams p) {
  plan_with_tables<long long, int16_t>(p);
}
extern "C" __global__ void __launch_bounds__(THREADS, 1) resolve_plan_s64_m32(const PlanParams p) {
  plan_with_tables<long long, int>(p);
}
