"""A disk cache of compiled CuTeDSL kernels.

Compiling one kernel configuration takes 0.5-1.5 s; loading its object file takes milliseconds.
Every compile goes through :func:`compile_cached`, which exports the compiled function (a
TVM-FFI entry point with the GPU binary embedded) to ``<dir>/<name>-<hash>.o`` and loads it back;
later calls, in this process or any other (a tuner's compile workers, the next start of an
inference server), load the file instead of compiling.

The file name hashes everything the binary depends on: the kernel's name and parameters (config,
shape, format, dtype, ...), the code of the module that builds it (without its comments and
docstrings, see :func:`code_only`), the CuTeDSL version and the target architecture. Files are
written to a temporary name and renamed, so a crash or two processes compiling the same kernel
never leave a partial file; a file that fails to load is deleted and the kernel compiled again.

``$AUTOFP4_KERNEL_CACHE`` names the directory (default ``$XDG_CACHE_HOME/autofp4/kernels``);
``off`` (or ``0``) disables the cache: every call compiles.
"""
from __future__ import annotations

import ast
import functools
import hashlib
import inspect
import io
import os
import tempfile
import tokenize
import warnings
from pathlib import Path
from typing import Any, Callable

from .env import cutlass_dsl_version

_OFF = ("off", "0", "false", "no")


def cache_dir() -> Path | None:
    """The cache directory, or ``None`` when the cache is disabled."""
    env = os.environ.get("AUTOFP4_KERNEL_CACHE")
    if env is not None:
        return None if env.strip().lower() in _OFF or not env.strip() else Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "autofp4" / "kernels"


def code_only(source: str) -> str:
    """``source`` without its comments, docstrings, blank lines and trailing spaces: the part of a
    kernel's source that its hashes cover, so that editing prose neither retires tuned rows nor
    recompiles cached kernels. Docstring lines come from ``ast``, comment columns from
    ``tokenize``; both agree across Python versions, and the kept text is the file's own."""
    docs: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) or not body:
            continue
        first = body[0]
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
            shares_line = len(body) > 1 and body[1].lineno == first.end_lineno
            if not shares_line:
                docs.update(range(first.lineno, first.end_lineno + 1))
    cut = {tok.start[0]: tok.start[1] for tok in tokenize.generate_tokens(io.StringIO(source).readline)
           if tok.type == tokenize.COMMENT}
    lines = []
    for i, line in enumerate(source.splitlines(), 1):
        if i in docs:
            continue
        line = line[:cut.get(i, len(line))].rstrip()
        if line:
            lines.append(line)
    return "\n".join(lines)


def kernel_source(module_name: str) -> str:
    """The code (:func:`code_only`) of a kernel module followed by that of the helper modules it
    names in ``KERNEL_SOURCES`` (read from their files, so helpers that need CuTeDSL are not
    imported)."""
    import importlib
    import importlib.util

    mod = importlib.import_module(module_name)
    parts = [code_only(inspect.getsource(mod))]
    for dep in getattr(mod, "KERNEL_SOURCES", ()):
        spec = importlib.util.find_spec(dep)
        if spec is None or spec.origin is None:
            raise ImportError(f"{module_name} names a kernel source {dep!r} that cannot be found")
        parts.append(code_only(Path(spec.origin).read_text()))
    return "\n".join(parts)


@functools.lru_cache(maxsize=None)
def _module_source_hash(module_name: str) -> str:
    return hashlib.sha256(kernel_source(module_name).encode()).hexdigest()


@functools.lru_cache(maxsize=None)
def target_arch() -> str:
    """The architecture the compiler targets: ``$CUTE_DSL_ARCH``, else the current GPU's."""
    arch = os.environ.get("CUTE_DSL_ARCH")
    if arch:
        return arch
    import torch

    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return f"sm_{major}{minor}{'a' if major >= 9 else ''}"
    return "unknown"


def cache_key(name: str, module_name: str, params: Any) -> str:
    """Hex digest naming one compiled kernel (see the module docstring for what it covers)."""
    h = hashlib.sha256()
    for part in (name, _module_source_hash(module_name), cutlass_dsl_version(), target_arch(), repr(params)):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:32]


def _load(path: Path, symbol: str) -> Callable:
    from cutlass import runtime

    return getattr(runtime.load_module(str(path), enable_tvm_ffi=True), symbol)


def compile_cached(name: str, module_name: str, params: Any, compile_fn: Callable[[], Any]) -> Callable:
    """The compiled kernel for ``params``: loaded from the cache, else ``compile_fn()`` (which
    returns a function compiled with ``--enable-tvm-ffi``), exported to the cache and loaded back.

    ``module_name``: the module whose source builds the kernel (part of the key). ``params``: a
    value whose ``repr`` determines the kernel (config, shape, format, dtype, ...).
    """
    d = cache_dir()
    if d is None:
        return compile_fn()
    key = cache_key(name, module_name, params)
    symbol = f"autofp4_{key}"
    path = d / f"{name}-{key}.o"
    if path.exists():
        try:
            return _load(path, symbol)
        except Exception as e:  # a damaged file or one from an incompatible runtime
            warnings.warn(f"autofp4 kernel cache: cannot load {path} ({e}); compiling again", stacklevel=2)
            path.unlink(missing_ok=True)
    fn = compile_fn()
    try:
        d.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{name}-", suffix=".o", dir=d)
        os.close(fd)
        try:
            fn.export_to_c(tmp, function_name=symbol)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return _load(path, symbol)
    except Exception as e:  # read-only cache directory, full disk, ...: run the compiled function
        warnings.warn(f"autofp4 kernel cache: cannot store {name} in {d} ({e})", stacklevel=2)
        return fn


def summary() -> tuple[Path | None, int, int]:
    """``(directory, kernels, bytes)`` of the cache; ``(None, 0, 0)`` when it is disabled."""
    d = cache_dir()
    if d is None:
        return None, 0, 0
    files = list(d.glob("*.o")) if d.is_dir() else []
    return d, len(files), sum(f.stat().st_size for f in files)


def clear() -> int:
    """Delete every cached kernel; returns how many files were removed."""
    d = cache_dir()
    if d is None or not d.is_dir():
        return 0
    n = 0
    for p in d.glob("*.o"):
        p.unlink(missing_ok=True)
        n += 1
    return n
