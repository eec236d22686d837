import torch, torch.nn.functional as F, statistics, time, sys
import importlib.util
spec = importlib.util.spec_from_file_location('tm', 'autofp4/timing.py'); tm = importlib.util.module_from_spec(spec); sys.modules['tm'] = tm; spec.loader.exec_module(tm)
time_cuda = tm.time_cuda
dev = 'cuda'
n, k, m = 57344, 8192, 16
def t(x, w):
    return time_cuda(F.linear, [(x, w)], warmup=3, reps=10, use_graph=True).median_us
g = torch.Generator(device=dev).manual_seed(1)
w = torch.randn(n, k, device=dev, generator=g, dtype=torch.bfloat16) * 0.02
x = torch.randn(m, k, device=dev, generator=g, dtype=torch.bfloat16)
print("same x, same w:", [round(t(x, w), 1) for _ in range(6)], flush=True)
print("new x each:    ", [round(t(torch.randn(m, k, device=dev, generator=g, dtype=torch.bfloat16), w), 1) for _ in range(6)], flush=True)
res = []
for _ in range(6):
    w2 = torch.randn(n, k, device=dev, generator=g, dtype=torch.bfloat16) * 0.02
    res.append(round(t(x, w2), 1)); del w2
print("new w each:    ", res, flush=True)
keep = [torch.randn(n, k, device=dev, generator=g, dtype=torch.bfloat16) * 0.02 for _ in range(6)]
print("6 live w:      ", [round(t(x, kw), 1) for kw in keep], flush=True)
print("6 live w again:", [round(t(x, kw), 1) for kw in keep], flush=True)
xs = torch.randn(m, k, device=dev, generator=g, dtype=torch.bfloat16)
print("x*0.02 scale:  ", [round(t(xs * s, w), 1) for s in (1.0, 0.02, 10.0)], flush=True)
for mm in (1, 16, 64):
    xx = torch.randn(mm, k, device=dev, generator=g, dtype=torch.bfloat16)
    print(f"M={mm}", [round(t(xx, kw), 1) for kw in keep[:3]], flush=True)
