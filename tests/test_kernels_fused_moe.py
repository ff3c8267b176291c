"""Fused MoE kernels (`kernels.fused_moe`) against their PyTorch twins and a dense reference.

Runs the Triton kernels under the interpreter (TRITON_INTERPRET=1, set before
triton is imported) on small shapes (E = 8..64 experts, k = 2..8, H = 96..256,
I = 48..128). `moe_align` must equal `moe_align_ref` element for element and
keep its contract (every routed slot exactly once, grouped by expert, sentinel
padding, sizes fixed by (T, k, E, block_m)). `fused_moe` must match
`fused_moe_ref` (same roundings) tightly and the engine's former per-expert
SwiGLU loop in float32 (the dense reference) within the activation rounding
(fp16, or the per-token fp8 quantisation for fp8 weights). Outputs are poisoned
with NaN before each launch. fp32 / fp16 weights and fp8 weights with fp32, fp16
or bf16 activations only: the interpreter's bf16 `tl.dot` is not trustworthy
(fp8 paths quantise the activations from float32, so bf16 activations are fine
there). The GPU run at GLM-5.3 shapes is tests/gpu/test_fused_moe_gpu.py.
"""

from __future__ import annotations

import dataclasses
import os
import zlib

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from kernels.fp8_gemm import (  # noqa: E402
    Fp8Activations,
    dequantize_weight_blocks,
    quantize_activations,
    quantize_weight_blocks,
)
from kernels.fused_moe import FusedMoEConfig, fused_moe, fused_moe_ref  # noqa: E402
from kernels.moe_align import moe_align, moe_align_ref, moe_align_sizes  # noqa: E402


@pytest.fixture(autouse=True)
def _interpreter_active():
    """Triton decides interpreter mode when it is imported: if a conftest imported it first, say so."""
    if not isinstance(tl.sum, InterpretedFunction):
        pytest.fail("triton was imported before TRITON_INTERPRET=1 was set (a conftest or plugin imported it "
                    "first); set it before any import, e.g. `TRITON_INTERPRET=1 pytest ...`")


def _gen(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def random_routing(t: int, k: int, e: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """k distinct experts per token (as top-k gives) and positive weights."""
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]) if t else torch.zeros(0, k)
    return torch.rand(t, k, generator=gen) + 0.1, ids.long()


# --- moe_align ---------------------------------------------------------------------------


def check_alignment(ids: torch.Tensor, num_experts: int, block_m: int, al) -> None:
    """The contract of moe_align, checked directly (independently of the twin)."""
    n = ids.numel()
    max_padded, max_blocks = moe_align_sizes(n, num_experts, block_m)
    assert al.sorted_ids.shape == (max_padded,) and al.sorted_ids.dtype == torch.int32
    assert al.expert_of_block.shape == (max_blocks,) and al.expert_of_block.dtype == torch.int32
    assert al.num_padded.shape == (1,) and al.num_padded.dtype == torch.int32
    flat = ids.reshape(-1).long()
    valid = (flat >= 0) & (flat < num_experts)
    npad = int(al.num_padded.item())
    counts = torch.bincount(flat[valid], minlength=num_experts)
    assert npad == int(((counts + block_m - 1) // block_m * block_m).sum())
    s = al.sorted_ids.long()
    assert ((s[npad:] == n).all()), "sentinel after num_padded"
    used = s[:npad]
    assert ((used >= 0) & (used <= n)).all()
    real = used[used < n]
    assert sorted(real.tolist()) == torch.nonzero(valid).flatten().tolist(), "every routed slot exactly once"
    eob = al.expert_of_block.long()
    nblk = npad // block_m
    assert (eob[nblk:] == -1).all(), "expert -1 after num_padded"
    assert (eob[:nblk] >= 0).all() and (eob[:nblk] < num_experts).all()
    assert (eob[:nblk].diff() >= 0).all(), "experts in ascending order"
    for e in range(num_experts):
        run = used.reshape(nblk, block_m)[eob[:nblk] == e].reshape(-1)
        want = int((counts[e] + block_m - 1) // block_m * block_m)
        assert run.numel() == want, f"expert {e}: run of {run.numel()} slots, want {want}"
        c = int(counts[e])
        assert (flat[run[:c]] == e).all() and (run[:c].diff() > 0).all(), "slots of the expert, ascending"
        assert (run[c:] == n).all(), "padding with the sentinel after the expert's slots"


@pytest.mark.parametrize("t, k, e, block_m", [
    (1, 8, 256, 16), (5, 2, 8, 16), (33, 2, 8, 16), (70, 2, 8, 64),  # one launch
    (64, 8, 256, 16), (113, 9, 257, 16),  # one launch, up to 1,024 slots (GLM: 256 routed + 1 shared)
    (20, 9, 257, 16),  # the shared expert folded in: 512 expert lanes
    (9, 1, 1, 16), (11, 2, 3, 32), (6, 3, 5, 16),  # fewer experts than one program owns, or not a multiple of it
    (300, 8, 16, 32), (120, 9, 257, 16),  # the multi-program count and scatter
])
def test_moe_align_matches_twin(t, k, e, block_m):
    _, ids = random_routing(t, k, e, _gen("align", t, k, e, block_m))
    al = moe_align(ids, e, block_m)
    check_alignment(ids, e, block_m, al)
    for got, want in zip(al, moe_align_ref(ids, e, block_m)):
        assert torch.equal(got, want)


def test_moe_align_edge_cases():
    e, bm = 8, 16
    # Every slot on one expert (several blocks; one launch, then several chunks), int32 ids.
    for tokens in (150, 600):
        ids = torch.full((tokens, 2), 3, dtype=torch.int32)
        al = moe_align(ids, e, bm)
        check_alignment(ids, e, bm, al)
        assert (al.expert_of_block[: int(al.num_padded.item()) // bm] == 3).all()
    # Two experts in use, the others empty; the sizes depend only on (T, k, E, block_m).
    ids2 = torch.tensor([[0, 5], [5, 0], [0, 5]])
    al2 = moe_align(ids2, e, bm)
    check_alignment(ids2, e, bm, al2)
    assert al2.expert_of_block[:2].tolist() == [0, 5] and int(al2.num_padded.item()) == 32
    _, ids3 = random_routing(3, 2, e, _gen("edge"))
    al3 = moe_align(ids3, e, bm)
    assert [a.shape for a in al3] == [a.shape for a in al2]
    # Ids outside [0, E) are left out (an expert another rank holds).
    ids4 = torch.tensor([[1, -1], [8, 1], [2, 100]])
    al4 = moe_align(ids4, e, bm)
    check_alignment(ids4, e, bm, al4)
    for got, want in zip(al4, moe_align_ref(ids4, e, bm)):
        assert torch.equal(got, want)
    # Non-contiguous ids (a column slice) are read through their strides.
    _, wide = random_routing(40, 6, e, _gen("strided"))
    sl = wide[:, ::3]
    for got, want in zip(moe_align(sl, e, bm), moe_align_ref(sl.contiguous(), e, bm)):
        assert torch.equal(got, want)


def test_moe_align_rejects_bad_inputs():
    ids = torch.zeros(4, 2, dtype=torch.int64)
    with pytest.raises(ValueError):
        moe_align(ids.float(), 8, 16)
    with pytest.raises(ValueError):
        moe_align(ids.reshape(-1), 8, 16)
    with pytest.raises(ValueError):
        moe_align(ids, 8, 24)
    with pytest.raises(ValueError):
        moe_align(ids, 0, 16)


# --- fused_moe ---------------------------------------------------------------------------


def make_experts(fmt: str, e: int, h: int, i: int, gen: torch.Generator) -> dict:
    """Random expert weights (unit-variance outputs): dtype weights, or fp8 with 128x128 block scales."""
    w13 = torch.randn(e, 2 * i, h, generator=gen) * h**-0.5
    w2 = torch.randn(e, h, i, generator=gen) * i**-0.5
    if fmt != "fp8":
        dt = {"fp32": torch.float32, "fp16": torch.float16}[fmt]
        return dict(w13=w13.to(dt), w2=w2.to(dt))
    q13, s13 = quantize_weight_blocks(w13.reshape(e * 2 * i, h))  # 2I % 128 == 0: no block straddles experts
    q2 = [quantize_weight_blocks(w) for w in w2]
    return dict(w13=q13.reshape(e, 2 * i, h), w2=torch.stack([q for q, _ in q2]),
                w13_scale_inv=s13.reshape(e, 2 * i // 128, -1), w2_scale_inv=torch.stack([s for _, s in q2]))


def dense_moe(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w: dict) -> torch.Tensor:
    """The engine's former MoE loop (per-expert SwiGLU with F.linear, index_add_) in float32 on the
    (dequantised) weights and unquantised activations; ids outside [0, E) skipped."""
    w13, w2 = w["w13"], w["w2"]
    e, i = w13.shape[0], w13.shape[1] // 2
    xf = x.float()
    out = torch.zeros_like(xf)
    for expert in ids.unique().tolist():
        if not 0 <= expert < e:
            continue
        if "w13_scale_inv" in w:
            gu = dequantize_weight_blocks(w13[expert], w["w13_scale_inv"][expert])
            down = dequantize_weight_blocks(w2[expert], w["w2_scale_inv"][expert])
        else:
            gu, down = w13[expert].float(), w2[expert].float()
        token_idx, slot = torch.where(ids == expert)
        hid = F.silu(F.linear(xf[token_idx], gu[:i])) * F.linear(xf[token_idx], gu[i:])
        out.index_add_(0, token_idx, F.linear(hid, down) * weights[token_idx, slot, None])
    return out


def assert_close(out: torch.Tensor, ref: torch.Tensor, tol: float, what: str) -> None:
    assert not out.isnan().any(), "unwritten (NaN) output elements"
    err = (out.double() - ref.double()).abs().max().item()
    scale = max(1.0, ref.abs().max().item())
    assert err <= tol * scale, f"{what}: max abs error {err:.3g} > {tol} x {scale:.3g}"


X_DTYPE = {"fp32": torch.float32, "fp16": torch.float16, "fp8": torch.float32}
TWIN_TOL = {"fp32": 1e-5, "fp16": 2e-3, "fp8": 1e-4}  # the same roundings: float32 summation order (fp16: 1 ulp)
# fp16 activations / per-token e4m3 activations (seen: 4e-4 and 4.7e-2 of max |ref|)
DENSE_TOL = {"fp32": 1e-5, "fp16": 3e-3, "fp8": 0.1}


def run_case(fmt, t, *, e=8, k=2, h=256, i=128, x_dtype=None, config=None, ids=None, seed=0):
    gen = _gen("moe", fmt, t, e, k, h, i, seed)
    w = make_experts(fmt, e, h, i, gen)
    x = torch.randn(t, h, generator=gen).to(x_dtype or X_DTYPE[fmt])
    weights, rand_ids = random_routing(t, k, e, gen)
    ids = rand_ids if ids is None else ids
    out = torch.full_like(x, float("nan"))
    res = fused_moe(x, **{"w13": w["w13"], "w2": w["w2"]}, topk_weights=weights, topk_ids=ids,
                    **{n: v for n, v in w.items() if n.endswith("scale_inv")}, out=out, config=config)
    assert res is out
    ref = fused_moe_ref(x, w["w13"], w["w2"], weights, ids,
                        **{n: v for n, v in w.items() if n.endswith("scale_inv")})
    return x, w, weights, ids, out, ref


@pytest.mark.parametrize("fmt", ["fp32", "fp16", "fp8"])
@pytest.mark.parametrize("t", [1, 5, 33])
def test_fused_moe_matches_twin_and_dense(fmt, t):
    x, w, weights, ids, out, ref = run_case(fmt, t)
    assert out.dtype == x.dtype and ref.dtype == x.dtype
    assert_close(out.float(), ref.float(), TWIN_TOL[fmt], "kernel vs twin")
    dense = dense_moe(x, weights, ids, w)
    assert_close(out.float(), dense, DENSE_TOL[fmt], "kernel vs dense")
    assert_close(ref.float(), dense, DENSE_TOL[fmt], "twin vs dense")


@pytest.mark.parametrize("fmt, t, kw", [
    ("fp16", 33, dict(e=16, k=8)),  # 264 slots: the two-launch alignment inside fused_moe
    ("fp32", 7, dict(e=6, k=3, h=96, i=48)),  # ragged H and I (the tiny test model's shape)
    ("fp8", 9, dict(h=192)),  # a partial last 128-column scale block
    ("fp8", 6, dict(x_dtype=torch.bfloat16)),
    ("fp8", 3, dict(x_dtype=torch.float16, e=32, k=8)),
])
def test_fused_moe_shapes(fmt, t, kw):
    x, w, weights, ids, out, ref = run_case(fmt, t, **kw)
    tol = {torch.float32: TWIN_TOL[fmt], torch.float16: 2e-3, torch.bfloat16: 8e-3}[x.dtype]  # 16-bit: 1 ulp
    assert_close(out.float(), ref.float(), tol, "kernel vs twin")
    assert_close(out.float(), dense_moe(x, weights, ids, w), max(DENSE_TOL[fmt], tol), "kernel vs dense")


_C = FusedMoEConfig


@pytest.mark.parametrize("fmt", ["fp16", "fp8"])
@pytest.mark.parametrize("config", [
    _C(block_m=16, block_n=16, block_n_down=64, swap_ab=True),
    _C(block_m=32, block_n=128, block_n_down=32),
    _C(block_m=64, block_n=32, block_n_down=256, swap_ab=True, num_stages=3),
    _C(block_m=16, block_n=128, block_n_down=64),
])
def test_fused_moe_configs(fmt, config):
    _, _, _, _, out, ref = run_case(fmt, 21, config=config, seed=1)
    assert_close(out.float(), ref.float(), TWIN_TOL[fmt], "kernel vs twin")


@pytest.mark.parametrize("fmt, t, config", [
    ("fp8", 1, _C(block_m=16, block_n=128, split_k=3)),  # 5 K tiles in ranges of 2, 2, 1
    ("fp8", 3, _C(block_m=16, block_n=64, split_k=2, swap_ab=True)),
    ("fp16", 2, _C(block_m=16, block_n=32, split_k=5)),  # one K tile per range
    ("fp32", 5, _C(block_m=16, block_n=32, block_n_down=64, num_stages=2, split_k=2)),
])
def test_fused_moe_split_k(fmt, t, config):
    """Gate/up with H cut into ranges (a few tokens): the last range of each tile sums the partials; a second
    call reuses the re-armed arrival counters and gives the same bits."""
    x, w, weights, ids, out, ref = run_case(fmt, t, h=640, config=config, seed=3)
    assert_close(out.float(), ref.float(), TWIN_TOL[fmt], "kernel vs twin")
    again = fused_moe(x, **w, topk_weights=weights, topk_ids=ids, config=config)
    assert torch.equal(again, out), "a second call differs"


@pytest.mark.parametrize("fmt, t, kw, config", [
    ("fp8", 5, dict(h=640, i=256), _C(block_m=16, block_n=64, block_n_down=128, tiles_down=2, swap_ab=True)),
    ("fp8", 7, dict(h=640, i=256), _C(block_m=16, block_n=64, block_n_down=128, tiles_down=4)),
    ("fp16", 3, dict(), _C(block_m=16, block_n=32, block_n_down=32, block_k_down=32, tiles_down=3)),
])
def test_fused_moe_down_tiles(fmt, t, kw, config):
    """Down with several column tiles a program, their K steps one loop (two to four K steps a tile here): 5
    column tiles in programs of 2 or 4 (the last one's spare tiles masked), 8 in programs of 3; a second call
    gives the same bits."""
    x, w, weights, ids, out, ref = run_case(fmt, t, config=config, seed=5, **kw)
    assert_close(out.float(), ref.float(), TWIN_TOL[fmt], "kernel vs twin")
    again = fused_moe(x, **w, topk_weights=weights, topk_ids=ids, config=config)
    assert torch.equal(again, out), "a second call differs"


@pytest.mark.parametrize("fmt, t, kw, config", [
    ("fp8", 1, dict(x_dtype=torch.bfloat16), _C(gemv=True, block_n=8, block_k=256, block_n_down=16,
                                                block_k_down=128)),
    ("fp8", 2, dict(h=640, i=256), _C(gemv=True, block_n=4, block_k=512, block_n_down=32, block_k_down=256)),
    ("fp8", 3, dict(h=192), _C(gemv=True, block_n=16, block_k=128, block_n_down=8, block_k_down=128)),
    ("fp16", 2, dict(), _C(gemv=True, block_n=32, block_k=128, block_n_down=64, block_k_down=128)),
    ("fp32", 1, dict(e=6, k=3, h=96, i=48), _C(gemv=True, block_n=16, block_k=128, block_n_down=32,
                                              block_k_down=128)),
])
def test_fused_moe_gemv(fmt, t, kw, config):
    """The few-token form (slot GEMVs, the intermediate quantised inside the down launch, slots summed in
    it) equals the twin, ragged H and I included; ids outside [0, E) contribute nothing."""
    x, w, weights, ids, out, ref = run_case(fmt, t, config=config, seed=4, **kw)
    tol = {torch.float32: TWIN_TOL[fmt], torch.float16: 2e-3, torch.bfloat16: 8e-3}[x.dtype]
    assert_close(out.float(), ref.float(), tol, "kernel vs twin")
    foreign = ids.clone()
    foreign[0, 0] = -1
    got = fused_moe(x, **w, topk_weights=weights, topk_ids=foreign, config=config)
    want = fused_moe_ref(x, **w, topk_weights=weights, topk_ids=foreign)
    assert_close(got.float(), want.float(), tol, "kernel vs twin, a foreign id")


@pytest.mark.parametrize("fmt, t, kw, config", [
    ("fp8", 5, dict(h=640), _C(block_m=16, block_n=64, split_k=2, swap_ab=True)),  # a K split at a few tokens
    ("fp16", 40, dict(e=4), _C(block_m=16, block_n=32, block_n_down=64)),  # 20 slots an expert: two blocks each
    ("fp32", 9, dict(k=3), _C(block_m=16, block_n=32, block_n_down=64, num_stages=2, tiles_down=2)),
])
def test_fused_moe_slot_led_blocks(fmt, t, kw, config):
    """Blocks found by gate/up's own programs (each slot whose rank among its expert's slots is a multiple of
    block_m leads the next block_m of them, and lists the block for down) give the aligned launches' bits, with
    int64 and int32 ids and a foreign id; a second call (the listed-block count re-armed by the slot sum) gives
    the same bits."""
    x, w, weights, ids, _, _ = run_case(fmt, t, config=config, seed=6, **kw)
    ids = ids.clone()
    ids[1, 0] = -1
    aligned = fused_moe(x, **w, topk_weights=weights, topk_ids=ids, config=config)
    led = dataclasses.replace(config, slot_led=True)
    got = fused_moe(x, **w, topk_weights=weights, topk_ids=ids, config=led)
    assert torch.equal(got, aligned), "slot-led blocks differ from the aligned ones"
    assert torch.equal(fused_moe(x, **w, topk_weights=weights, topk_ids=ids.int(), config=led), aligned)
    tol = {torch.float32: TWIN_TOL[fmt], torch.float16: 2e-3}[x.dtype]
    assert_close(got.float(), fused_moe_ref(x, **w, topk_weights=weights, topk_ids=ids).float(), tol, "kernel vs twin")
    with pytest.raises(ValueError, match="slot-led"):
        big = torch.zeros(289, 1, dtype=torch.long)
        fused_moe(torch.zeros(289, x.shape[1], dtype=x.dtype), **w, topk_weights=torch.ones(289, 1),
                  topk_ids=big, config=led)


def test_fused_moe_small_k_tiles():
    _, _, _, _, out, ref = run_case("fp32", 12, config=_C(block_k=32, block_k_down=64), seed=2)
    assert_close(out, ref, TWIN_TOL["fp32"], "kernel vs twin")


def test_fused_moe_skips_foreign_ids():
    ids = torch.tensor([[0, -1], [8, 3], [-1, -1], [2, 5]])
    x, w, weights, _, out, ref = run_case("fp32", 4, ids=ids)
    assert_close(out, ref, TWIN_TOL["fp32"], "kernel vs twin")
    assert_close(out, dense_moe(x, weights, ids, w), TWIN_TOL["fp32"], "kernel vs dense")
    assert (out[2] == 0).all(), "a token with no local expert gets zeros"


def test_fused_moe_defaults_and_empty():
    gen = _gen("defaults")
    w = make_experts("fp32", 8, 128, 128, gen)
    x = torch.randn(3, 128, generator=gen)
    weights, ids = random_routing(3, 2, 8, gen)
    got = fused_moe(x, w["w13"], w["w2"], weights, ids.int())
    assert_close(got, fused_moe_ref(x, w["w13"], w["w2"], weights, ids), TWIN_TOL["fp32"], "int32 ids")
    empty = fused_moe(x[:0], w["w13"], w["w2"], weights[:0], ids[:0])
    assert empty.shape == (0, 128)
    assert FusedMoEConfig.for_problem(1, 8, 256).block_m == 16
    assert FusedMoEConfig.for_problem(2048, 8, 256).block_m == 64
    assert FusedMoEConfig.for_problem(2048, 8, 256, weight_dtype=torch.float32).num_stages == 2
    # one or two tokens of a GLM-5.3 rank (8 routed + the shared expert, H = 6144, I = 256) with fp8 experts:
    # slot GEMVs; three tokens: 27 experts x 4 tiles of 64 columns are 108 programs, so H is cut into 2 ranges
    glm = dict(weight_dtype=torch.float8_e4m3fn, hidden=6144, inter=256)
    assert FusedMoEConfig.for_problem(1, 9, 257, **glm).gemv and FusedMoEConfig.for_problem(2, 9, 257, **glm).gemv
    three = FusedMoEConfig.for_problem(3, 9, 257, **glm)
    assert (three.gemv, three.block_n, three.split_k, three.slot_led) == (False, 64, 2, True)
    assert FusedMoEConfig.for_problem(32, 9, 257, **glm).slot_led  # 288 slots: every program reads them all
    assert not FusedMoEConfig.for_problem(64, 9, 257, **glm).slot_led  # 576: the alignment's launch
    assert not FusedMoEConfig.for_problem(1, 9, 257, hidden=6144, inter=256).gemv  # bf16 experts: tiles
    assert FusedMoEConfig.for_problem(4, 9, 257, weight_dtype=torch.float8_e4m3fn, hidden=6144).split_k == 1


def test_fused_moe_rejects_bad_inputs():
    gen = _gen("bad")
    w = make_experts("fp32", 4, 128, 128, gen)
    q = make_experts("fp8", 4, 128, 128, gen)
    x = torch.randn(2, 128, generator=gen)
    weights, ids = random_routing(2, 2, 4, gen)
    s = dict(w13_scale_inv=q["w13_scale_inv"], w2_scale_inv=q["w2_scale_inv"])
    bad = [
        lambda: fused_moe(x[0], w["w13"], w["w2"], weights, ids),  # x not 2-D
        lambda: fused_moe(x.int(), w["w13"], w["w2"], weights, ids),
        lambda: fused_moe(x[:, :64], w["w13"], w["w2"], weights, ids),  # H mismatch
        lambda: fused_moe(x, w["w13"], w["w2"][:, :, :64], weights, ids),  # I mismatch
        lambda: fused_moe(x, w["w13"], w["w2"].half(), weights, ids),  # mixed weight dtypes
        lambda: fused_moe(x, w["w13"], w["w2"], weights.half(), ids),
        lambda: fused_moe(x, w["w13"], w["w2"], weights, ids.float()),
        lambda: fused_moe(x, w["w13"], w["w2"], weights[:1], ids[:1]),  # T mismatch
        lambda: fused_moe(x, w["w13"], w["w2"], weights, ids, out=torch.empty(2, 128, dtype=torch.float16)),
        lambda: fused_moe(x, w["w13"], w["w2"], weights, ids, **s),  # scales with float weights
        lambda: fused_moe(x, q["w13"], q["w2"], weights, ids),  # fp8 without scales
        lambda: fused_moe(x, q["w13"], q["w2"], weights, ids, w13_scale_inv=s["w13_scale_inv"][:, :1],
                          w2_scale_inv=s["w2_scale_inv"]),
        lambda: fused_moe(x, q["w13"], q["w2"], weights, ids, **s, config=_C(block_k=64)),
        lambda: fused_moe(x, w["w13"], w["w2"], weights, ids, config=_C(block_m=24)),
        lambda: fused_moe(x, q["w13"][:, :128], q["w2"][:, :, :64], weights, ids,  # fp8 with I = 64
                          w13_scale_inv=s["w13_scale_inv"][:, :1], w2_scale_inv=s["w2_scale_inv"][:, :, :1]),
        lambda: fused_moe(x, w["w13"].transpose(1, 2).contiguous().transpose(1, 2), w["w2"], weights, ids),
    ]
    for i, call in enumerate(bad):
        with pytest.raises(ValueError):
            call()
            pytest.fail(f"bad input {i} accepted")
    with pytest.raises(ValueError):
        fused_moe_ref(x, q["w13"], q["w2"], weights, ids)


def test_fused_moe_takes_the_producers_quantisation():
    """fp8 experts fed x's quantisation by its producer (an RMSNorm) give the bits of quantising x inside."""
    x, w, weights, ids, out, _ = run_case("fp8", 4, x_dtype=torch.bfloat16, seed=4)
    given = fused_moe(x, **w, topk_weights=weights, topk_ids=ids, x_fp8=Fp8Activations(*quantize_activations(x)))
    assert torch.equal(given, out)
