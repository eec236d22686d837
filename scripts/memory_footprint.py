"""Bytes per weight of each form an FP4 weight takes in memory: the checkpoint layout
(``FP4Weight``: packed E2M1 values, block scales, global scale) and the copy each Hopper kernel
packs for itself on first use (cached on the weight; ``FP4Weight.clear_packed`` drops them).

How: a random N x K weight is quantized and packed by each kernel's ``pack_weight``, and the
bytes of the resulting tensors are counted. Pure torch on the CPU; the numbers do not depend on
the device, so it prints them and writes nothing.

    python scripts/memory_footprint.py --shape 4096x4096
"""
import argparse

import torch
from _common import ROOT  # noqa: F401  (puts the repository root on sys.path)

from autofp4.weights import quantize
from autofp4.kernels import sm90_w4a16_gemm as gemm
from autofp4.kernels import w4a16_decode as decode


def tensor_bytes(*ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if isinstance(t, torch.Tensor))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="4096x4096", help="N x K")
    args = ap.parse_args()
    n, k = (int(v) for v in args.shape.split("x"))
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(0))
    print(f"{'form':28s} {'fmt':6s} {'bytes':>12s} {'bits/weight':>12s}")
    for fmt in ("nvfp4", "mxfp4"):
        fw = quantize(w, fmt)
        d = decode.pack_weight(fw)
        g = gemm.pack_weight(fw)
        forms = {
            "checkpoint (FP4Weight)": fw.nbytes,
            "decode kernel's copy": tensor_bytes(d.data, d.scales, d.alpha),
            "GEMM's copy": tensor_bytes(g.data, g.alpha),
        }
        for name, b in forms.items():
            print(f"{name:28s} {fmt:6s} {b:12d} {8 * b / (n * k):12.3f}")


if __name__ == "__main__":
    main()
