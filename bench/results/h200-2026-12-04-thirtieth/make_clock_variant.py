s = open("kernels/resolve.py").read()
def rep(s, a, b, n=1):
    assert s.count(a) == n, (a, s.count(a))
    return s.replace(a, b)
s = rep(s, "@triton.jit\ndef _lease_rows(", '''@triton.jit
def _clock(dep):
    return tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,r", [dep.to(tl.int32)], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit
def _lease_rows(''')
s = rep(s, "    kv_ptr, num_copied_ptr, victim_ptr, victim_old_ptr, copy_src_ptr, copy_dst_ptr,\n",
        "    kv_ptr, num_copied_ptr, victim_ptr, victim_old_ptr, copy_src_ptr, copy_dst_ptr, dbg_ptr,\n")
s = rep(s, "    b = tl.program_id(0).to(tl.int64)\n    step = tl.load(step_ptr)\n",
        "    b = tl.program_id(0).to(tl.int64)\n    tl.store(dbg_ptr + b * 8, _clock(b))\n    step = tl.load(step_ptr)\n")
s = rep(s, "    num_miss = tl.sum(miss.to(tl.int32), 0)\n", "    num_miss = tl.sum(miss.to(tl.int32), 0)\n    tl.store(dbg_ptr + b * 8 + 1, _clock(num_miss))\n")
s = rep(s, "        miss_rank = tl.cumsum(miss.to(tl.int32), 0) - 1  # victims go to misses in top-K order\n",
        "        miss_rank = tl.cumsum(miss.to(tl.int32), 0) - 1  # victims go to misses in top-K order\n        tl.store(dbg_ptr + b * 8 + 2, _clock(tl.max(miss_rank, 0)))\n")
s = rep(s, "                lo = tl.min(tl.where(cand, key, step), 0)\n",
        "                lo = tl.min(tl.where(cand, key, step), 0)\n                tl.store(dbg_ptr + b * 8 + 3, _clock(lo))\n")
s = rep(s, "                lo, below, num_cand, settled = _first_round(hist, lo, num_miss, BINS)  # below: candidates < lo\n",
        "                lo, below, num_cand, settled = _first_round(hist, lo, num_miss, BINS)  # below: candidates < lo\n                tl.store(dbg_ptr + b * 8 + 4, _clock(below))\n")
s = rep(s, "            _pick_victims(key, cand, offs_r, held, hot, lo, num_miss - below,",
        "            nb, na = _pick_victims(key, cand, offs_r, held, hot, lo, num_miss - below,")
s = rep(s, "                          num_served, victims, victims_old, victims_hot)\n        else:",
        "                          num_served, victims, victims_old, victims_hot)\n            tl.store(dbg_ptr + b * 8 + 5, _clock(nb + na))\n        else:")
s = rep(s, "        served = miss & (miss_rank < num_served)\n", "        served = miss & (miss_rank < num_served)\n        tl.store(dbg_ptr + b * 8 + 6, _clock(num_served))\n")
s = rep(s, "    tl.store(num_copied_ptr + b, num_served)\n", "    tl.store(num_copied_ptr + b, num_served)\n    tl.store(dbg_ptr + b * 8 + 7, _clock(tl.sum(kv, 0)))\n")
s = rep(s, "        kv_slots, num_copied, work[0], work[1], work[2], work[3],\n", "        kv_slots, num_copied, work[0], work[1], work[2], work[3], DBG,\n")
s = rep(s, "def _launch_plan(", "DBG = None\n\n\ndef _launch_plan(")
open(".probe/vclk_resolve.py", "w").write(s)
