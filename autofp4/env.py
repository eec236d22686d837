"""The environment fingerprint: where a measurement was taken.

A tuning row is only used where its environment matches the running one exactly (same GPU
model and SM count, driver, CUDA, torch, CuTeDSL and autofp4 versions). Everything here is
cached: the fingerprint is read once per device and process.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Annotated, Mapping, TypeVar

import torch
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, Strict, StringConstraints

_NVIDIA_SMI_TIMEOUT_S = 5.0

_T = TypeVar("_T")
_WARNED_ENV: set[tuple[str, str]] = set()


def env_choice(name: str, choices: Mapping[str, _T], default: _T, default_text: str = "") -> _T:
    """The value of the environment variable ``name`` among ``choices`` (its accepted spellings,
    lower case; the value is compared stripped and lower-cased), ``default`` where it is unset or
    empty. Any other value warns (once per variable and value) naming the variable, its value and
    the accepted values, and gives ``default`` (``default_text`` says what that means). Read it
    once (at import, or once per setting) and keep the result: this is not for hot paths."""
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    value = raw.strip().lower()
    if value in choices:
        return choices[value]
    if (name, raw) not in _WARNED_ENV:
        _WARNED_ENV.add((name, raw))
        then = f"; {default_text}" if default_text else ""
        warnings.warn(f"autofp4: {name}={raw!r} ignored: use one of {', '.join(choices)}{then}",
                      RuntimeWarning, stacklevel=3)
    return default

def _printable(text: str) -> str:
    """A text field that reaches terminals (``db show``): control characters refused."""
    bad = sorted({c for c in text if (ord(c) < 0x20 and c != "\t") or 0x7F <= ord(c) < 0xA0})
    if bad:
        raise ValueError(f"holds control characters ({', '.join(repr(c) for c in bad)})")
    return text


_Text = Annotated[str, Strict(), StringConstraints(max_length=256), AfterValidator(_printable)]


def _named(text: str) -> str:
    if not text.strip():
        raise ValueError("is empty; every environment has one (the GPU's name is 'cpu' on the CPU)")
    return text


#: a field every environment has a value for
_Name = Annotated[str, Strict(), StringConstraints(max_length=256), AfterValidator(_printable), AfterValidator(_named)]


class Environment(BaseModel):
    """Where a measurement was taken. Rows are only used where the environment key matches."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    gpu_name: _Name
    sm_count: Annotated[int, Strict(), Field(ge=1, le=2**16)]
    compute_capability: Annotated[str, Strict(), StringConstraints(pattern=r"^(cpu|\d{1,3}\.\d{1,3})$")]
    driver: _Text
    cuda: _Text
    torch: _Name
    cutlass_dsl: _Text = ""
    autofp4: _Name

    def key(self) -> str:
        """A stable 16-hex-character sha256 of all fields (canonical JSON)."""
        text = json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def autofp4_version() -> str:
    """The installed autofp4 version (package metadata, else the source tree's, else unknown)."""
    try:
        return importlib.metadata.version("autofp4")
    except importlib.metadata.PackageNotFoundError:
        pass
    pkg = sys.modules.get(__package__ or "autofp4")
    version = getattr(pkg, "__version__", None)
    if isinstance(version, str) and version:
        return version
    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    try:
        m = re.search(r'^version\s*=\s*"([^"]+)"', pyproject.read_text(), re.MULTILINE)
    except OSError:
        m = None
    return m.group(1) if m else "0+unknown"


@functools.lru_cache(maxsize=None)
def cutlass_dsl_version() -> str:
    """The installed nvidia-cutlass-dsl version, ``""`` if it is not installed."""
    try:
        return importlib.metadata.version("nvidia-cutlass-dsl")
    except importlib.metadata.PackageNotFoundError:
        return ""


@functools.lru_cache(maxsize=None)
def driver_version() -> str:
    """The NVIDIA driver version ("550.54.15"): NVML, else ``nvidia-smi``, else ``"unknown"``."""
    try:
        import pynvml  # type: ignore[import-not-found]

        pynvml.nvmlInit()
        try:
            v = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
        return v.decode() if isinstance(v, bytes) else str(v)
    except Exception:
        pass
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run(
                [smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=_NVIDIA_SMI_TIMEOUT_S,
                check=True,
            ).stdout.strip().splitlines()
            if out and out[0].strip():
                return out[0].strip()
        except (OSError, subprocess.SubprocessError):
            pass
    try:
        # The CUDA driver API version (e.g. 12040) still tells drivers apart coarsely.
        v = int(torch._C._cuda_getDriverVersion())  # type: ignore[attr-defined]
        if v > 0:
            return f"cuda-api-{v // 1000}.{(v % 1000) // 10}"
    except Exception:
        pass
    return "unknown"


def _resolve(device: torch.device | str | None) -> torch.device:
    if device is None:
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"asked for the environment of {dev}, but CUDA is not available")
        return torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)
    return torch.device("cpu")


@functools.lru_cache(maxsize=None)
def _environment_of(device: str) -> Environment:
    dev = torch.device(device)
    common = dict(torch=torch.__version__, cutlass_dsl=cutlass_dsl_version(), autofp4=autofp4_version())
    if dev.type != "cuda":
        return Environment(
            gpu_name="cpu",
            sm_count=max(1, os.cpu_count() or 1),
            compute_capability="cpu",
            driver="",
            cuda="",
            **common,
        )
    props = torch.cuda.get_device_properties(dev)
    return Environment(
        gpu_name=torch.cuda.get_device_name(dev),
        sm_count=int(props.multi_processor_count),
        compute_capability=f"{props.major}.{props.minor}",
        driver=driver_version(),
        cuda=torch.version.cuda or "",
        **common,
    )


def current_environment(device: torch.device | str | None = None) -> Environment:
    """The environment of ``device`` (default: the current CUDA device, else the CPU).

    Non-CUDA devices all map to the CPU environment. Cached per device.
    """
    return _environment_of(str(_resolve(device)))
