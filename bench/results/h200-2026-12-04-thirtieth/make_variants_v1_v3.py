src = open("kernels/resolve.py").read()

def rep(s, a, b, n=1):
    assert s.count(a) == n, (a, s.count(a))
    return s.replace(a, b)

# V1: the victims' hot slots loaded by the victims alone, in the pick
v1 = rep(src, "def _pick_victims(key, cand, offs_r, held, hot, lo,", "def _pick_victims(key, cand, offs_r, held, hot_row, lo,")
v1 = rep(v1, "    take = victim & (victim_rank < num_served)\n", "    take = victim & (victim_rank < num_served)\n    hot = tl.load(hot_row + offs_r, mask=take, other=-1)\n")
v1 = rep(v1, "            hot = tl.load(hot_row + offs_r, mask=offs_r < R, other=-1)\n            tl.debug_barrier()  # hit", "            tl.debug_barrier()  # hit")
v1 = rep(v1, "            _pick_victims(key, cand, offs_r, held, hot, lo,", "            _pick_victims(key, cand, offs_r, held, hot_row, lo,")
v1 = rep(v1, "                hot = tl.load(hot_row + offs_r, mask=offs_r < R, other=-1)\n                num_below, num_at = _pick_victims(key, cand, offs_r, held, hot, lo,",
         "                num_below, num_at = _pick_victims(key, cand, offs_r, held, hot_row, lo,")
open(".probe/v1_resolve.py", "w").write(v1)

# V2: only the victims' slots stored by rank; their positions and hot slots gathered by the misses
v2 = rep(v1, "    hot = tl.load(hot_row + offs_r, mask=take, other=-1)\n", "")
v2 = rep(v2, "    tl.store(victims_old + victim_rank, held, mask=take)\n    tl.store(victims_hot + victim_rank, hot, mask=take)\n", "")
v2 = rep(v2, "        old = tl.load(victims_old + miss_rank, mask=served, other=-1)\n        v_hot = tl.load(victims_hot + miss_rank, mask=served, other=-1)\n",
         "        old = tl.load(held_row + v, mask=served, other=-1)\n        v_hot = tl.load(hot_row + v, mask=served, other=-1)\n"
         "        tl.store(victims_hot + miss_rank, v_hot, mask=served)\n")
open(".probe/v2_resolve.py", "w").write(v2)

# V3: V2 with the key read from the stamps alone (empty slots stamped -1: the bench's tables have none)
v3 = rep(v2, "            held = tl.load(held_row + offs_r, mask=offs_r < R, other=-1)  # on their way across the barrier\n", "")
v3 = rep(v3, "            key = tl.where(held < 0, -1, tl.load(stamp_row + offs_r, mask=offs_r < R, other=0))\n",
         "            key = tl.load(stamp_row + offs_r, mask=offs_r < R, other=0)\n            held = key\n")
open(".probe/v3_resolve.py", "w").write(v3)
