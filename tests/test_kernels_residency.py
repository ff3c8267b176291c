"""Residency kernels against their PyTorch twins and a pure-Python LRU model (CPU, Triton interpreter).

Covers `kernels/resolve.py` (resident / hot hit / miss classification, LRU
victim choice, reverse map, host -> hot slot copies), `kernels/page_mirror.py`
(whole pages) and `kernels/fp8_pack.py`. Outputs start poisoned and every element is compared,
including the bytes a kernel must leave alone.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import random  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from kernels import fp8_pack, fp8_rows, page_mirror, resolve  # noqa: E402
from tests.helpers import sm90_ptx  # noqa: E402
from tests.resolve_cases import (  # noqa: E402
    PAGE, PAGE_BYTES, SMALL_CASES, ResolveCase, group_place, make_case, make_topk, run_resolve, runs_view,
)


@pytest.mark.parametrize("seed,ctx,k,num_hot,step,stamp_dtype,map_dtype", SMALL_CASES)
@pytest.mark.parametrize("r_block,b_block", [(1024, 64), (8, 2)])  # one chunk; many chunks of slots and requests
# the victim search's forms: probes a round, first round a histogram of that many bins (0: none)
@pytest.mark.parametrize("ways,bins", [(3, 32), (1, 32), (1, 0), (2, 0)])
def test_resolve_matches_twin(seed, ctx, k, num_hot, step, stamp_dtype, map_dtype, r_block, b_block, ways, bins,
                              monkeypatch):
    monkeypatch.setattr(resolve, "_R_BLOCK", r_block)
    monkeypatch.setattr(resolve, "_B_BLOCK", b_block)
    monkeypatch.setattr(resolve, "_SEARCH_WAYS", ways)
    monkeypatch.setattr(resolve, "_SEARCH_BINS", bins)
    rng = random.Random(seed)
    case = make_case(rng, ctx, num_hot, 384, step=step, stamp_dtype=stamp_dtype, map_dtype=map_dtype)
    topk, counts, _ = make_topk(rng, ctx, k)
    for group in (0, 1):
        got_state, want_state = case.state(), case.state()
        got = run_resolve(resolve.resolve_group, case, topk, counts, got_state, step, group)
        want = run_resolve(resolve.resolve_group_reference, case, topk, counts, want_state, step, group)
        assert torch.equal(got.kv_slots, want.kv_slots)
        assert torch.equal(got.num_copied, want.num_copied)
        for g, w in zip(got_state, want_state):
            assert torch.equal(g, w)


@pytest.mark.parametrize("r_block", [1024, 32, 8])  # every buffer searched in registers; some (17, 24); none
def test_resolve_leases_matches_twin(r_block, monkeypatch):
    """Requests whose hot buffers differ in size resolve in one launch on their own tables, those that fit one
    chunk of slots searched in registers beside those read in chunks."""
    monkeypatch.setattr(resolve, "_R_BLOCK", r_block)
    rng = random.Random(7)
    ctx, sizes, step = [300, 384, 130, 200], [40, 17, 24, 33], 12
    case = make_case(rng, ctx, max(sizes), 384, step=step)
    for i, r in enumerate(sizes):  # shrink request i's buffer to its first r slots
        for pos in case.slot_pos[i, r:].tolist():
            if pos >= 0:
                case.pos_to_hot[i, pos] = -1
        case.slot_pos[i, r:] = -1
    topk, counts, _ = make_topk(rng, ctx, 32)

    def leases(state):
        slot_pos, slot_stamp, pos_to_hot, _ = state
        return [resolve.LeaseState(case.hot_slots[i, :r], slot_pos[i, :r], slot_stamp[i, :r], pos_to_hot[i])
                for i, r in enumerate(sizes)]

    for group in (0, 1):
        got_state, want_state = case.state(), case.state()
        args = (topk, counts, case.gpu_page, case.host_page)
        place = (step, *group_place(group))
        got = resolve.resolve_leases(*args, leases(got_state), *place, got_state[3], case.host_pool)
        want = resolve.resolve_leases_reference(*args, leases(want_state), *place, want_state[3], case.host_pool)
        assert int(want.num_copied.sum()) > 0
        assert torch.equal(got.kv_slots, want.kv_slots)
        assert torch.equal(got.num_copied, want.num_copied)
        for g, w in zip(got_state, want_state):
            assert torch.equal(g, w)
        for i, r in enumerate(sizes):  # no request wrote past its own slots
            assert (got_state[0][i, r:] == -1).all()

# --- resolve: step-by-step against a pure-Python LRU model ---------------------------------


class LruModel:
    """Per request: hot slot -> (position, stamp); victims are the least recently used slots not used this step."""

    def __init__(self, case: ResolveCase):
        self.pos = case.slot_pos.tolist()
        self.stamp = case.slot_stamp.tolist()
        self.hot = case.hot_slots.tolist()

    def step(self, i: int, picked: list[int], gpu_page: list[int], step: int):
        """Returns (kv slots, [(position, hot slot)] copied)."""
        where = {p: r for r, p in enumerate(self.pos[i]) if p >= 0}
        kinds = []
        for p in picked:
            if gpu_page[p // PAGE] >= 0:
                kinds.append(("resident", gpu_page[p // PAGE] * PAGE + p % PAGE))
            elif p in where:
                self.stamp[i][where[p]] = step
                kinds.append(("hit", where[p]))
            else:
                kinds.append(("miss", None))
        free = [r for r in range(len(self.pos[i])) if self.pos[i][r] < 0 or self.stamp[i][r] < step]
        free.sort(key=lambda r: (-1 if self.pos[i][r] < 0 else self.stamp[i][r], r))
        num_miss = sum(kind == "miss" for kind, _ in kinds)
        victims = sorted(free[:num_miss])
        kv, copies = [], []
        for p, (kind, v) in zip(picked, kinds):
            if kind == "resident":
                kv.append(v)
            elif kind == "hit":
                kv.append(self.hot[i][v])
            elif victims:
                r = victims.pop(0)
                self.pos[i][r], self.stamp[i][r] = p, step
                kv.append(self.hot[i][r])
                copies.append((p, self.hot[i][r]))
            else:
                kv.append(-1)
        return kv, copies


@pytest.mark.parametrize("seed,num_hot,group", [(10, 24, 1), (11, 16, 0)])
def test_resolve_lru_simulation(seed, num_hot, group):
    rng = random.Random(seed)
    k, ctx = 16, [70, 20, 180, 130]
    case = make_case(rng, ctx, num_hot, 256, step=1)
    model = LruModel(case)
    slot_pos, slot_stamp, pos_to_hot, gpu_pool = case.state()
    host_runs = runs_view(case.host_pool, group)
    previous = None
    for step in range(1, 7):
        ctx = [n + 1 for n in ctx]
        for i, n in enumerate(ctx):  # decode: the newest token's page is resident
            if case.gpu_page[i, (n - 1) // PAGE] < 0:
                case.gpu_page[i, (n - 1) // PAGE] = int(case.gpu_page.max()) + 1
        if step == 4:  # demote every resident page but the tail of request 2
            tail = case.gpu_page[2, (ctx[2] - 1) // PAGE].item()
            case.gpu_page[2] = -1
            case.gpu_page[2, (ctx[2] - 1) // PAGE] = tail
        topk, counts, previous = make_topk(rng, ctx, k, previous)
        expect_pool = gpu_pool.clone()
        got = resolve.resolve_group(topk, counts, case.gpu_page, case.host_page, case.hot_slots, slot_pos,
                                    slot_stamp, pos_to_hot, step, *group_place(group), gpu_pool, case.host_pool)
        for i, picked in enumerate(previous):
            kv, copies = model.step(i, picked, case.gpu_page[i].tolist(), step)
            assert got.kv_slots[i].tolist() == kv + [-1] * (k - len(kv))
            assert got.num_copied[i].item() == len(copies)
            for p, slot in copies:
                runs_view(expect_pool, group)[slot // PAGE, slot % PAGE] = host_runs[case.host_page[i, p // PAGE], p % PAGE]
            assert slot_pos[i].tolist() == model.pos[i]
            held = {p: r for r, p in enumerate(model.pos[i]) if p >= 0}
            assert pos_to_hot[i].tolist() == [held.get(p, -1) for p in range(pos_to_hot.shape[1])]
            for r, p in enumerate(model.pos[i]):
                if p >= 0:
                    assert slot_stamp[i, r].item() == model.stamp[i][r]
            for p, slot in zip(picked, kv):  # every selected row reads the bytes that left for host
                if case.gpu_page[i, p // PAGE] < 0:
                    want = host_runs[case.host_page[i, p // PAGE], p % PAGE]
                    assert torch.equal(runs_view(gpu_pool, group)[slot // PAGE, slot % PAGE], want)
        assert torch.equal(gpu_pool, expect_pool)  # nothing else in the pool moved


def test_resolve_rejects_bad_inputs():
    case = make_case(random.Random(5), [100], 16, 128, step=1)
    topk, counts, _ = make_topk(random.Random(5), [100], 16)
    args = [topk, counts, case.gpu_page, case.host_page, case.hot_slots, case.slot_pos, case.slot_stamp,
            case.pos_to_hot, 1, *group_place(1), case.gpu_pool, case.host_pool]
    with pytest.raises(ValueError):
        resolve.resolve_group(*args[:1], counts.long(), *args[2:])
    with pytest.raises(ValueError):
        resolve.resolve_group(*args[:9], 0, PAGE_BYTES, *args[11:])


# --- page mirror --------------------------------------------------------------------------


@pytest.mark.parametrize("page_bytes", [PAGE_BYTES, 4 * 1031])
def test_page_mirror_matches_twin(page_bytes):
    gen = torch.Generator().manual_seed(page_bytes)
    gpu_pool = torch.randint(0, 256, (12, page_bytes), dtype=torch.uint8, generator=gen)
    host = torch.randint(0, 256, (10, page_bytes), dtype=torch.uint8, generator=gen)
    gpu_ids, host_ids = [3, 4, 5, 11, 0], [7, 8, 9, 2, 0]
    got, want = host.clone(), host.clone()
    page_mirror.mirror_pages_triton(gpu_pool, got, gpu_ids, host_ids)
    page_mirror.mirror_pages_reference(gpu_pool, want, gpu_ids, host_ids)
    assert torch.equal(got, want)
    assert torch.equal(got[host_ids], gpu_pool[gpu_ids])
    untouched = [h for h in range(10) if h not in host_ids]
    assert torch.equal(got[untouched], host[untouched])
    page_mirror.mirror_pages(gpu_pool, got, [], [])
    assert torch.equal(got, want)


# --- FP8 packing --------------------------------------------------------------------------


def tricky_latent(n: int, dim: int, gen: torch.Generator) -> torch.Tensor:
    """Random rows plus rows that hit every fp8 rounding case: with amax 448 the scale is 1."""
    x = torch.randn(n, dim, generator=gen) * torch.logspace(-30, 4, n)[:, None]
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[grid.isfinite() & (grid >= 0)].sort().values
    mids = (grid[1:] + grid[:-1]) / 2  # exact ties: round to even
    tricky = torch.cat([mids, mids.nextafter(torch.tensor(0.0)), mids.nextafter(torch.tensor(1e9)), grid])
    tricky = torch.cat([tricky, -tricky, torch.tensor([0.0, -0.0, 1e-45, -3e-39])])
    blocks = tricky.split(dim - 1)
    for i, vals in enumerate(blocks[: n - 2]):
        x[i + 1] = 0.0
        x[i + 1, 0] = 448.0 if i % 2 else -448.0
        x[i + 1, 1 : 1 + len(vals)] = vals
    x[-1] = 0.0  # all-zero row: scale 1
    return x


@pytest.mark.parametrize("dl,dr,dtype", [(256, 16, torch.float32), (64, 8, torch.bfloat16), (512, 64, torch.float32)])
def test_pack_mla_rows_matches_twin(dl, dr, dtype):
    gen = torch.Generator().manual_seed(dl + dr)
    n = 24
    latent = tricky_latent(n, dl, gen).to(dtype)
    rope = (torch.randn(n, dr, generator=gen) * 3).to(dtype)
    rope[0, :3] = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8)])  # bf16 ties
    row = fp8_rows.mla_row_bytes(dl, dr)
    pool = torch.full((5, PAGE * 3 * row), 0xA5, dtype=torch.uint8)
    place = fp8_pack.RowPlacement(PAGE, row, 2 * row)  # second layer of a 2-layer group after a 1-layer group
    slots = torch.randperm(5 * PAGE, generator=gen)[:n]
    got, want = pool.clone(), pool.clone()
    fp8_pack.pack_mla_rows_into(latent, rope, got, slots, place)
    fp8_pack.pack_mla_rows_into_reference(latent, rope, want, slots, place)
    assert torch.equal(got, want)
    assert (got != pool).any()


@pytest.mark.parametrize("dtype, interleaved", [(torch.bfloat16, True), (torch.float32, False)])
def test_pack_mla_rows_normalises_and_rotates(dtype, interleaved):
    """With a LatentPrep the packing launch takes kv_a_proj's raw (strided) outputs and does the latent's
    RMSNorm and the key's rotation itself: the rope bytes equal packing the rotation computed in float32 and
    rounded once (as kernels.rope does on a GPU) exactly, and the latent equals packing the model's norm within
    one e4m3 step (the mean square is summed in another order, so a value on a rounding edge may move)."""
    from engine.layers import rms_norm
    from kernels.rope import rope_ref

    gen = torch.Generator().manual_seed(7)
    n, dl, dr = 9, 256, 16
    raw = (torch.randn(n, dl + dr + 8, generator=gen) * 2).to(dtype)
    latent, rope = raw[:, :dl], raw[:, dl:dl + dr]
    weight = (torch.rand(dl, generator=gen) + 0.5).to(dtype)
    angles = torch.rand(n, dr // 2, generator=gen) * 6
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    row = fp8_rows.mla_row_bytes(dl, dr)
    pool = torch.zeros((3, PAGE * row), dtype=torch.uint8)
    place = fp8_pack.RowPlacement(PAGE, 0, row)
    slots = torch.randperm(3 * PAGE, generator=gen)[:n]
    got, want = pool.clone(), pool.clone()
    fp8_pack.pack_mla_rows_into(latent, rope, got, slots, place, fp8_pack.LatentPrep(weight, 1e-6, cos, sin, interleaved))
    rotated = rope_ref(rope, cos, sin, interleaved)
    normed = rms_norm(latent, weight, 1e-6)
    fp8_pack.pack_mla_rows_into_reference(normed.contiguous(), rotated.contiguous(), want, slots, place)
    got_rows = got.view(-1, row)[slots.long()]
    want_rows = want.view(-1, row)[slots.long()]
    assert torch.equal(got_rows[:, row - 2 * dr:], want_rows[:, row - 2 * dr:]), "rope bytes"
    got_vals, want_vals = (fp8_rows.unpack_mla_rows(r, dl, dr)[:, :dl] for r in (got_rows, want_rows))
    step = want_vals.abs().amax(dim=1, keepdim=True) / 448 * 32  # one e4m3 step at the block's largest values
    assert ((got_vals - want_vals).abs() <= step).all()
    if dtype == torch.bfloat16:  # the rounding to bf16 absorbs the last-bit difference of the mean square
        assert (got_vals == want_vals).float().mean() > 0.99


@pytest.mark.parametrize("dim", [128, 32])
def test_pack_indexer_rows_matches_twin(dim):
    """Keys land as a full layer's block lays them out: every token's values at a `dim`-byte stride, then every
    token's fp32 scale at a 4-byte stride; no other byte of the pool changes."""
    gen = torch.Generator().manual_seed(dim)
    n, tokens = 20, 2 * PAGE
    keys = tricky_latent(n, dim, gen).to(torch.bfloat16)
    key_bytes = fp8_rows.indexer_key_bytes(dim)
    pool = torch.full((3, 3 * tokens * key_bytes + 7), 0x5A, dtype=torch.uint8)
    start = 2 * tokens * key_bytes  # third full layer
    place = fp8_pack.KeyPlacement(tokens, start, dim, start + tokens * dim, 4)
    slots = torch.randperm(3 * tokens, generator=gen)[:n].int()
    got, want = pool.clone(), pool.clone()
    fp8_pack.pack_indexer_rows_into(keys, got, slots, place)
    fp8_pack.pack_indexer_rows_into_reference(keys, want, slots, place)
    assert torch.equal(got, want)
    expected = pool.clone()
    packed = fp8_rows.pack_indexer_rows(keys)
    for (page, token), key in zip(((s // tokens, s % tokens) for s in slots.tolist()), packed):
        values, scale = start + token * dim, start + tokens * dim + 4 * token
        assert values % 16 == 0
        expected[page, values : values + dim] = key[:dim]
        expected[page, scale : scale + 4] = key[dim:]
    assert torch.equal(got, expected)


@pytest.mark.parametrize("dtype, interleaved", [(torch.bfloat16, True), (torch.float32, False)])
def test_pack_indexer_rows_normalises_and_rotates(dtype, interleaved):
    """With a KeyPrep the packing launch takes wk's raw (strided) outputs and does the key's LayerNorm and the
    rotation of its first values itself: equal to packing the model's LayerNorm then `rope_ref` within one e4m3
    step (the mean and variance are summed in another order, so a value on a rounding edge may move, and the
    scale with the largest), nearly every code alike, the scale within one part in 2**20."""
    from kernels.rope import rope_ref

    gen = torch.Generator().manual_seed(11)
    n, d, r, tokens = 9, 128, 64, 2 * PAGE
    raw = (torch.randn(n, d + 24, generator=gen) * 3 + 0.5).to(dtype)[:, 8 : 8 + d]
    weight = (torch.rand(d, generator=gen) + 0.5).to(dtype)
    bias = (torch.randn(d, generator=gen) * 0.1).to(dtype)
    angles = torch.rand(n, r // 2, generator=gen) * 6
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    key_bytes = fp8_rows.indexer_key_bytes(d)
    pool = torch.zeros((3, tokens * key_bytes), dtype=torch.uint8)
    place = fp8_pack.KeyPlacement(tokens, 0, d, tokens * d, 4)
    slots = torch.randperm(3 * tokens, generator=gen)[:n].int()
    got, want = pool.clone(), pool.clone()
    fp8_pack.pack_indexer_rows_into(raw, got, slots, place, fp8_pack.KeyPrep(weight, bias, 1e-6, cos, sin, r,
                                                                             interleaved))
    normed = torch.nn.functional.layer_norm(raw.float(), (d,), weight.float(), bias.float(), 1e-6).to(dtype)
    keys = torch.cat([rope_ref(normed[:, :r], cos, sin, interleaved), normed[:, r:]], dim=1)
    fp8_pack.pack_indexer_rows_into_reference(keys.contiguous(), want, slots, place)
    pages, at = (slots // tokens).long(), (slots % tokens).long()
    values = lambda p: p.view(3, tokens * key_bytes)[:, : tokens * d].view(3, tokens, d)[pages, at]  # noqa: E731
    scales = lambda p: p[:, tokens * d :].contiguous().view(torch.float32)[pages, at]  # noqa: E731
    got_scale, want_scale = scales(got), scales(want)
    assert ((got_scale - want_scale).abs() <= want_scale * 2**-20).all()
    got_codes, want_codes = values(got), values(want)
    got_vals = got_codes.view(torch.float8_e4m3fn).float() * got_scale[:, None]
    want_vals = want_codes.view(torch.float8_e4m3fn).float() * want_scale[:, None]
    step = want_scale[:, None] * 32  # one e4m3 step at the key's largest values
    assert ((got_vals - want_vals).abs() <= step).all()
    assert (got_codes == want_codes).float().mean() > 0.97
    untouched = torch.ones(3, tokens, dtype=torch.bool)
    untouched[pages, at] = False
    assert (got.view(3, tokens * key_bytes)[:, : tokens * d].view(3, tokens, d)[untouched] == 0).all()


def test_pack_indexer_rows_refuses_placements_that_do_not_fit():
    keys = torch.randn(2, 32)
    pool = torch.zeros((2, 64 * 36), dtype=torch.uint8)
    slots = torch.tensor([0, 65])
    fp8_pack.pack_indexer_rows_into_reference(keys, pool, slots, fp8_pack.KeyPlacement(64, 0, 32, 64 * 32, 4))
    for place in (fp8_pack.KeyPlacement(64, 0, 32, 64 * 32 + 1, 4),  # last scale past the page
                  fp8_pack.KeyPlacement(64, 0, 16, 64 * 32, 4),  # values overlap the next token's
                  fp8_pack.KeyPlacement(64, 0, 32, 64 * 32, 2)):  # scales overlap
        for pack in (fp8_pack.pack_indexer_rows_into, fp8_pack.pack_indexer_rows_into_reference):
            with pytest.raises(ValueError, match="does not fit"):
                pack(keys, pool, slots, place)
    with pytest.raises(TypeError, match="KeyPlacement"):
        fp8_pack.pack_indexer_rows_into(keys, pool, slots, fp8_pack.RowPlacement(64, 0, 36))


def test_the_one_chunk_plan_compiles_without_the_chunked_search() -> None:
    """The plan for leases of one chunk of slots (what a decode step's configured leases take) compiles for an H200
    without the chunked victim search: its code is what the form saves (about half; a probe of it, 0.2-0.6 us of
    12-13 at 1 % misses). The engine's table dtypes, the top-K and chunk of GLM-5.3."""
    types = {"lease_ptr": "*i64", "step_ptr": "*i64", **{name: "*i32" for name in (
        "topk_ptr", "counts_ptr", "gpu_page_ptr", "host_page_ptr", "kv_ptr", "num_copied_ptr", "victim_ptr",
        "copy_src_ptr", "copy_dst_ptr")}}
    shape = dict(PAGE=PAGE, K_BLOCK=2048, R_BLOCK=4096, WAYS=resolve._SEARCH_WAYS, BINS=resolve._SEARCH_BINS,
                 STAMP64=True, MAP16=False, PDL=False)
    lines = {one: len(sm90_ptx("resolve:_plan_kernel", types, {**shape, "ONE_CHUNK": one}, num_warps=8).splitlines())
             for one in (True, False)}
    assert lines[True] < 0.65 * lines[False], lines
