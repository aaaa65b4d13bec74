"""FlashInfer 0.5.3 decode with an FP8 (E4M3) paged KV cache against its bf16 one, on Turbo's decode
bench shapes (GQA 32/8, d 128, pages of 16): batch 64 at 4k keys, batch 1 at 16k and 32k. 32 calls over
distinct caches in one CUDA graph (cold L2), median replay per call. FlashInfer's FP8 cache has no
per-token scales (one scale per tensor, passed at run time), so it reads d bytes per (token, KV head).
Usage on the GPU machine, with FlashInfer installed as ../shared/peers/flashinfer/README.md says:
    PYTHONPATH=/tmp/site python3 benches/peers/flashinfer_kv8.py"""
import torch, flashinfer

dev = "cuda"
ws = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
N = 32


def graph_time(fns, reps=20):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns[:2]:
            f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    g.replay(); torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True); b = torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / len(fns))
    ts.sort()
    return ts[len(ts) // 2]


def decode(batch, ctx, kv_dtype, heads=32, kv_heads=8, d=128, bs=16):
    pages = ctx // bs
    total = batch * pages
    esize = 1 if kv_dtype != torch.bfloat16 else 2
    copies = max(1, min(N, (64 << 20) // (2 * total * bs * kv_heads * d * esize) + 1))
    caches = [torch.randn(total, 2, bs, kv_heads, d, dtype=torch.bfloat16, device=dev).to(kv_dtype) for _ in range(copies)]
    indptr = torch.arange(0, batch + 1, dtype=torch.int32, device=dev) * pages
    indices = torch.arange(total, dtype=torch.int32, device=dev)
    last = torch.full((batch,), bs, dtype=torch.int32, device=dev)
    q = torch.randn(batch, heads, d, dtype=torch.bfloat16, device=dev)
    out = torch.empty_like(q)
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
    w.plan(indptr, indices, last, heads, kv_heads, d, bs, q_data_type=torch.bfloat16, kv_data_type=kv_dtype)
    if kv_dtype == torch.bfloat16:
        fns = [(lambda c=c: w.run(q, c, out=out)) for c in (caches * N)[:N]]
    else:
        fns = [(lambda c=c: w.run(q, c, out=out, k_scale=0.01, v_scale=0.01)) for c in (caches * N)[:N]]
    us = graph_time(fns)
    kv_bytes = 2 * batch * ctx * kv_heads * d * esize
    print(f"flashinfer decode b{batch} ctx{ctx} {str(kv_dtype).split('.')[-1]}: {us:.1f} us = {kv_bytes / us / 1e6:.2f} TB/s", flush=True)


print("flashinfer", flashinfer.__version__, torch.cuda.get_device_name(0), flush=True)
for dt in (torch.bfloat16, torch.float8_e4m3fn):
    for b, ctx in ((64, 4096), (1, 16384), (1, 32768)):
        try:
            decode(b, ctx, dt)
        except Exception as e:
            print(f"flashinfer decode b{b} ctx{ctx} {dt}: failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
