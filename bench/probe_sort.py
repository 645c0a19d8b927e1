"""The MoE dispatch's argsort of expert ids, by key dtype (session 17): one CUDA-graph replay of 50 sorts, per call.
    python bench/probe_sort.py"""
import torch
torch.manual_seed(0)
for n in (24576, 384):
    ids = torch.randint(0, 64, (n,), device="cuda")
    for name, k in (("int64", ids), ("uint8", ids.to(torch.uint8)), ("int32", ids.to(torch.int32))):
        o = k.argsort(stable=True)
        assert torch.equal(o, ids.argsort(stable=True))
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(50):
                k.argsort(stable=True)
        g.replay(); torch.cuda.synchronize()
        e0.record()
        for _ in range(10):
            g.replay()
        e1.record(); torch.cuda.synchronize()
        print(f"argsort(stable) of {n} expert ids as {name}: {e0.elapsed_time(e1) / 500 * 1e3:.1f} us a call (CUDA graph)")
