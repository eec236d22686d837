import torch, torch.nn.functional as F, sys, importlib.util
spec = importlib.util.spec_from_file_location('tm', 'autofp4/timing.py'); tm = importlib.util.module_from_spec(spec); sys.modules['tm'] = tm; spec.loader.exec_module(tm)
time_cuda = tm.time_cuda
dev = 'cuda'; n, k = 57344, 8192
g = torch.Generator(device=dev).manual_seed(1)
w = torch.randn(n, k, device=dev, generator=g, dtype=torch.bfloat16) * 0.02
x = torch.randn(16, k, device=dev, generator=g, dtype=torch.bfloat16)
t = lambda: round(time_cuda(F.linear, [(x, w)], warmup=3, reps=10, use_graph=True).median_us, 1)
print("alone:", [t() for _ in range(4)], flush=True)
bufs = [torch.randint(0, 255, (264 * 2**20,), device=dev, dtype=torch.uint8, generator=g) for _ in range(32)]
out = torch.empty_like(bufs[0])
def sweep():
    for b in bufs: out.copy_(b)
res = []
for _ in range(4):
    sweep(); torch.cuda.synchronize(); res.append(t())
print("after an 8.4-GB sweep over 32 buffers:", res, flush=True)
big = [torch.empty(4 * 2**30, device=dev, dtype=torch.uint8) for _ in range(12)]
res = []
for _ in range(4):
    sweep(); torch.cuda.synchronize(); res.append(t())
print("with 48 GB more allocated, after a sweep:", res, flush=True)
w2 = torch.randn(n, k, device=dev, generator=g, dtype=torch.bfloat16) * 0.02
t2 = lambda: round(time_cuda(F.linear, [(x, w2)], warmup=3, reps=10, use_graph=True).median_us, 1)
print("a weight allocated after 48 GB:", [t2() for _ in range(4)], flush=True)
