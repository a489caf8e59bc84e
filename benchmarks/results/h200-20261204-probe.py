"""First-H200 probe: API facts moetrain's GPU path depends on. Each item isolated, printed at once."""
import os, sys, time, json, traceback
import torch, torch.nn.functional as F
OUT = os.environ.get("OUT", "/tmp")
res = {}
def item(name):
    def deco(fn):
        t = time.perf_counter()
        try:
            v = fn()
            res[name] = {"ok": True, "v": v}
            print(f"[ok] {name}: {v}  ({time.perf_counter()-t:.1f}s)", flush=True)
        except Exception as e:
            res[name] = {"ok": False, "err": f"{type(e).__name__}: {e}"[:1500]}
            print(f"[FAIL] {name}: {type(e).__name__}: {str(e)[:1500]}", flush=True)
        with open(f"{OUT}/probe.json", "w") as f: json.dump(res, f, indent=1, default=str)
    return deco
dev = torch.device("cuda")
FP8 = torch.float8_e4m3fn
def q_tiles(x, tr, tc):
    M, K = x.shape
    xt = x.float().view(M // tr, tr, K // tc, tc)
    s = xt.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    d = (xt / s[:, None, :, None]).clamp(-448, 448).to(FP8).view(M, K)
    return d, s
def deq(d, s, tr, tc):
    M, K = d.shape
    return (d.float().view(M // tr, tr, K // tc, tc) * s[:, None, :, None]).view(M, K)
def ru4(n): return (n + 3) // 4 * 4
def colmajor_padded(s_rows_by_k):  # s: (Nb, Kb) -> (L4, Nb) stride (1, L4)
    Nb, Kb = s_rows_by_k.shape
    buf = torch.zeros(Nb, ru4(Kb), device=s_rows_by_k.device)
    buf[:, :Kb] = s_rows_by_k
    return buf.t()
def relerr(y, r): return ((y.float() - r).abs().max() / r.abs().max()).item()
def tm(fn, it=10):
    fn(); torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(it): fn()
    e1.record(); torch.cuda.synchronize()
    return e0.elapsed_time(e1) / it / 1e3

@item("env")
def _():
    import importlib.util
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "nccl": torch.cuda.nccl.version(),
            "gpu": torch.cuda.get_device_name(), "cap": torch.cuda.get_device_capability(),
            "py": sys.version.split()[0], "tomli_w": importlib.util.find_spec("tomli_w") is not None,
            "torchao": importlib.util.find_spec("torchao") is not None,
            "F.scaled_mm": hasattr(F, "scaled_mm"), "F.scaled_grouped_mm": hasattr(F, "scaled_grouped_mm"),
            "_scaled_grouped_mm": hasattr(torch, "_scaled_grouped_mm"), "_grouped_mm": hasattr(torch, "_grouped_mm"),
            "ScalingType": [x.name for x in F.ScalingType] if hasattr(F, "ScalingType") else None,
            "blas": torch.backends.cuda.preferred_blas_library().name}

S = F.ScalingType
for (M, K, N) in [(1024, 768, 768), (1024, 128, 384), (1024, 7168, 2048), (4096, 2048, 7168)]:
    torch.manual_seed(0)
    x = torch.randn(M, K, device=dev); w = torch.randn(N, K, device=dev)
    xa, sxa = q_tiles(x, 1, 128); wq, sw = q_tiles(w, 128, 128)
    ref = deq(xa, sxa, 1, 128) @ deq(wq, sw, 128, 128).t()
    sa = sxa.t().contiguous().t()
    @item(f"fwd 1x128x128x128 current-code scales {M}x{K}x{N}")
    def _():
        y = F.scaled_mm(xa, wq.t(), sa, S.BlockWise1x128, sw.t(), S.BlockWise128x128, output_dtype=torch.float32)
        return relerr(y, ref)
    @item(f"fwd 1x128x128x128 padded L4 scales {M}x{K}x{N}")
    def _():
        sb = colmajor_padded(sw)
        f = lambda: F.scaled_mm(xa, wq.t(), sa, S.BlockWise1x128, sb, S.BlockWise128x128, output_dtype=torch.bfloat16)
        y = f(); t = tm(f)
        return {"err": relerr(y, ref), "tflops": 2 * M * K * N / t / 1e12, "sb": (tuple(sb.shape), sb.stride())}
    # dgrad: dX (M,K) = dY (M,N) @ W (N,K): a = dY 1x128 along N, b(N,K) col-major = W data^T contiguous .t()
    dy = torch.randn(M, N, device=dev)
    dya, sdy = q_tiles(dy, 1, 128)
    refd = deq(dya, sdy, 1, 128) @ deq(wq, sw, 128, 128)
    @item(f"dgrad 1x128x128x128 padded {M}x{N}x{K}")
    def _():
        b = wq.t().contiguous().t()  # (N, K) column-major
        sb = colmajor_padded(sw.t().contiguous())  # block grid (Nb contraction, Kb out) -> (L4(Nb), Kb)
        f = lambda: F.scaled_mm(dya, b, sdy.t().contiguous().t(), S.BlockWise1x128, sb, S.BlockWise128x128, output_dtype=torch.bfloat16)
        y = f(); t = tm(f)
        return {"err": relerr(y, refd), "tflops": 2 * M * K * N / t / 1e12}
    # wgrad: dW (N,K) = dY^T (N,M) @ X (M,K), both 1x128 along M
    @item(f"wgrad 1x128x1x128 {N}x{M}x{K}")
    def _():
        a_, sa_ = q_tiles(dy.t().contiguous(), 1, 128)  # (N, M), (N, M/128)
        bt, sbt = q_tiles(x.t().contiguous(), 1, 128)  # (K, M), (K, M/128)
        r = deq(a_, sa_, 1, 128) @ deq(bt, sbt, 1, 128).t()
        f = lambda: F.scaled_mm(a_, bt.t(), sa_.t().contiguous().t(), S.BlockWise1x128, sbt.t().contiguous().t(), S.BlockWise1x128, output_dtype=torch.bfloat16)
        y = f(); t = tm(f)
        return {"err": relerr(y, r), "tflops": 2 * M * K * N / t / 1e12}
    @item(f"bf16 matmul {M}x{K}x{N}")
    def _():
        a, b = x.bfloat16(), w.bfloat16()
        t = tm(lambda: a @ b.t())
        return {"tflops": 2 * M * K * N / t / 1e12}

E, rows, K, N = 8, 2048, 7168, 4096
@item("bf16 _grouped_mm uneven/empty groups fwd+bwd")
def _():
    counts = torch.tensor([0, 100, 3000, 0, 7, 2048, 1, 0], device=dev)
    offs = counts.cumsum(0).to(torch.int32)
    T = int(counts.sum())
    x = torch.randn(T, 256, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(8, 512, 256, device=dev, dtype=torch.bfloat16, requires_grad=True)
    y = torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
    y.float().square().sum().backward()
    ref = torch.cat([x[int(a):int(b)].float() @ w[e].float().t() for e, (a, b) in enumerate(zip([0] + offs.tolist()[:-1], offs.tolist()))])
    return {"err": relerr(y, ref), "wgrad_empty_zero": w.grad[0].abs().max().item(), "xg": x.grad.shape}
@item("bf16 _grouped_mm unaligned K=100 (not multiple of 8/16)")
def _():
    x = torch.randn(64, 100, device=dev, dtype=torch.bfloat16); w = torch.randn(2, 48, 100, device=dev, dtype=torch.bfloat16)
    return tuple(torch._grouped_mm(x, w.transpose(-2, -1), offs=torch.tensor([30, 64], device=dev, dtype=torch.int32)).shape)
xg = torch.randn(E * rows, K, device=dev); wg = torch.randn(E, N, K, device=dev)
offs = (torch.arange(1, E + 1, device=dev) * rows).to(torch.int32)
@item("bf16 _grouped_mm DSv3 E8 2048x7168x4096")
def _():
    a, b = xg.bfloat16(), wg.bfloat16()
    t = tm(lambda: torch._grouped_mm(a, b.transpose(-2, -1), offs=offs))
    return {"tflops": 2 * E * rows * K * N / t / 1e12}
def rowq(x):
    s = x.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448
    return (x / s).clamp(-448, 448).to(FP8), s.squeeze(-1)
@item("_scaled_grouped_mm rowwise 2d-3d fwd DSv3")
def _():
    a, sa = rowq(xg); b, sb = rowq(wg)  # b (E,N,K) sb (E,N)
    ref = torch._grouped_mm(xg.bfloat16(), wg.bfloat16().transpose(-2, -1), offs=offs).float()
    f = lambda: torch._scaled_grouped_mm(a, b.transpose(-2, -1), sa, sb, offs=offs, out_dtype=torch.bfloat16)
    y = f(); t = tm(f)
    return {"err_vs_bf16": relerr(y, ref), "tflops": 2 * E * rows * K * N / t / 1e12}
@item("_scaled_grouped_mm rowwise 2d-2d wgrad (offs over tokens)")
def _():
    T = E * rows
    dy = torch.randn(T, N, device=dev); x = xg
    a, sa = rowq(dy.t().contiguous())  # (N, T) rows scaled over whole T: not per group
    b, sb = rowq(x.t().contiguous())   # (K, T)
    sa_g = sa.repeat(E); sb_g = sb.repeat(E)
    y = torch._scaled_grouped_mm(a, b.t(), sa_g, sb_g, offs=offs, out_dtype=torch.bfloat16)
    return tuple(y.shape)
@item("F.scaled_grouped_mm signature")
def _():
    import inspect
    return str(inspect.signature(F.scaled_grouped_mm)) if hasattr(F, "scaled_grouped_mm") else None
@item("_scaled_grouped_mm blockwise via F.scaled_grouped_mm 1x128x128x128")
def _():
    xa, sxa = q_tiles(xg, 1, 128)
    wq = torch.stack([q_tiles(wg[e], 128, 128)[0] for e in range(E)])
    sw = torch.stack([q_tiles(wg[e], 128, 128)[1] for e in range(E)])
    return tuple(F.scaled_grouped_mm(xa, wq.transpose(-2, -1), sxa.t().contiguous().t(), S.BlockWise1x128, sw.transpose(-2, -1), S.BlockWise128x128, offs=offs, output_dtype=torch.bfloat16).shape)
@item("torch.compile quantise 1x128 (triton)")
def _():
    @torch.compile(fullgraph=True)
    def q(x):
        M, K = x.shape
        xt = x.float().view(M, K // 128, 128)
        s = xt.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448
        return (xt / s).clamp(-448, 448).to(FP8).view(M, K), s.squeeze(-1)
    x = torch.randn(16384, 7168, device=dev, dtype=torch.bfloat16)
    q(x); t = tm(lambda: q(x))
    return {"ms": t * 1e3, "GB/s": x.numel() * 3 / t / 1e9}
@item("nccl world1 a2a + events on side stream")
def _():
    import torch.distributed as dist
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1"); os.environ.setdefault("MASTER_PORT", "29555")
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=dev)
    x = torch.randn(1 << 24, device=dev); y = torch.empty_like(x)
    s = torch.cuda.Stream()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        e0.record(); dist.all_to_all_single(y, x); e1.record()
    torch.cuda.synchronize()
    ok = torch.equal(x, y)
    dist.destroy_process_group()
    return {"equal": ok, "a2a_ms": e0.elapsed_time(e1)}
