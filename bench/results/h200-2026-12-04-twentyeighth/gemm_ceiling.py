"""How fast can a decode-size FP8 GEMM be on this GPU? Our Triton GEMM against cuBLAS (per-tensor FP8,
block-scaled FP8 if torch takes it, bf16) and a plain read of the weight bytes, weights cycled past L2."""
import sys, torch, triton, triton.language as tl
sys.path.insert(0, ".")
from bench.timing import bench_graph, hbm_copy_gbs
from kernels.fp8_gemm import fp8_block_linear, quantize_activations, Fp8Activations, FP8GemmConfig

torch.manual_seed(0)
COPIES = 8

@triton.jit
def _read_kernel(w_ptr, out_ptr, n_words, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    pid = tl.program_id(0)
    acc = tl.zeros((BLOCK,), tl.int32)
    base = pid * BLOCK * ITERS
    for i in tl.static_range(ITERS):
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        acc ^= tl.load(w_ptr + offs, mask=offs < n_words, other=0)
    tl.store(out_ptr + pid, tl.sum(acc, 0))

def read_fn(w, out):
    words = w.view(torch.int32).reshape(-1)
    n = words.numel()
    block, iters = 1024, 8
    grid = triton.cdiv(n, block * iters)
    return lambda: _read_kernel[(grid,)](words, out, n, BLOCK=block, ITERS=iters, num_warps=4)

gbs = hbm_copy_gbs()
print(f"HBM copy {gbs:.0f} GB/s")
shapes = {"o_proj": (6144, 2048), "q_kv_a+wk": (2752, 6144), "q_b+wq_b": (6144, 2048), "gate_up_like": (512, 6144)}
print(f"{'shape':>12} {'M':>3} {'MB':>5} {'floor':>6} {'read':>6} {'ours':>6} {'cublas_pt':>9} {'cublas_blk':>10} {'bf16':>6}  err_pt err_blk")
out_buf = torch.empty(1 << 20, dtype=torch.int32, device="cuda")
for name, (n, k) in shapes.items():
    ws = [(torch.randn(n, k, device="cuda") * 0.05).to(torch.float8_e4m3fn) for _ in range(COPIES)]
    wsc = [torch.rand((n + 127) // 128, (k + 127) // 128, device="cuda") * 0.01 + 0.001 for _ in range(COPIES)]
    wbf = [w.to(torch.bfloat16) for w in ws[:4]]
    for m in (8, 32, 64):
        x = torch.randn(m, k, device="cuda").bfloat16()
        xq, xs = quantize_activations(x)
        fp = Fp8Activations(xq, xs)
        one = torch.ones((), device="cuda")
        mb = n * k / 1e6
        floor = n * k / (gbs / 2 * 1e3)  # us at the copy's read rate
        t_read = bench_graph([read_fn(ws[i % COPIES], out_buf) for i in range(16)]) * 1e3
        t_ours = bench_graph([(lambda i=i: fp8_block_linear(x, ws[i % COPIES], wsc[i % COPIES], x_fp8=fp)) for i in range(16)]) * 1e3
        ref = fp8_block_linear(x, ws[0], wsc[0], x_fp8=fp).float()
        try:
            t_pt = bench_graph([(lambda i=i: torch._scaled_mm(xq, ws[i % COPIES].t(), one, one, out_dtype=torch.bfloat16)) for i in range(16)]) * 1e3
            pt_s = f"{t_pt:9.2f}"
        except Exception as e:
            pt_s = "   n/a"; print("pt:", repr(e)[:200])
        blk_s, err_blk = "n/a", ""
        for form in range(4):
            try:
                sa = xs.t().contiguous().t() if form in (0, 1) else xs
                sb = wsc[0].t() if form in (0, 2) else wsc[0].t().contiguous()
                got = torch._scaled_mm(xq, ws[0].t(), sa, sb, out_dtype=torch.bfloat16).float()
                err = ((got - ref).abs().max() / ref.abs().max()).item()
                if err < 0.02:
                    def mk(i, form=form):
                        sbi = wsc[i % COPIES].t() if form in (0, 2) else wsc[i % COPIES].t().contiguous()
                        return lambda: torch._scaled_mm(xq, ws[i % COPIES].t(), sa, sbi, out_dtype=torch.bfloat16)
                    t_blk = bench_graph([mk(i) for i in range(16)]) * 1e3
                    blk_s, err_blk = f"{t_blk:.2f}(f{form})", f"{err:.1e}"
                    break
                else:
                    err_blk = f"f{form} err {err:.2g}"
            except Exception as e:
                if m == 8 and name == "o_proj":
                    print(f"blk form {form}:", repr(e)[:300])
        t_bf = bench_graph([(lambda i=i: x @ wbf[i % 4].t()) for i in range(16)]) * 1e3
        print(f"{name:>12} {m:3d} {mb:5.1f} {floor:6.2f} {t_read:6.2f} {t_ours:6.2f} {pt_s:>9} {blk_s:>10} {t_bf:6.2f}  {err_blk}", flush=True)
