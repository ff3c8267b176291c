"""Resolve plan variants (thirty-first session), written to .probe/<name>_resolve.py from kernels/resolve.py:
A: the top-K row loaded without waiting for the count; H: the first round's histogram masked to the exact bins
(32 of them, no bins for the candidates above nor for the other slots, whose shared-memory atomics collide), the
candidates counted only when the threshold lies past them; V: the slot tables' rows hinted 16-byte aligned and R a
multiple of 64 (vector loads); B: a lease's hot slots read from its page list (hot slots are page runs);
W: one probe a round after the first; C: the chunked path (hot buffers past R_BLOCK slots) cut out, a probe of what
the kernel's code size costs (wrong for larger buffers, timed only)."""
import itertools
import sys


def rep(s, a, b, n=1):
    assert s.count(a) == n, (a, s.count(a))
    return s.replace(a, b)


def top_k_early(s):
    return rep(s, "    valid = offs_k < tl.minimum(tl.load(counts_ptr + b), K)\n"
                  "    pos = tl.load(topk_ptr + b * K + offs_k, mask=valid, other=0)\n",
               "    pos = tl.load(topk_ptr + b * K + offs_k, mask=offs_k < K, other=0)\n"
               "    valid = offs_k < tl.minimum(tl.load(counts_ptr + b), K)\n"
               "    pos = tl.where(valid, pos, 0)\n")


def masked_hist(s):
    s = rep(s, '''    bins = tl.arange(0, BINS)
    short = (bins < BINS - 2) & (tl.cumsum(hist, 0) < num_miss)  # a prefix of the exact bins
    counts = hist.to(tl.int64)
    packed = (tl.where(short, counts, 0) + (short.to(tl.int64) << _FIELD_BITS)
              + (tl.where(bins < BINS - 1, counts, 0) << (2 * _FIELD_BITS)))
    sums = tl.sum(packed, 0)
    below = (sums & _FIELD_MASK).to(tl.int32)
    t = ((sums >> _FIELD_BITS) & _FIELD_MASK).to(tl.int32)
    num_cand = ((sums >> (2 * _FIELD_BITS)) & _FIELD_MASK).to(tl.int32)
    return lo + t, below, num_cand, t < BINS - 2
''', '''    short = tl.cumsum(hist, 0) < num_miss  # a prefix of the bins
    packed = tl.where(short, hist.to(tl.int64), 0) + (short.to(tl.int64) << _FIELD_BITS)
    sums = tl.sum(packed, 0)
    below = (sums & _FIELD_MASK).to(tl.int32)
    t = ((sums >> _FIELD_BITS) & _FIELD_MASK).to(tl.int32)
    return lo + t, below, t < BINS
''')
    s = rep(s, '''                hist = tl.histogram(_key_bins(key, cand, lo, BINS), BINS)
                lo, below, num_cand, settled = _first_round(hist, lo, num_miss, BINS)  # below: candidates < lo
                hi = lo
                if settled == 0:
                    hi = tl.max(tl.where(cand, key, -2), 0)
''', '''                hist = tl.histogram((key - lo).to(tl.int32), BINS, mask=cand & (key - lo < BINS))
                lo, below, settled = _first_round(hist, lo, num_miss, BINS)  # below: candidates < lo
                num_cand = num_miss  # enough of them when settled
                hi = lo
                if settled == 0:
                    num_cand, _, hi = _bounds(key, cand, step)
''')
    s = rep(s, '''                    hist += tl.histogram(_key_bins(key, cand, lo, BINS), BINS)
                lo, below, _, settled = _first_round(hist, lo, num_miss, BINS)
''', '''                    hist += tl.histogram((key - lo).to(tl.int32), BINS, mask=cand & (key - lo < BINS))
                lo, below, settled = _first_round(hist, lo, num_miss, BINS)
''')
    return s


def vector_rows(s):
    s = rep(s, "    held_row = tl.load(lease + 1).to(tl.pointer_type(tl.int32))\n",
            "    held_row = tl.multiple_of(tl.load(lease + 1).to(tl.pointer_type(tl.int32)), 16)\n")
    s = rep(s, "        stamp_row = tl.load(lease + 2).to(tl.pointer_type(tl.int64))\n",
            "        stamp_row = tl.multiple_of(tl.load(lease + 2).to(tl.pointer_type(tl.int64)), 16)\n")
    s = rep(s, "        stamp_row = tl.load(lease + 2).to(tl.pointer_type(tl.int32))\n",
            "        stamp_row = tl.multiple_of(tl.load(lease + 2).to(tl.pointer_type(tl.int32)), 16)\n")
    return rep(s, "    return hot_row, held_row, stamp_row, map_row, tl.load(lease + 4).to(tl.int32)\n",
               "    return hot_row, held_row, stamp_row, map_row, tl.multiple_of(tl.load(lease + 4).to(tl.int32), 64)\n")


def hot_pages(s):
    s = rep(s, "    hot_hit = tl.load(hot_row + h, mask=hit, other=-1)\n",
            "    hot_hit = tl.load(hot_row + h // PAGE, mask=hit, other=-1) * PAGE + h % PAGE\n")
    s = rep(s, "        v_hot = tl.load(hot_row + v, mask=served, other=-1)\n",
            "        v_hot = tl.load(hot_row + v // PAGE, mask=served, other=-1) * PAGE + v % PAGE\n")
    return rep(s, '''    cols = [t.data_ptr() + rows * (t.stride(0) * t.element_size())
            for t in (hot_slots, slot_pos, slot_stamp, pos_to_hot)]
''', '''    pages = (hot_slots[:, ::PAGE_SIZE] // PAGE_SIZE).contiguous()
    _KEEP.append(pages)
    cols = [t.data_ptr() + rows * (t.stride(0) * t.element_size())
            for t in (pages, slot_pos, slot_stamp, pos_to_hot)]
''').replace("def _stacked_lease_table(", "_KEEP = []\n\n\ndef _stacked_lease_table(")


def one_probe(s):
    return rep(s, "_SEARCH_WAYS = 3\n", "_SEARCH_WAYS = 1\n")


def no_chunks(s):
    start = s.index("        else:\n            tl.debug_barrier()\n            num_cand = num_miss * 0\n")
    end = s.index("        tl.debug_barrier()\n        served = miss & (miss_rank < num_served)\n")
    return s[:start] + s[end:]


FORMS = dict(A=top_k_early, H=masked_hist, V=vector_rows, B=hot_pages, W=one_probe, C=no_chunks)

if __name__ == "__main__":
    base = open("kernels/resolve.py").read()
    for name in sys.argv[1:]:
        s = base
        for letter in name:
            s = FORMS[letter](s)
        open(f".probe/v{name}_resolve.py", "w").write(s)
