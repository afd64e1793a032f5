"""Ad-hoc: the ring's cost of cutting keys into pieces, without communication (one rank)."""
import os, sys, tempfile, torch, torch.distributed as dist
sys.path.insert(0, os.path.join(os.getcwd(), "bench"))
from timing import event_median_ms
import cupy_piecewise
from cupy_piecewise import distributed as cpd
f = tempfile.NamedTemporaryFile(delete=False)
dist.init_process_group("gloo", init_method=f"file://{f.name}x", rank=0, world_size=1)
L, H, D = int(sys.argv[1]), 16, 128
g = torch.Generator("cuda").manual_seed(0)
ins = [torch.randn(1, H, L, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_() for _ in range(5)]
do = torch.randn(1, H, L, D, device="cuda", dtype=torch.bfloat16, generator=g)
def fb(run):
    def f():
        for t in ins: t.grad = None
        run(*ins).backward(do)
    return f
def fw(run):
    def f():
        with torch.no_grad(): run(*ins)
    return f
runs = [("plain", lambda *x: cupy_piecewise.attention(*x, L // 4, causal=True))]
for pc in (1024, 2048, 4096, None):
    runs.append((f"ring@{pc}", lambda *x, pc=pc: cpd.attention(*x, L // 4, causal=True, ring_piece=pc or L)))
for name, run in runs:
    print(f"{name:12s} fwd {event_median_ms(fw(run), 1, 3):7.1f} ms  f+b {event_median_ms(fb(run), 1, 3):7.1f} ms", flush=True)
dist.destroy_process_group()
