"""The ``autofp4`` command: ``tune``, ``db`` and ``info``.

Exit codes: 0 success; 1 some jobs failed with an error; 2 bad input (unknown architecture, a
missing or invalid field of a model config, missing or invalid file, bad option); 130
interrupted (everything measured so far is kept).
"""
from __future__ import annotations

import argparse
import math
import os
import re
import sqlite3
import sys
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Sequence, TextIO

import torch

from .models import LAYOUTS
from .paths import REGULAR, arg_type, kind_of
from .problem import DTYPES, FORMATS, OPS, is_moe
from .weights import missing_device

__all__ = ["main", "build_parser"]


class _UsageError(Exception):
    """Bad command-line input (exit code 2)."""


def _items(text: str, what: str) -> list[str]:
    """The comma-separated items of an option's value (spaces around them dropped); an empty item
    (``1,,2``, a trailing comma, an empty value) is refused, naming the option."""
    items = [t.strip() for t in text.split(",")]
    if not all(items):
        raise argparse.ArgumentTypeError(f"{what} has an empty item in {text!r}")
    return items


def _int_list(text: str, what: str) -> list[int]:
    items = _items(text, what)
    try:
        vals = [int(t) for t in items]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{what} must be comma-separated integers, got {text!r}") from None
    if not vals or any(v < 0 for v in vals):
        raise argparse.ArgumentTypeError(f"{what} must be non-negative integers, got {text!r}")
    return vals


def _m_list(text: str) -> list[int]:
    """``--m``: token counts, each rounded up to the M bucket whose calls it serves (see
    :func:`autofp4.problem.standard_bucket`), in order, without repeats."""
    from .problem import standard_bucket

    vals = _int_list(text, "--m")
    if any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"--m values must be >= 1, got {text!r}")
    return list(dict.fromkeys(standard_bucket(v) for v in vals))


def _int_list_of(what: str, lo: int):
    """An argparse type: comma-separated integers ``>= lo``."""

    def parse(text: str) -> list[int]:
        vals = _int_list(text, what)
        if any(v < lo for v in vals):
            raise argparse.ArgumentTypeError(f"{what} values must be >= {lo}, got {text!r}")
        return vals

    return parse


def _unique(parse):
    """An argparse type: ``parse``'s list with repeats dropped (first occurrence kept)."""

    def unique(text: str) -> list:
        return list(dict.fromkeys(parse(text)))

    return unique


def _gpu_list(text: str) -> list[int]:
    return _int_list(text, "--gpus")


def _devices_list(text: str) -> list[str]:
    """``--devices``: ``all`` (every CUDA GPU), CUDA indices ``0,1,...``, or ``cpu`` entries
    (``cpu,cpu``: processes on the CPU standing in for GPUs)."""
    items = _items(text, "--devices")
    if items == ["all"]:
        return ["all"]
    if items and all(v == "cpu" for v in items):
        return items
    try:
        idx = [int(v) for v in items]
    except ValueError:
        idx = []
    if not idx or min(idx) < 0 or len(set(idx)) != len(idx):
        raise argparse.ArgumentTypeError(
            f"expected 'all', distinct CUDA indices (0,1,...) or cpu entries (cpu,cpu), got {text!r}")
    return [f"cuda:{i}" for i in idx]


def _int_at_least(lo: int, what: str):
    """An argparse type: an int >= ``lo``; ``what`` names it in the error."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"expected {what}, got {v}")
        return v

    return parse


_positive_int = _int_at_least(1, "a positive integer")
_nonneg_int = _int_at_least(0, "an integer >= 0")


def _workers_arg(lo: int):
    """An argparse type: a count of compile processes >= ``lo``, at most 4 per CPU core."""
    base = _int_at_least(lo, "a positive integer" if lo else "an integer >= 0")

    def parse(text: str) -> int:
        from .tuning import args as A

        try:
            return A.workers(base(text), "--workers", lo)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return parse


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return v


def _time_budget(text: str) -> float:
    if text.strip().lower() in ("none", "inf", "unlimited"):
        return math.inf
    return _positive_float(text)


#: the GPU architectures the kernels are compiled for (Hopper, Blackwell)
_ARCHS = ("sm_90a", "sm_100a")
#: the GPU each compiled backend's kernels are built for
_BACKEND_ARCH = {"sm90_w4a16": "sm_90a", "sm90_w4a8": "sm_90a", "sm100_blockscaled": "sm_100a"}
#: backends that run torch ops: nothing of theirs is compiled into the kernel cache
_NOT_COMPILED = ("reference",)

#: ``--act``: the activations the tuned calls run with (FP8: the ``*_fp8`` ops, W4A8)
ACTS = ("fp8",)
LAYERS = ("linear", "moe")
_ACT_HELP = ("{} the shapes as run with FP8 activations (act_dtype='fp8', W4A8: their own problems); "
             "default: the activations as given")
_LM_HEAD_HELP = ("also the lm_head (vocab_size x hidden_size; for a model that runs it in FP4: "
                 "AUTOFP4_VLLM_LM_HEAD=1, quantize_model(..., skip=[]))")
_LAYOUT_HELP = ("whose modules: vllm (fused qkv_proj, gate_up_proj; the default), transformers "
                "(Hugging Face q_proj, k_proj, v_proj, gate_proj, up_proj), or both")


#: ``tune --from-misses`` without a FILE: the misses file next to the user DB (not a string, so
#: that an empty FILE given, as an unset shell variable gives, is refused as one)
_DEFAULT_MISSES = object()


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(
        prog="autofp4", description="FP4 (NVFP4 / MXFP4) kernels tuned for the GPU you have."
    )
    parser.add_argument("--version", action="version", version=f"autofp4 {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{tune,quantize,db,info,cache,explain}")
    sub.required = True

    t = sub.add_parser("tune", help="tune the GEMM / MoE shapes of a model on this GPU")
    t.add_argument("--model", type=arg_type(), metavar="CONFIG", help="Hugging Face config.json (or its folder)")
    t.add_argument("--fmt", choices=FORMATS, help="default nvfp4")
    t.add_argument("--dtype", choices=DTYPES, help="default bfloat16")
    t.add_argument("--m", type=_m_list, metavar="M1,M2,...",
                   help="M buckets (token counts, each rounded up to its power-of-two bucket, at most 8192); "
                        "default 1..8192 on the GPU, 1,16,128 on the CPU")
    t.add_argument("--tp", type=_positive_int, help="tensor-parallel size (default 1)")
    t.add_argument("--ep", type=_positive_int, help="expert-parallel size (default 1)")
    t.add_argument("--layout", choices=LAYOUTS, help=_LAYOUT_HELP)
    t.add_argument("--ops", type=_ops_list, metavar="OP,...", help="only these ops' shapes: linear, moe (default: both)")
    t.add_argument("--lm-head", action="store_true", help=_LM_HEAD_HELP)
    t.add_argument("--act", choices=ACTS, help=_ACT_HELP.format("tune"))
    t.add_argument("--budget", type=_positive_int, metavar="N", help="trials per (shape, M)")
    t.add_argument("--time-budget", type=_time_budget, metavar="SECONDS",
                   help="wall-clock budget of the run, shared fairly by its jobs (default 900 on the GPU; 'none': no limit)")
    t.add_argument("--dry-run", action="store_true", help="print the shapes and the job count, tune nothing")
    t.add_argument("--from-misses", nargs="?", const=_DEFAULT_MISSES, default=None, type=arg_type(True, "misses.json"),
                   metavar="FILE",
                   help="tune what a workload missed (default file: next to the user DB)")
    t.add_argument("--force", action="store_true",
                   help="re-tune jobs that already have a result (the stored winner is tried right after the default)")
    t.add_argument("--devices", type=_devices_list, metavar="all|0,1,...",
                   help="one tuning process per device (all: every GPU; cpu,cpu: CPU processes), one job queue")
    t.add_argument("--gpus", type=_gpu_list, metavar="0,1,...", help="CUDA devices, one job stream (thread) each")
    t.add_argument("--storage", metavar="URL", help="optuna storage shared by cooperating processes (sqlite:///study.db)")
    t.add_argument("--workers", type=_workers_arg(0), metavar="N", help="compile worker processes (0: compile in-process)")
    t.add_argument("--db", metavar="PATH", help="tuning DB file (default: $AUTOFP4_DB or ~/.cache/autofp4/tuning.db)")
    t.add_argument("--backend", action="append", metavar="NAME", help="only this backend (repeatable, or comma-separated)")
    t.add_argument("--device", choices=("cuda", "cpu"), help="where to tune (default: cuda if available, else cpu)")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")

    q = sub.add_parser("quantize", help="write an FP4 checkpoint of a bf16 Hugging Face checkpoint (streamed)")
    q.add_argument("src", type=arg_type(), metavar="HF_MODEL_DIR", help="the checkpoint directory (config.json and safetensors)")
    q.add_argument("--fmt", choices=FORMATS, required=True)
    q.add_argument("--layout", choices=("modelopt", "compressed-tensors", "gpt-oss"),
                   help="the checkpoint layout (default: modelopt for nvfp4, gpt-oss for gpt-oss mxfp4, "
                        "compressed-tensors otherwise)")
    q.add_argument("--out", required=True, type=arg_type(written=True), metavar="DIR", help="the new checkpoint directory")
    q.add_argument("--skip", action="append", default=[], metavar="PATTERN",
                   help="keep the modules matching this glob in high precision (repeatable; lm_head always)")
    q.add_argument("--device", default="cpu", help="where to quantize: cpu (default) or cuda[:N] (faster, same result)")
    q.add_argument("--max-shard-size", default="5GB", metavar="SIZE", help="largest safetensors shard (default 5GB)")
    q.add_argument("--overwrite", action="store_true",
                   help="replace a non-empty --out that holds a previous output (a quantized checkpoint)")
    q.add_argument("--no-progress", action="store_true", help="no progress bar")

    from .cli_db import add_db_parser

    add_db_parser(sub)

    i = sub.add_parser("info", help="device, environment, backends and tuning DB layers")
    i.add_argument("--db", metavar="PATH", help="tuning DB file")
    i.add_argument("--device", help="device to describe (default: cuda if available, else cpu)")

    e = sub.add_parser("explain", help="what the calls of a model's shapes (or of one shape) run here, and why")
    e.add_argument("--model", type=arg_type(), metavar="CONFIG", help="Hugging Face config.json (or its folder): every shape")
    e.add_argument("--op", choices=OPS, help="one shape's op (without --model; default linear)")
    e.add_argument("--n", type=_positive_int, help="one shape: N (a MoE layer: 2 x intermediate)")
    e.add_argument("--k", type=_positive_int, help="one shape: K (a MoE layer: hidden)")
    e.add_argument("--experts", type=_positive_int, help="one MoE shape: experts")
    e.add_argument("--topk", type=_positive_int, help="one MoE shape: experts per token")
    e.add_argument("--fmt", choices=FORMATS, help="default: a checkpoint's own format, else nvfp4")
    e.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    e.add_argument("--m", type=_unique(_int_list_of("--m", 1)), default=[1, 16, 2048], metavar="M1,M2,...",
                   help="token counts (default 1,16,2048; a repeated one is explained once)")
    e.add_argument("--tp", type=_positive_int, help="tensor-parallel size (with --model; default 1)")
    e.add_argument("--ep", type=_positive_int, help="expert-parallel size (with --model; default 1)")
    e.add_argument("--layout", choices=LAYOUTS, help=_LAYOUT_HELP)
    e.add_argument("--ops", type=_ops_list, metavar="OP,...", help="only these ops' shapes: linear, moe (default: both)")
    e.add_argument("--act", choices=ACTS, help=_ACT_HELP.format("explain") + " (with --model)")
    e.add_argument("--db", metavar="PATH", help="tuning DB file (default: $AUTOFP4_DB or ~/.cache/autofp4/tuning.db)")
    e.add_argument("--device", help="the device the calls run on (default: cuda if available, else cpu)")

    c = sub.add_parser("cache", help="the compiled-kernel cache: where it is and what it holds")
    c.add_argument("--clear", action="store_true", help="delete every cached kernel")
    c.add_argument("--export", type=arg_type(True, "kernels.tar.gz", written=True), metavar="FILE", dest="export_to",
                   help="write the cached kernels to an archive that travels with a tuning DB")
    c.add_argument("--import", type=arg_type(True, "kernels.tar.gz"), metavar="FILE", dest="import_from",
                   help="add an archive's kernels to the cache (those this machine's autofp4 and CuTeDSL "
                        "would build the same; the others are listed and left out)")
    c.add_argument("--warm", type=arg_type(), metavar="CONFIG",
                   help="compile the default kernels of a model (a Hugging Face config.json) into the cache")
    c.add_argument("--fmt", choices=FORMATS, help="default nvfp4")
    c.add_argument("--dtype", choices=DTYPES, help="default bfloat16")
    c.add_argument("--m", type=_m_list, metavar="M1,M2,...", help="M buckets (default: the tuner's)")
    c.add_argument("--tp", type=_positive_int, help="tensor-parallel size (default 1)")
    c.add_argument("--ep", type=_positive_int, help="expert-parallel size (default 1)")
    c.add_argument("--layout", choices=LAYOUTS, help=_LAYOUT_HELP)
    c.add_argument("--ops", type=_ops_list, metavar="OP,...", help="only these ops' shapes: linear, moe (default: both)")
    c.add_argument("--lm-head", action="store_true", help=_LM_HEAD_HELP)
    c.add_argument("--act", choices=ACTS, help=_ACT_HELP.format("compile"))
    c.add_argument("--seeds", type=_nonneg_int, metavar="N",
                   help="also each job's first N tuner seeds and the winners other shapes keep at its M (what a tuning run tries first)")
    c.add_argument("--db", metavar="PATH", dest="warm_db",
                   help="also the winners stored in this tuning DB or export (e.g. tuning_db/nvidia-h200.json) "
                        "for the model's jobs: what the dispatcher runs, and what a re-tune tries first")
    c.add_argument("--arch", metavar="SM", help="target GPU, e.g. sm_90a (default: this machine's GPU)")
    c.add_argument("--backend", action="append", metavar="NAME",
                   help="backend(s) to compile for (default: sm90_w4a16)")
    c.add_argument("--workers", type=_workers_arg(1), metavar="N", help="compile processes (default: cores - 1)")
    c.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


# --------------------------------------------------------------------------------------------
# tune
# --------------------------------------------------------------------------------------------
def _backend_names(args: argparse.Namespace) -> list[str] | None:
    if not args.backend:
        return None
    from .backends import backend_names

    names = [n.strip() for item in args.backend for n in item.split(",")]
    if not all(names):
        raise _UsageError(f"--backend has an empty name in {','.join(map(repr, args.backend))}; known: "
                          f"{', '.join(backend_names())}")
    known = backend_names()
    for n in names:
        if n not in known:
            raise _UsageError(f"unknown backend {n!r}; known: {', '.join(known)}")
    return names


def _backends_run_on(names: list[str] | None, device: torch.device) -> None:
    """A usage error naming a ``--backend`` that cannot run on the device ``tune`` would use (a
    dry run says so too, as the run would)."""
    from .backends import get_backend

    for n in names or ():
        why = get_backend(n).unavailable_reason(device)
        if why:
            where = "the CPU" if device.type == "cpu" else "this machine's GPU"
            raise _UsageError(f"--backend {n} cannot run on {where}: {why}")


def _refuse_bad_storage(url: str, db_path: Path) -> None:
    """A usage error for a ``--storage`` URL no study can live at (:func:`.tuning.storage.storage_problem`)."""
    from .tuning.storage import storage_problem

    why = storage_problem(url, db_path, "--storage")
    if why:
        raise _UsageError(why)


def _cmd_tune(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from . import dispatch

    if args.model is None and args.from_misses is None:
        raise _UsageError("tune needs --model CONFIG (a config.json) or --from-misses [FILE]")
    if args.model is not None and args.from_misses is not None:
        raise _UsageError("give either --model or --from-misses, not both")
    _fmt_of_checkpoint(args, args.model)
    _check_dsl_options()
    _model_options(args)
    _options_for(args, _RUN_OPTIONS, not args.dry_run, "a tuning run",
                 "; --dry-run prints the jobs and tunes nothing (leave --dry-run out to tune)")
    backends = _backend_names(args)
    if args.storage:
        from .tuning.claims import claim_ttl_s

        try:
            claim_ttl_s()
        except ValueError as e:
            raise _UsageError(str(e)) from None
    _set_db(args)
    db_path = dispatch.user_db_path()
    if args.storage:
        _refuse_bad_storage(args.storage, db_path)
    on_cpu, cpu_note = _tune_device(args)
    common: dict[str, Any] = dict(
        backends=backends, db=db_path, budget_per_shape=args.budget, budget_total_s=args.time_budget,
        force=args.force, workers=args.workers, progress=not args.no_progress and not args.dry_run,
        gpus=args.gpus, storage=args.storage,
    )
    if args.from_misses is not None:
        return _tune_misses(args, on_cpu, cpu_note, common, db_path, out)
    return _tune_model(args, on_cpu, cpu_note, common, db_path, out, err)


#: the options of ``tune --model`` (and their defaults), which ``--from-misses`` does not take
_MODEL_OPTIONS = {"fmt": "nvfp4", "dtype": "bfloat16", "m": None, "tp": 1, "ep": 1, "layout": "vllm", "ops": None,
                  "lm_head": False, "act": None}
#: the options of ``cache --warm`` (and their defaults)
_WARM_OPTIONS = {**_MODEL_OPTIONS, "seeds": 0, "warm_db": None, "arch": None, "backend": None, "workers": None}
_OPTION_NAMES = {"warm_db": "--db"}
#: the options of ``tune`` that only a run uses (``--dry-run`` tunes nothing)
_RUN_OPTIONS = {"budget": None, "time_budget": None, "force": False, "storage": None, "workers": None, "gpus": None}
#: ``explain``'s options of a model, and of one shape
_EXPLAIN_MODEL = {"tp": 1, "ep": 1, "layout": "vllm", "ops": None, "act": None}
_EXPLAIN_SHAPE = {"op": "linear", "experts": 0, "topk": 0}


def _options_for(args: argparse.Namespace, options: dict, used: bool, goes_with: str, why: str = "") -> None:
    """Where ``used`` (the mode these ``options`` belong to was chosen), their defaults for those
    not given; else a usage error naming those given (an option that would change nothing is not
    ignored silently)."""
    if used:
        for k, default in options.items():
            if getattr(args, k) is None:
                setattr(args, k, default)
        return
    given = [_OPTION_NAMES.get(k, f"--{k.replace('_', '-')}") for k in options
             if getattr(args, k) is not None and getattr(args, k) is not False]  # 0 is given (--workers 0)
    if given:
        raise _UsageError(f"{', '.join(given)} {'goes' if len(given) == 1 else 'go'} with {goes_with}{why}")


def _check_dsl_options() -> None:
    """``$AUTOFP4_CUTE_DSL_OPTIONS`` (extra CuTeDSL options, for inspection) split as CuTeDSL
    splits it (shell words): an unbalanced quote is named before anything compiles."""
    import shlex

    extra = os.environ.get("AUTOFP4_CUTE_DSL_OPTIONS", "")
    try:
        shlex.split(extra)
    except ValueError as e:
        raise _UsageError(f"AUTOFP4_CUTE_DSL_OPTIONS={extra!r:.80}: {e} (CuTeDSL reads it as shell words)") from None


def _fmt_of_checkpoint(args: argparse.Namespace, model: str | None) -> None:
    """``model`` a quantized checkpoint (its folder or its config.json) and ``--fmt`` not given:
    the checkpoint's own format (an MXFP4 checkpoint's shapes are tuned as MXFP4); ``--fmt``
    given and not the checkpoint's: as given, with a note saying so, kept in ``args.fmt_note`` for
    ``_model_shapes`` to print once the model's config has passed its checks (a config refused
    gets its one-line error alone)."""
    if not model:
        return
    from .integrations.checkpoints import checkpoint_fmt_why

    own, why = checkpoint_fmt_why(model)
    if why is not None and args.fmt is None:
        raise _UsageError(f"{_one_line(str(model), 300)} says it is a quantized checkpoint, but its quantization config "
                          f"does not load ({_one_line(why)}); give --fmt nvfp4 or --fmt mxfp4 to take its shapes as "
                          "that format")
    if args.fmt is None:
        args.fmt = own
    elif own is not None and own != args.fmt:
        args.fmt_note = (f"note: {model} is an {own.upper()} checkpoint; its shapes are taken as {args.fmt.upper()} "
                         f"(--fmt {args.fmt}), not as they run when loaded (leave --fmt out for {own})")


def _model_options(args: argparse.Namespace) -> None:
    """With ``--from-misses``, a usage error naming any option of ``--model`` given (each miss is
    tuned as it was called: its format, dtype, M and slice); with ``--model``, their defaults."""
    _options_for(args, _MODEL_OPTIONS, args.from_misses is None, "--model",
                 "; --from-misses tunes each missed call as it was made (its format, dtype, M and expert slice)")


def _device_arg(text: str | None) -> torch.device:
    """``--device``: the device it names (default: the GPU if there is one, else the CPU); a usage
    error for a name torch does not know or a device this machine does not have."""
    try:
        dev = torch.device(text) if text else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    except RuntimeError as e:
        raise _UsageError(f"--device {text}: {_one_line(str(e))}") from None
    if dev.type == "cuda":
        if why := missing_device(dev):
            raise _UsageError(f"--device {text}: {why}")
    elif dev.type != "cpu":
        raise _UsageError(f"--device {text}: autofp4 runs on cuda or cpu")
    return dev


def _set_db(args: argparse.Namespace) -> None:
    """``--db PATH``: the user DB of this command (a ``~user`` that cannot be expanded: exit 2)."""
    if args.db is not None:
        from . import dispatch
        from .db import expand_path

        dispatch._use_db_path(expand_path(args.db, "--db", file=True, written=True, sqlite=True))


def _tune_device(args: argparse.Namespace) -> tuple[bool, str]:
    """``(on_cpu, note)``: whether ``tune`` runs on the CPU, and the line that says why."""
    cuda = torch.cuda.is_available()
    if args.devices and args.gpus:
        raise _UsageError("give --devices or --gpus, not both")
    if args.devices and args.devices[0] != "cpu":
        if not cuda:
            raise _UsageError(f"--devices {','.join(args.devices)} given, but no CUDA GPU is available")
        count = torch.cuda.device_count()
        if args.devices == ["all"]:
            args.devices = [f"cuda:{i}" for i in range(count)]
        bad = [d for d in args.devices if int(d.split(":")[1]) >= count]
        if bad:
            raise _UsageError(f"--devices: {', '.join(bad)} not present ({count} CUDA GPUs)")
        if args.device == "cpu":
            raise _UsageError("--devices with CUDA GPUs and --device cpu contradict each other")
    elif args.devices:
        if args.device == "cuda":
            raise _UsageError(f"--devices {','.join(args.devices)} and --device cuda contradict each other")
        args.device = "cpu"
    if args.gpus and not cuda:
        raise _UsageError(f"--gpus {','.join(map(str, args.gpus))} given, but no CUDA GPU is available")
    if args.device == "cuda" and not cuda:
        raise _UsageError("--device cuda given, but no CUDA GPU is available")
    if args.gpus and args.device == "cpu":
        raise _UsageError("--gpus and --device cpu contradict each other")
    on_cpu = not cuda or args.device == "cpu"
    cpu_note = (
        "no CUDA GPU found: tuning the reference backend on the CPU" if not cuda
        else "--device cpu: tuning the reference backend on the CPU"
    )
    return on_cpu, cpu_note


def _tune_misses(args: argparse.Namespace, on_cpu: bool, cpu_note: str, common: dict[str, Any], db_path: Path,
                 out: TextIO) -> int:
    """``tune --from-misses``: what a workload missed."""
    from . import dispatch, tuning

    path = dispatch.misses_path() if args.from_misses is _DEFAULT_MISSES else Path(args.from_misses)
    try:
        misses = dispatch.load_misses(path)
    except FileNotFoundError:
        raise _UsageError(f"no misses file at {path} (run a workload with autofp4 first)") from None
    except (ValueError, OSError) as e:
        raise _UsageError(str(e)) from None
    _backends_run_on(_backend_names(args), torch.device("cpu" if on_cpu else "cuda"))
    if args.dry_run:
        print(f"{len(misses)} missed (problem, M) pairs in {path}:", file=out)
        for key, m, c in misses:
            extra = f" E={key.experts} topk={key.topk}" if is_moe(key.op) else ""
            print(f"  {key.op} {key.fmt} {key.dtype} N={key.n} K={key.k}{extra} M={m}: {c} calls", file=out)
        return 0
    if on_cpu:
        print(cpu_note, file=out)
    try:
        report = (tuning.tune_from_misses(path, device="cpu" if on_cpu else None, **common) if not args.devices
                  else _on_devices(args, tuning.misses_jobs(path), common))
    except (RuntimeError, ValueError) as e:  # setup: a backend that cannot run here, ...
        raise _UsageError(str(e)) from None
    return _finish(report, db_path, out)


def _tune_model(args: argparse.Namespace, on_cpu: bool, cpu_note: str, common: dict[str, Any], db_path: Path,
                out: TextIO, err: TextIO) -> int:
    """``tune --model CONFIG``: every (shape, M bucket) of a model."""
    from . import dispatch, tuning
    from .models import shapes_table

    shapes = _model_shapes(args.model, args, err)
    _check_backends_serve(_backend_names(args), shapes)
    _backends_run_on(_backend_names(args), torch.device("cpu" if on_cpu else "cuda"))
    if args.m:
        ms = sorted(set(args.m))
    else:
        ms = list(dispatch.DEFAULT_M_BUCKETS if not on_cpu else tuning.CPU_M_BUCKETS)
    jobs = tuning.jobs_for(shapes, ms, args.fmt, args.dtype)
    if args.dry_run:
        out.write(shapes_table(shapes))
        print(
            f"\n{len(shapes)} shapes x {len(ms)} M buckets ({','.join(map(str, ms))}) = {len(jobs)} (shape, M) jobs"
            f"  [{args.fmt}, {args.dtype}, tp={args.tp}, ep={args.ep}, layout={args.layout}, device={'cpu' if on_cpu else 'cuda'}]",
            file=out,
        )
        return 0
    if on_cpu:
        print(cpu_note, file=out)
    print(f"tuning {len(jobs)} (shape, M) jobs into {db_path}", file=out)
    try:
        report = (tuning.tune_jobs(jobs, device="cpu" if on_cpu else None, **common) if not args.devices
                  else _on_devices(args, jobs, common))
    except (RuntimeError, ValueError) as e:  # setup: a backend that cannot run here, ...
        raise _UsageError(str(e)) from None
    return _finish(report, db_path, out)


def _on_devices(args: argparse.Namespace, jobs: list[Any], common: dict[str, Any]) -> Any:
    """``--devices``: one tuning process per device, all on one job queue (:mod:`.tuning.fleet`)."""
    from .tuning.fleet import tune_on_devices

    kw = {k: v for k, v in common.items() if k not in ("gpus", "progress")}
    return tune_on_devices(jobs, args.devices, progress=common["progress"], **kw)


def _one_line(text: str, limit: int = 1000) -> str:
    """``text`` on one line (newlines shown as ``\\n``), cut to ``limit`` characters."""
    text = text.replace("\r", "\\r").replace("\n", "\\n")
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


def _ops_list(text: str) -> tuple[str, ...]:
    """``--ops``: a comma-separated subset of the layer kinds (``--act fp8`` picks their FP8 ops)."""
    ops = tuple(dict.fromkeys(_items(text, "--ops")))
    bad = [o for o in ops if o not in LAYERS]
    if not ops or bad:
        hint = "; for FP8 activations add --act fp8" if any(o in OPS for o in bad) else ""
        raise argparse.ArgumentTypeError(f"ops must be a comma-separated subset of {', '.join(LAYERS)}, "
                                         f"got {text!r}{hint}")
    return ops


def _check_backends_serve(backends: list[str] | None, shapes: Sequence[Any]) -> None:
    """Each ``--backend`` named runs some op of ``shapes`` (``--act fp8``: the ``*_fp8`` ops, which
    the W4A16 and W4A4 backends do not run; without it the ops that ``sm90_w4a8`` does not run)."""
    if not backends:
        return
    from .backends import get_backend

    ops = sorted({s.op for s in shapes})
    for name in backends:
        served = get_backend(name).ops
        if not served & set(ops):
            hint = ("; drop --act fp8 for it" if all(o.endswith("_fp8") for o in ops)
                    else "; add --act fp8 for it" if all(o.endswith("_fp8") for o in served) else "")
            raise _UsageError(f"--backend {name} runs {', '.join(sorted(served))}, none of these shapes' "
                              f"ops ({', '.join(ops)}){hint}")


def _model_shapes(path: str, args: argparse.Namespace, err: TextIO) -> list[Any]:
    """The shapes of the model config at ``path`` for ``args.tp``, ``args.ep``, ``args.fmt``,
    ``args.layout`` and ``args.lm_head``;
    any problem with the file or a field of it is a usage error (exit 2) of one line. The note of
    ``_fmt_of_checkpoint`` (if any) goes to ``err`` once the shapes are read."""
    from .models import load_config, model_shapes

    try:
        config = load_config(path)
    except FileNotFoundError as e:
        raise _UsageError(_one_line(str(e))) from None
    except (ValueError, TypeError, OSError) as e:  # the message names the file, or is prefixed with it
        msg = str(e) if str(path) in str(e) else f"cannot read {_one_line(str(path), 300)}: {e}"
        raise _UsageError(_one_line(msg)) from None
    try:
        shapes = model_shapes(config, tp=args.tp, ep=args.ep, fmt=args.fmt,
                              layout=getattr(args, "layout", "vllm"), include_lm_head=getattr(args, "lm_head", False),
                              act=getattr(args, "act", None))
    except (ValueError, TypeError) as e:
        raise _UsageError(f"{_one_line(str(path), 300)}: {_one_line(str(e))}") from None
    has_moe = any(is_moe(s.op) for s in shapes)
    ops = getattr(args, "ops", None)
    if ops:
        shapes = [s for s in shapes if ("moe" if is_moe(s.op) else "linear") in ops]
        if not shapes:
            raise _UsageError(f"{_one_line(str(path), 300)} has no {' or '.join(ops)} shapes")
        if getattr(args, "lm_head", False) and "linear" not in ops:
            raise _UsageError(f"--lm-head adds the lm_head's linear shape, which --ops {','.join(ops)} leaves out")
    if args.ep is not None and args.ep > 1 and not any(is_moe(s.op) for s in shapes):
        raise _UsageError(f"--ep {args.ep} splits the experts of MoE layers, and " + (
            f"--ops {','.join(ops)} leaves them out" if has_moe else f"{_one_line(str(path), 300)} has none"))
    if note := getattr(args, "fmt_note", None):
        print(note, file=err)
    return shapes


def _finish(report: Any, db_path: Path, out: TextIO) -> int:
    out.write(report.table())
    tuned = len(report.tuned)
    skipped = sum(1 for r in report.results if r.status == "skipped")
    kept = sum(1 for r in report.results if r.status == "kept")
    errors = [r for r in report.results if r.status == "error"]
    kept_note = f"{kept} kept their stored winner (no time to measure it again), " if kept else ""
    print(
        f"\n{tuned} tuned, {skipped} already tuned (use --force to re-tune), {kept_note}"
        f"{len(report.results) - tuned - skipped - kept} other; {report.trials_run} trials "
        f"({report.trials_failed} failed) in {report.elapsed_s:.1f} s on {report.device}; DB: {db_path}",
        file=out,
    )
    for r in errors:
        print(f"error: {r.job.key} M={r.job.m}: {r.note}", file=out)
    if report.interrupted:
        print("interrupted: every trial and result measured so far is stored; run again to resume", file=out)
        return 130
    return 1 if errors else 0


# --------------------------------------------------------------------------------------------
# explain
# --------------------------------------------------------------------------------------------
def _cmd_explain(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """``autofp4 explain``: what a call of each shape (a model's, or the one given) at each M
    runs on the device, and why (the tuned row and its DB layer, or the default)."""
    from . import dispatch
    from .problem import ProblemKey, shape_errors

    _set_db(args)
    if args.model is not None and (args.n is not None or args.k is not None):
        raise _UsageError("give --model or one shape (--n, --k), not both")
    _fmt_of_checkpoint(args, args.model)
    if args.fmt is None:
        args.fmt = "nvfp4"
    _options_for(args, _EXPLAIN_MODEL, args.model is not None, "--model", " (one shape is explained as given)")
    _options_for(args, _EXPLAIN_SHAPE, args.model is None, "one shape (--n, --k)", "; --model takes each shape's own")
    if args.model is not None:
        keys = [(s.problem_key(args.fmt, args.dtype), s.name) for s in _model_shapes(args.model, args, err)]
    else:
        if args.n is None or args.k is None:
            raise _UsageError("explain needs --model CONFIG, or one shape: --n N --k K (a MoE one also "
                              "--op moe --experts E --topk K)")
        try:
            keys = [(ProblemKey(args.op, args.fmt, args.dtype, args.n, args.k, args.experts, args.topk), "")]
        except ValueError as e:
            raise _UsageError(str(e)) from None
        bad = shape_errors(args.op, args.fmt, args.n, args.k)
        if bad:
            raise _UsageError("; ".join(f"--{f}: {why}" for f, why in bad.items()))
    dev = _device_arg(args.device)
    try:
        d = dispatch.get_dispatcher(dev)
    except (RuntimeError, ValueError) as e:
        raise _UsageError(f"--device {args.device}: {e}") from None
    for key, name in dict.fromkeys(keys):
        for m in args.m:
            print(f"{name + ': ' if name else ''}{d.explain(key, m)}", file=out)
    return 0


# --------------------------------------------------------------------------------------------
# info
# --------------------------------------------------------------------------------------------
def _cmd_info(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from . import dispatch
    from .backends import backend_names, get_backend
    from .db import TuningDB, TuningDBError, read_export, shipped_db_dir, shipped_db_files
    from .env import current_environment

    _set_db(args)
    dev = _device_arg(args.device)
    env = current_environment(dev)
    key = env.key()
    print(f"device:        {dev}", file=out)
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        print(f"gpu:           {p.name}, {p.multi_processor_count} SMs, compute capability {p.major}.{p.minor}, "
              f"{p.total_memory / 2**30:.1f} GiB, L2 {getattr(p, 'L2_cache_size', 0) / 2**20:.0f} MiB", file=out)
    else:
        print(f"gpu:           none (CUDA available: {torch.cuda.is_available()}); {os.cpu_count()} CPU cores", file=out)
    print(f"environment:   {key}", file=out)
    for field, value in env.model_dump().items():
        print(f"  {field + ':':20} {value}", file=out)
    print("backends:", file=out)
    for name in backend_names():
        try:
            b = get_backend(name)
            why = b.unavailable_reason(dev)
        except Exception as e:  # an optional package missing, a broken import
            why = f"cannot be imported: {type(e).__name__}: {e}"
        print(f"  {name:20} {'applies' if why is None else 'does not apply: ' + why}", file=out)
    def notes(records) -> str:
        jit = sum(r.origin == "jit" for r in records)
        old = sum(dispatch.row_is_stale(r) for r in records)
        return ((f", {jit} tuned just-in-time" if jit else "")
                + (f", {old} measured with an older kernel source (not used; tune again)" if old else ""))

    print("tuning DB layers (rows for this environment / all rows):", file=out)
    user = dispatch.user_db_path()
    kind = kind_of(user)
    if kind == REGULAR:
        try:
            with TuningDB(user, readonly=True) as db:
                mine = len(db.results(key))
                total = db.counts()["results"]
                more = notes(db.results())
            print(f"  user     {user}: {mine} / {total}{more}", file=out)
        except (TuningDBError, OSError, sqlite3.Error) as e:
            print(f"  user     {user}: unreadable ({e})", file=out)
    elif kind == "a directory":
        print(f"  user     {user}: unusable (a directory, not a tuning database file)", file=out)
    elif kind is not None:
        print(f"  user     {user}: unusable ({kind}, not a tuning database file)", file=out)
    else:
        print(f"  user     {user}: (not created yet)", file=out)
    shipped = shipped_db_dir()
    files = shipped_db_files()
    if not files:
        why = ("no *.json files" if shipped.is_dir() else "no such file or folder" if not shipped.exists()
               else "not a regular file or folder")
        print(f"  shipped  {shipped}: {why}", file=out)
    for f in files:
        try:
            doc = read_export(f)
            mine = sum(1 for r in doc.records if r.env_key == key)
            print(f"  shipped  {f}: {mine} / {len(doc.records)}{notes(doc.records)}", file=out)
        except Exception as e:  # report, never fail `info`
            print(f"  shipped  {f}: unreadable ({str(e).splitlines()[0] if str(e) else type(e).__name__})", file=out)
    misses = dispatch.misses_path()
    if misses.is_file():
        print(f"misses file:   {misses}", file=out)
    print(f"kernel cache:  {_cache_line()}", file=out)
    from .pdl import pdl_enabled

    print("dependent launch: " + ("on where a config asks for it (AUTOFP4_PDL=0 turns it off)" if pdl_enabled()
                                  else "off (AUTOFP4_PDL=0 or autofp4.set_pdl(False))"), file=out)
    return 0


def _cache_line() -> str:
    from .kernel_cache import cache_dir_problem, disabled_by, summary

    d, n, size = summary()
    if d is None:
        return f"disabled ({disabled_by()}): every process compiles its kernels"
    why = cache_dir_problem(d)
    if why is not None:
        return f"unusable: {why}; every process compiles its kernels"
    return f"{d}: {n} compiled kernel{'s' if n != 1 else ''}, {size / 2**20:.1f} MiB"


def _cmd_cache(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from .kernel_cache import cache_dir, cache_dir_problem, clear, others

    _fmt_of_checkpoint(args, args.warm)
    _options_for(args, _WARM_OPTIONS, args.warm is not None, "--warm CONFIG")

    try:
        d = cache_dir()
    except ValueError as e:
        raise _UsageError(str(e)) from None
    why = cache_dir_problem(d) if d is not None else None
    if why is not None:
        raise _UsageError(why)

    if args.clear and (args.import_from or args.export_to):
        raise _UsageError(f"--clear with --{'export' if args.export_to else 'import'}: clearing would come first "
                          "and leave an export nothing to write (or an import's old kernels gone); run them one "
                          "at a time")
    # everything checked before the first action: a usage error leaves the cache as it was
    warm = _warm_plan(args, err) if args.warm else None
    if args.export_to:
        from .kernel_cache import KernelArchiveError, check_export_target

        try:
            check_export_target(args.export_to)
        except KernelArchiveError as e:
            raise _UsageError(str(e)) from None
    if args.clear:
        print(f"removed {clear()} compiled kernels", file=out)
        left = others()
        if left:
            names = ", ".join(p.name for p in left[:3]) + (", ..." if len(left) > 3 else "")
            print(f"left {len(left)} other file{'s' if len(left) != 1 else ''} in {d} that are not autofp4 "
                  f"kernels ({names})", file=out)
    rc = 0
    if args.import_from:
        _archive(args.import_from, None, out, err)
    if warm is not None:  # before the export, which then holds what it compiled
        rc = _warm(warm, args, out, err)
    if args.export_to:
        _archive(None, args.export_to, out, err)
    print(f"kernel cache: {_cache_line()}", file=out)
    return rc


def _archive(import_from: str | None, export_to: str | None, out: TextIO, err: TextIO) -> None:
    """``cache --import FILE`` or ``cache --export FILE``."""
    from .kernel_cache import KernelArchiveError, export_archive, import_archive

    def left_out(skipped: list[tuple[str, str]]) -> None:
        for name, why in skipped[:10]:
            print(f"  left out {name}: {why}", file=err)
        if len(skipped) > 10:
            print(f"  ... and {len(skipped) - 10} more", file=err)

    try:
        if import_from:
            r = import_archive(import_from)
            print(f"imported {r.kernels} kernels ({r.bytes / 2**20:.1f} MiB) from {import_from}; "
                  f"{r.present} already cached, {len(r.skipped)} left out", file=out)
            left_out(r.skipped)
        if export_to:
            r = export_archive(export_to)
            print(f"exported {r.kernels} kernels to {export_to} ({r.bytes / 2**20:.1f} MiB); "
                  f"{len(r.skipped)} left out", file=out)
            left_out(r.skipped)
    except KernelArchiveError as e:
        raise _UsageError(str(e)) from None


@dataclass(frozen=True)
class _WarmPlan:
    """What ``cache --warm`` compiles, checked before the command acts."""
    arch: str
    jobs: list
    backends: list[str]
    stored: list


def _warm_plan(args: argparse.Namespace, err: TextIO) -> _WarmPlan:
    from . import dispatch, tuning
    from .kernel_cache import cache_dir, disabled_by, target_arch

    if cache_dir() is None:
        raise _UsageError(f"the kernel cache is disabled ({disabled_by()}): nothing to warm")
    if os.environ.get("AUTOFP4_CUTE_DSL_OPTIONS", "").strip():
        raise _UsageError("AUTOFP4_CUTE_DSL_OPTIONS is set: kernels compiled with extra CuTeDSL options bypass the "
                          "kernel cache (they are for inspection), so --warm would cache nothing; unset it")
    if args.arch is not None and not args.arch.strip():
        raise _UsageError(f"--arch {args.arch!r} is empty: name the target ({', '.join(_ARCHS)}), or leave --arch "
                          "out for this machine's GPU")
    arch = args.arch or target_arch()  # $CUTE_DSL_ARCH, else this machine's GPU
    if arch == "unknown":
        raise _UsageError("no CUDA GPU here: name the target with --arch (e.g. sm_90a)")
    if not re.fullmatch(r"sm_\d+[af]?", arch):
        raise _UsageError(f"--arch must look like sm_90a, got {arch!r}")
    if arch not in _ARCHS:
        raise _UsageError(f"--arch {arch}: the kernels are built for {', '.join(_ARCHS)}")
    shapes = _model_shapes(args.warm, args, err)
    stored = []
    if args.warm_db is not None:
        from .db import TuningDBError, TuningFileError, expand_path, read_records

        try:
            stored = read_records(expand_path(args.warm_db, "--db", file=True))[1]
        except (TuningDBError, TuningFileError, OSError) as e:
            raise _UsageError(f"cannot read the tuning DB {args.warm_db}: {e}") from None
    backends = _backend_names(args) or ["sm90_w4a8" if args.act else "sm90_w4a16"]
    _check_backends_serve(backends, shapes)
    other = [n for n in backends if _BACKEND_ARCH.get(n, arch) != arch]
    if other:
        raise _UsageError(f"--backend {other[0]} builds kernels for {_BACKEND_ARCH[other[0]]}, not for --arch {arch}")
    torch_only = [n for n in backends if n in _NOT_COMPILED]
    if torch_only:
        raise _UsageError(f"--backend {torch_only[0]}: the {torch_only[0]} backend runs torch ops and compiles no "
                          "kernels, so it has nothing to put in the kernel cache (warm sm90_w4a16 or "
                          "sm100_blockscaled)")
    ms = sorted(set(args.m)) if args.m else list(dispatch.DEFAULT_M_BUCKETS)
    return _WarmPlan(arch, tuning.jobs_for(shapes, ms, args.fmt, args.dtype), backends, stored)


def _warm(plan: _WarmPlan, args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from . import tuning

    arch, jobs = plan.arch, plan.jobs
    workers = args.workers or max(1, (os.cpu_count() or 2) - 1)
    try:
        report = tuning.warm_kernel_cache(jobs, plan.backends, seeds=args.seeds, workers=workers, arch=arch,
                                          progress=not args.no_progress, stored=plan.stored)
    except KeyError as e:
        raise _UsageError(f"unknown backend {e}") from None
    print(f"compiled {report.compiled} kernel configs for {arch} ({len(jobs)} (shape, M) jobs, "
          f"{args.fmt}, {args.dtype}) in {report.seconds:.0f} s", file=out)
    for cfg, e in report.failed:
        print(f"  failed: {cfg}: {e}", file=err)
    return 1 if report.failed else 0


# --------------------------------------------------------------------------------------------
# quantize
# --------------------------------------------------------------------------------------------
def _cmd_quantize(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from .integrations.quantize_checkpoint import quantize_checkpoint
    from .integrations.safetensors_io import parse_size

    try:
        parse_size(args.max_shard_size, "--max-shard-size")
    except ValueError as e:
        raise _UsageError(str(e)) from None
    import signal
    import threading

    def on_term(signum, frame):  # a job scheduler's stop: cleaned up as an interrupt is
        raise KeyboardInterrupt

    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, on_term) if main_thread else None
    try:
        summary = quantize_checkpoint(args.src, args.out, args.fmt, args.layout,
                                      skip=["lm_head", "*.lm_head", *args.skip], device=args.device,
                                      max_shard_size=args.max_shard_size, overwrite=args.overwrite,
                                      progress=not args.no_progress, stream=err)
    except (ValueError, TypeError, OSError, RuntimeError) as e:
        print(f"error: {e}", file=err)
        return 2
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
    print(summary, file=out)
    print(f"  report: {summary.out / 'quantization_report.json'}", file=out)
    return 0


# --------------------------------------------------------------------------------------------
# entry point
# --------------------------------------------------------------------------------------------
class _OutputError(Exception):
    """Writing the command's standard output failed (a full disk, a closed descriptor)."""


class _Output:
    """A command's standard output whose write errors are :class:`_OutputError` (told apart
    from the errors of the files a command reads and writes)."""

    def __init__(self, f: TextIO) -> None:
        self._f = f

    def write(self, text: str) -> int:
        try:
            return self._f.write(text)
        except OSError as e:
            raise _OutputError(e) from None

    def flush(self) -> None:
        try:
            self._f.flush()
        except OSError as e:
            raise _OutputError(e) from None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


def main(argv: Sequence[str] | None = None, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Run the ``autofp4`` command line; returns the exit code."""
    if out is None and sys.stdout is None:  # started with standard output closed (>&-)
        if sys.stderr is not None:
            print("error: standard output is closed; nothing done (discard it with >/dev/null instead)",
                  file=sys.stderr)
        return 2
    out = _Output(out or sys.stdout)
    err = err or sys.stderr
    parser = build_parser()
    try:
        args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as e:  # argparse: --help (0) or a usage error (2)
        return int(e.code or 0) if isinstance(e.code, int) else 2
    try:
        if args.command == "tune":
            return _cmd_tune(args, out, err)
        if args.command == "info":
            return _cmd_info(args, out, err)
        if args.command == "cache":
            return _cmd_cache(args, out, err)
        if args.command == "explain":
            return _cmd_explain(args, out, err)
        if args.command == "quantize":
            return _cmd_quantize(args, out, err)
        if args.command == "db":
            from .cli_db import run_db

            return run_db(args, out, err)
    except _UsageError as e:
        print(f"error: {e}", file=err)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=err)
        return 130
    except _OutputError as e:
        if isinstance(e.args[0], BrokenPipeError):  # a reader that stopped early (| head)
            return 141
        print(f"error: cannot write to standard output: {e.args[0]}", file=err)
        return 1
    except Exception as e:
        from .db import TuningDBError

        if isinstance(e, TuningDBError):
            print(f"error: {e}", file=err)
            return 2
        if isinstance(e, sqlite3.Error) and args.command in ("tune", "info"):
            from .dispatch import user_db_path

            print(f"error: tuning database {user_db_path()}: {e}", file=err)
            return 2
        raise
    parser.error(f"unknown command {args.command!r}")
    return 2
