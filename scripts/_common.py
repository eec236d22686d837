"""What the benchmarks and tools in ``scripts/`` share (a module, not a script).

* :data:`SHAPES`: the GEMM shapes of Llama-3.1-8B and 70B that every benchmark measures, by
  name (``"8B qkv"``, ...), as ``(N, K)`` of the weight (N output features, K input features);
  :func:`select_shapes` picks a comma-separated subset of them.
* :func:`shape_weights`: one shape's random bf16 weights and their FP4 copies, as many as rotate
  beyond the L2 (cold-L2 timing).
* :func:`stored_winners`: the configs a tuning DB (or export) stores for one problem, by kernel;
  :data:`SHIPPED_DB` is the DB shipped for the H200.
* :func:`results_dir`, :func:`device_slug`: where a benchmark writes its results by default,
  ``docs/results/<device>/`` (e.g. ``docs/results/nvidia-h200/``).
* :func:`provenance`: what a result file records about the run (date, GPU, software versions,
  the command line that reproduces it); :func:`provenance_line` says it in one sentence.
* :func:`interleaved_medians`: CUDA-graph times of several variants in interleaved rounds;
  :func:`measure_copy_bandwidth`: the device copy bandwidth the HBM floors are taken at.
* :func:`require_gpu`, :func:`geomean`, :func:`rel_err`.

Importing it puts the repository root on ``sys.path``, so ``python scripts/<name>.py`` runs
from a checkout without installing the package.
"""
from __future__ import annotations

import dataclasses
import datetime
import math
import re
import shlex
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

SHAPES: dict[str, tuple[int, int]] = {
    "8B qkv": (6144, 4096),
    "8B o": (4096, 4096),
    "8B gate_up": (28672, 4096),
    "8B down": (4096, 14336),
    "70B gate_up": (57344, 8192),
    "70B down": (8192, 28672),
}
SHIPPED_DB = ROOT / "tuning_db" / "nvidia-h200.json"


def select_shapes(names: str = "") -> dict[str, tuple[int, int]]:
    """The shapes named in ``names`` (comma-separated names of :data:`SHAPES`, in that order);
    every shape when empty. Raises ``SystemExit`` on an unknown name."""
    if not names:
        return dict(SHAPES)
    wanted = [s.strip() for s in names.split(",") if s.strip()]
    unknown = [s for s in wanted if s not in SHAPES]
    if unknown:
        raise SystemExit(f"unknown shape(s) {', '.join(unknown)}; known: {', '.join(SHAPES)}")
    return {s: SHAPES[s] for s in SHAPES if s in wanted}


def geomean(xs) -> float:
    xs = list(xs)
    return math.exp(sum(math.log(v) for v in xs) / len(xs)) if xs else float("nan")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error of ``out`` against ``ref``."""
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def device_slug(device: torch.device | str | None = None) -> str:
    """A file-name form of the device's name: ``"nvidia-h200"`` for an NVIDIA H200, ``"cpu"``
    for the CPU."""
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type != "cuda":
        return "cpu"
    return re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(dev).lower()).strip("-")


def results_dir(out: str | Path | None, device: torch.device | str | None = None) -> Path:
    """``out`` if given, else ``docs/results/<device slug>/`` of the repository; created."""
    path = Path(out) if out else ROOT / "docs" / "results" / device_slug(device)
    path.mkdir(parents=True, exist_ok=True)
    return path


def provenance(device: torch.device | str | None = None) -> dict:
    """Date, device, software versions and the command line of this run, for a result file."""
    import importlib.metadata as md

    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    versions = {}
    for pkg in ("autofp4", "nvidia-cutlass-dsl"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            versions[pkg] = None
    script = Path(sys.argv[0])
    try:
        script = script.resolve().relative_to(ROOT)
    except ValueError:
        pass
    return {
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "autofp4": versions["autofp4"],
        "cutlass_dsl": versions["nvidia-cutlass-dsl"],
        "command": shlex.join(["python", str(script), *sys.argv[1:]]),
    }


def provenance_line(doc: dict) -> str:
    """One sentence of a result document's provenance (keys of :func:`provenance`; those
    missing are left out)."""
    soft = ", ".join(f"{name} {doc[key]}" for key, name in (("torch", "torch"), ("cuda", "CUDA"),
                                                            ("cutlass_dsl", "CuTeDSL"), ("autofp4", "autofp4"))
                     if doc.get(key))
    line = f"{doc.get('gpu', '?')}, {doc.get('date', '?')}" + (f" ({soft})" if soft else "") + "."
    if doc.get("command"):
        line += f" Reproduce: `{doc['command']}`."
    return line


def require_gpu(script: str, alternatives: str = "") -> int | None:
    """``None`` when a CUDA GPU is present; else says so on stderr and returns 2 (the exit code)."""
    if torch.cuda.is_available():
        return None
    print(f"{script} needs a CUDA GPU" + (f" (or {alternatives})" if alternatives else ""), file=sys.stderr)
    return 2


def kernel_times(prof) -> dict[str, list]:
    """The GPU kernels a ``torch.profiler`` run saw: ``{name: [total device time in us, calls]}``."""
    out: dict[str, list] = {}
    for e in prof.events():
        if getattr(e, "device_type", None) != torch.autograd.DeviceType.CUDA or not e.device_time:
            continue
        n = out.setdefault(e.name, [0.0, 0])
        n[0] += e.device_time
        n[1] += 1
    return out


def measure_copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write), 1 GiB buffers."""
    from autofp4.timing import time_cuda

    a = torch.randn(2**28, device="cuda")
    b = torch.empty_like(a)
    st = time_cuda(lambda: b.copy_(a), [()], warmup=5, reps=20)
    return 2 * a.numel() * 4 / (st.median_us * 1e-6)


def interleaved_medians(variants: dict, rounds: int, reps: int, warmup: int = 2) -> dict:
    """``{label: us per call}`` of each ``{label: (fn, args_list)}``: the median over ``rounds``
    interleaved rounds (every variant once per round, in order) of the median CUDA-graph time
    (:func:`autofp4.timing.time_cuda`, one graph over every argument set of ``args_list``), so
    that a GPU that drifts during the measurement (clocks, temperature) favours no variant."""
    from autofp4.timing import time_cuda

    times: dict = {t: [] for t in variants}
    for _ in range(rounds):
        for t, (fn, args) in variants.items():
            times[t].append(time_cuda(fn, args, warmup=warmup, reps=reps, use_graph=True).median_us)
    return {t: statistics.median(v) for t, v in times.items()}


def shape_weights(n: int, k: int, fmts: list[str], l2: int, dev: torch.device):
    """One shape's random weights, as many copies as rotate beyond the L2 (``l2`` bytes): the
    generator they came from (seeded by the shape; callers draw their inputs from it next), the
    bf16 copies, and per format the FP4 copies (the bf16 ones quantized, then fresh ones) with the
    FP4 bytes of one copy (values + block scales)."""
    import autofp4
    from autofp4.timing import copies_for_cold_l2

    gen = torch.Generator(device=dev).manual_seed(1234 + n + k)
    nd = copies_for_cold_l2(n * k * 2, l2, max_copies=8)
    dense = [torch.randn(n, k, device=dev, generator=gen, dtype=torch.bfloat16) * 0.02 for _ in range(nd)]
    quantized = {}
    for fmt in fmts:
        ws = [autofp4.quantize(d, fmt) for d in dense]
        fp4_bytes = ws[0].data.numel() + ws[0].scale.numel() * ws[0].scale.element_size()
        while len(ws) < copies_for_cold_l2(fp4_bytes, l2, max_copies=32):
            ws.append(autofp4.quantize(torch.randn(n, k, device=dev, generator=gen, dtype=torch.bfloat16) * 0.02, fmt))
        quantized[fmt] = (ws, fp4_bytes)
    return gen, dense, quantized


def without_pdl(cfg):
    """A kernel config with programmatic dependent launch off (and the decode kernel's early
    trigger with it, which needs it)."""
    off = {f.name: False for f in dataclasses.fields(cfg) if f.name in ("pdl", "pdl_early")}
    return dataclasses.replace(cfg, **off)


def stored_winners(records, kernel: str, fmt: str, n: int, k: int, ms=None, dtype: str = "bfloat16"):
    """``(m_bucket, kernel config)`` of the Hopper winners of ``kernel`` (``"decode"`` or
    ``"gemm"``) that ``records`` (:func:`autofp4.db.read_records`) store for ``(fmt, n, k)``, at
    the M buckets ``ms`` (every bucket when None), with programmatic dependent launch off (as
    cuBLAS runs); a config stored at several buckets once per bucket."""
    from autofp4.backends import get_backend

    backend = get_backend("sm90_w4a16")
    out = []
    for r in records:
        if (r.fmt, r.dtype, r.n, r.k, r.config.get("kernel")) != (fmt, dtype, n, k, kernel):
            continue
        if ms is not None and r.m_bucket not in ms:
            continue
        item = (r.m_bucket, without_pdl(backend.parse_config(r.config)))
        if item not in out:
            out.append(item)
    return out
