"""V7 (call 6): the hits' hot slots read through an in-register gather of the whole hot row (not kept)."""
s = open("kernels/resolve.py").read()
a = "    tl.store(stamp_row + h, step, mask=hit)\n    hot_hit = tl.load(hot_row + h, mask=hit, other=-1)\n"
assert s.count(a) == 1
s = s.replace(a, '''    tl.store(stamp_row + h, step, mask=hit)
    if R <= R_BLOCK:
        offs_h = tl.arange(0, R_BLOCK)
        hot_all = tl.load(hot_row + offs_h, mask=offs_h < R, other=-1)
        hot_hit = tl.where(hit, tl.gather(hot_all, tl.where(hit, h, 0), 0), -1)
    else:
        hot_hit = tl.load(hot_row + h, mask=hit, other=-1)
''')
open(".probe/v7_resolve.py", "w").write(s)
