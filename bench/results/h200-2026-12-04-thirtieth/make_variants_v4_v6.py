v2 = open(".probe/v2_resolve.py").read()
def rep(s, a, b, n=1):
    assert s.count(a) == n, (a, s.count(a))
    return s.replace(a, b)
# V4: the slot tables' loads issued first in the miss branch (the hits' stamps fenced by a barrier right after
# their stores), so their latency overlaps the misses' ranking
v4 = rep(v2, "    tl.store(stamp_row + h, step, mask=hit)\n    hot_hit",
         "    tl.store(stamp_row + h, step, mask=hit)\n    tl.debug_barrier()  # hit stamps are visible: hit slots are not candidates\n    hot_hit")
v4 = rep(v4, """    if num_miss > 0:
        miss_rank = tl.cumsum""", """    if num_miss > 0:
        offs_r = tl.arange(0, R_BLOCK)
        in_regs = offs_r < tl.where(R <= R_BLOCK, R, 0)
        held = tl.load(held_row + offs_r, mask=in_regs, other=-1)
        stamp = tl.load(stamp_row + offs_r, mask=in_regs, other=0)
        miss_rank = tl.cumsum""")
v4 = rep(v4, """            offs_r = tl.arange(0, R_BLOCK)
            held = tl.load(held_row + offs_r, mask=offs_r < R, other=-1)  # on their way across the barrier
            tl.debug_barrier()  # hit stamps are visible: hit slots are not candidates
            key = tl.where(held < 0, -1, tl.load(stamp_row + offs_r, mask=offs_r < R, other=0))
""", """            key = tl.where(held < 0, -1, stamp)
""")
v4 = rep(v4, """        else:
            tl.debug_barrier()
            num_cand""", """        else:
            num_cand""")
open(".probe/v4_resolve.py", "w").write(v4)
# V5: V4 with the reverse map gathered beside the page table (every valid position of a row with a lease)
v5 = rep(v4, """    gpage = tl.load(gpu_page_ptr + b * max_pages + page, mask=valid, other=-1)
    resident = valid & (gpage >= 0)
    lookup = valid & (gpage < 0)
    h = tl.load(map_row + pos, mask=lookup, other=-1).to(tl.int32)
""", """    gpage = tl.load(gpu_page_ptr + b * max_pages + page, mask=valid, other=-1)
    h = tl.load(map_row + pos, mask=tl.where(R > 0, valid, False), other=-1).to(tl.int32)
    resident = valid & (gpage >= 0)
    lookup = valid & (gpage < 0)
    h = tl.where(lookup, h, -1)
""")
open(".probe/v5_resolve.py", "w").write(v5)
# V6: V5 with the key read from the stamps alone (empty slots stamped -1)
v6 = rep(v5, "            key = tl.where(held < 0, -1, stamp)\n", "            key = stamp\n")
v6 = rep(v6, "        held = tl.load(held_row + offs_r, mask=in_regs, other=-1)\n", "        held = offs_r * 0\n")
open(".probe/v6_resolve.py", "w").write(v6)
