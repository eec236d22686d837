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

Next to each ``.o`` file a ``.json`` file records what its name hashes (the kernel's name, its
module and that module's source hash, the CuTeDSL version, the architecture, the parameters):
:func:`export_archive` packs the kernels into one file that travels with a tuning DB, and
:func:`import_archive` unpacks on another machine only the kernels its own modules and CuTeDSL
would build the same, checking each file's name against that record and its bytes against the
archive's checksums.

``$AUTOFP4_KERNEL_CACHE`` names the directory (default ``$XDG_CACHE_HOME/autofp4/kernels``; an
empty value counts as unset); ``off`` (or ``0``) disables the cache: every call compiles. A value
of only whitespace, or one holding a NUL byte, is refused (``ValueError`` naming the variable).
"""
from __future__ import annotations

import ast
import contextlib
import functools
import hashlib
import inspect
import io
import json
import os
import re
import shutil
import tarfile
import tempfile
import tokenize
import warnings
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from .env import cutlass_dsl_version
from .paths import REGULAR, expand_path, kind_of, not_regular

_OFF = ("off", "0", "false", "no")


def cache_dir() -> Path | None:
    """The cache directory, or ``None`` when the cache is disabled (``$AUTOFP4_KERNEL_CACHE`` is
    ``off``, ``0``, ...), a leading ``~`` expanded. An empty ``$AUTOFP4_KERNEL_CACHE`` counts as
    unset (the default folder)."""
    env = os.environ.get("AUTOFP4_KERNEL_CACHE")
    if env:
        if env.strip().lower() in _OFF:
            return None
        # '~/kc' as AUTOFP4_DB takes it, not a folder named '~'; a NUL byte, a pasted line break or
        # only whitespace refused
        return expand_path(env, "AUTOFP4_KERNEL_CACHE", example="")
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(os.path.expanduser(base)):  # unset, empty or relative: ignored (the XDG spec)
        base = str(Path.home() / ".cache")
    return Path(os.path.expanduser(base)) / "autofp4" / "kernels"


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


def _record(name: str, module_name: str, params: Any) -> dict[str, str]:
    """What a compiled kernel's file name hashes, as stored beside it."""
    return {"name": name, "module": module_name, "source": _module_source_hash(module_name),
            "cutlass_dsl": cutlass_dsl_version(), "arch": target_arch(), "params": repr(params)}


def _digest(record: dict[str, str]) -> str:
    h = hashlib.sha256()
    for part in (record["name"], record["source"], record["cutlass_dsl"], record["arch"], record["params"]):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:32]


def cache_key(name: str, module_name: str, params: Any) -> str:
    """Hex digest naming one compiled kernel (see the module docstring for what it covers)."""
    return _digest(_record(name, module_name, params))


def _write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}-", suffix=path.suffix, dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


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
    record = _record(name, module_name, params)
    key = _digest(record)
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
            _write_atomic(path.with_suffix(".json"), json.dumps(record, sort_keys=True).encode())
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return _load(path, symbol)
    except Exception as e:  # read-only cache directory, full disk, ...: run the compiled function
        warnings.warn(f"autofp4 kernel cache: cannot store {name} in {d} ({e})", stacklevel=2)
        return fn


#: the names of the cache's own files: a compiled kernel ``<name>-<key>.o`` and its record ``.json``
_OWN_FILE = re.compile(r"[A-Za-z0-9_]{1,64}-[0-9a-f]{32}\.(o|json)")


def _kernel_files(d: Path) -> list[Path]:
    """The compiled kernels in ``d``: the regular ``.o`` files named as :func:`compile_cached`
    names them (any other file there, say a build folder's ``foo.o``, or a symbolic link, which the
    cache never writes and an export would follow to someone's file, is not the cache's)."""
    if not d.is_dir():
        return []
    return sorted(p for p in d.glob("*.o") if _OWN_FILE.fullmatch(p.name) and p.is_file() and not p.is_symlink())


def summary() -> tuple[Path | None, int, int]:
    """``(directory, kernels, bytes)`` of the cache; ``(None, 0, 0)`` when it is disabled."""
    d = cache_dir()
    if d is None:
        return None, 0, 0
    files = _kernel_files(d)
    return d, len(files), sum(f.stat().st_size for f in files)


def clear() -> int:
    """Delete every cached kernel (its ``.o`` file and ``.json`` record); returns how many kernels
    were removed. Only the cache's own files are deleted (named ``<name>-<32 hex>.o`` / ``.json``):
    others in the folder are left (:func:`others` lists them)."""
    d = cache_dir()
    if d is None or not d.is_dir():
        return 0
    n = 0
    for p in _kernel_files(d):
        p.unlink(missing_ok=True)
        p.with_suffix(".json").unlink(missing_ok=True)
        n += 1
    for p in d.glob("*.json"):  # records whose kernel is gone
        if _OWN_FILE.fullmatch(p.name) and not p.with_suffix(".o").exists():
            p.unlink(missing_ok=True)
    return n


def others() -> list[Path]:
    """The entries of the cache folder that are not the cache's own files (left by :func:`clear`)."""
    d = cache_dir()
    if d is None or not d.is_dir():
        return []
    return sorted(p for p in d.iterdir() if not _OWN_FILE.fullmatch(p.name))


# -- archives: a warmed cache that travels ---------------------------------------------------
ARCHIVE_FORMAT = "autofp4-kernel-cache"
ARCHIVE_VERSION = 1
MANIFEST = "manifest.json"
#: bounds on what an import reads: the archive, its manifest, its kernels
MAX_ARCHIVE_BYTES = 8 * 2**30
MAX_MANIFEST_BYTES = 64 * 2**20
MAX_KERNELS = 100_000
_FILE_NAME = re.compile(r"[A-Za-z0-9_]{1,64}-[0-9a-f]{32}\.o")
_RECORD_KEYS = ("name", "module", "source", "cutlass_dsl", "arch", "params")


class KernelArchiveError(ValueError):
    """An archive that cannot be exported or imported (the message names the file and why)."""


@dataclass
class ArchiveReport:
    """What an export wrote or an import did."""

    kernels: int = 0  # exported, or imported
    present: int = 0  # imported: already in the cache
    bytes: int = 0
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (file, why) left out or refused


def disabled_by() -> str:
    """What disabled the cache, as the user set it: ``AUTOFP4_KERNEL_CACHE='off'``."""
    return f"AUTOFP4_KERNEL_CACHE={os.environ.get('AUTOFP4_KERNEL_CACHE', '')!r:.80}"


def cache_dir_problem(d: Path) -> str | None:
    """Why ``d`` cannot be (or become) the kernel cache folder: a dangling symlink, a file, or a
    path under a file (None: it is a folder, or one can be made there)."""
    where = f"the kernel cache {d} ($AUTOFP4_KERNEL_CACHE)"
    try:
        d.is_symlink(), d.exists()
    except OSError as e:  # a name too long, a loop of links
        return f"{where} cannot be used: {e.strerror or e}"
    if d.is_symlink() and not d.exists():
        try:
            target = os.readlink(d)
        except OSError:
            target = "?"
        return f"{where} is a dangling symlink (to {target}); point it at a folder or remove it"
    if d.exists():
        return None if d.is_dir() else f"{where} is not a directory"
    for parent in d.parents:
        if parent.is_symlink() and not parent.exists():
            return f"{where} cannot be made: {parent} is a dangling symlink"
        if parent.exists():
            return None if parent.is_dir() else f"{where} cannot be made: {parent} is not a directory"
    return None


def _require_cache() -> Path:
    try:
        d = cache_dir()
    except ValueError as e:
        raise KernelArchiveError(str(e)) from None
    if d is None:
        raise KernelArchiveError(f"the kernel cache is disabled ({disabled_by()})")
    why = cache_dir_problem(d)
    if why is not None:
        raise KernelArchiveError(why)
    return d


def check_export_target(dest: str | Path) -> Path:
    """``dest`` as a :class:`Path` if :func:`export_archive` may write it (a new file, or an
    earlier archive; not standard output, a folder, a file in the kernel cache, a path under a
    file or a dangling link), else :class:`KernelArchiveError` saying why. Commands that work
    before they export check first."""
    d = _require_cache()
    if str(dest) == "-":
        raise KernelArchiveError("the archive is written to a file, not standard output: name the file (not '-')")
    dest = Path(dest)
    if dest.is_dir():
        raise KernelArchiveError(f"{dest} is a directory; name the archive file to write")
    _check_replaceable(dest)
    if d.is_dir() and dest.resolve().parent == d.resolve():
        raise KernelArchiveError(f"{dest} is inside the kernel cache {d}; write the archive elsewhere")
    for parent in (dest.parent, *dest.parent.parents):
        if parent.is_symlink() and not parent.exists():
            raise KernelArchiveError(f"cannot write {dest}: {parent} is a dangling symlink")
        if parent.exists():
            if not parent.is_dir():
                raise KernelArchiveError(f"cannot write {dest}: {parent} is a file, not a directory")
            break
    return dest


def export_archive(dest: str | Path) -> ArchiveReport:
    """Write the cache's kernels (with their records) to the archive ``dest`` (a gzipped tar
    with a manifest of checksums), atomically. Kernels without a record (compiled by an earlier
    autofp4) are left out and listed."""
    d = _require_cache()
    dest = check_export_target(dest)
    report, entries = ArchiveReport(), []
    report.skipped += [(p.name, "a symbolic link, not a kernel the cache wrote") for p in sorted(d.glob("*.o"))
                       if _OWN_FILE.fullmatch(p.name) and p.is_symlink()]
    for o in _kernel_files(d):
        kind = kind_of(o.with_suffix(".json"))
        if kind not in (None, REGULAR):  # a FIFO would block the read
            report.skipped.append((o.name, f"its record {o.with_suffix('.json').name} is {kind}, not a file"))
            continue
        try:
            record = json.loads(o.with_suffix(".json").read_text())
            data = o.read_bytes()
        except (OSError, ValueError, RecursionError) as e:
            report.skipped.append((o.name, f"no record of what it was built from ({type(e).__name__})"))
            continue
        if not isinstance(record, dict):
            report.skipped.append((o.name, f"its record {o.with_suffix('.json').name} is a JSON "
                                           f"{type(record).__name__}, not an object"))
            continue
        entry = {"file": o.name, "sha256": hashlib.sha256(data).hexdigest(), "size": len(data),
                 **{k: record.get(k) for k in _RECORD_KEYS}}
        try:  # what an import of the archive checks: an entry it would refuse is left out here
            _check_entry(entry, dest)
        except KernelArchiveError as e:
            report.skipped.append((o.name, str(e).split(": ", 1)[-1]))
            continue
        entries.append((entry, data))
    if not entries:
        without = (f" ({len(report.skipped)} left out: {report.skipped[0][0]}: {report.skipped[0][1]}"
                   f"{', ...' if len(report.skipped) > 1 else ''})" if report.skipped else "")
        raise KernelArchiveError(f"the kernel cache {d} holds no kernels to export{without}")
    manifest = json.dumps({"format": ARCHIVE_FORMAT, "version": ARCHIVE_VERSION,
                           "kernels": [e for e, _ in entries]}, indent=1).encode()
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}-", dir=dest.parent)
    except OSError as e:
        raise KernelArchiveError(f"cannot write {dest}: {e.strerror or e}") from None
    os.close(fd)
    try:
        with tarfile.open(tmp, "w:gz") as tar:
            for name, data in [(MANIFEST, manifest)] + [(e["file"], b) for e, b in entries]:
                info = tarfile.TarInfo(name)
                info.size, info.mode = len(data), 0o644
                tar.addfile(info, io.BytesIO(data))
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    report.kernels = len(entries)
    report.bytes = dest.stat().st_size
    return report


def _check_replaceable(dest: Path) -> None:
    """An export replaces ``dest``: only where nothing is there, or an earlier kernel archive
    (a gzipped tar whose first member is the manifest). A device, FIFO or socket, and any other
    file (a tuning DB, someone's data), is refused."""
    try:
        dest.stat()
    except (FileNotFoundError, NotADirectoryError):
        if not dest.is_symlink():
            return  # nothing there (a file in its path: said below, where the archive is written)
    except OSError as e:
        if not dest.is_symlink():
            raise KernelArchiveError(f"cannot write {dest}: {e.strerror or e}") from None
    kind = kind_of(dest)
    if kind != REGULAR:
        raise KernelArchiveError(f"{not_regular(dest, kind)}; an export replaces its target, so name a file")
    try:
        with tarfile.open(dest, "r:gz") as tar:
            first = tar.next()
        ours = first is not None and first.name == MANIFEST
    except (OSError, tarfile.TarError, EOFError):
        ours = False
    if not ours:
        raise KernelArchiveError(f"{dest} exists and is not a kernel archive; an export would replace it (name a "
                                 "new file, or remove this one first)")


def _check_entry(entry: Any, src: Path) -> dict[str, Any]:
    """One manifest entry, its fields checked (types, the file name against its record)."""
    if not isinstance(entry, dict):
        raise KernelArchiveError(f"{src}: a manifest entry is {type(entry).__name__}, not an object")
    for k in ("file", "sha256", *_RECORD_KEYS):
        if not isinstance(entry.get(k), str) or len(entry[k]) > 100_000:
            raise KernelArchiveError(f"{src}: a manifest entry's {k!r} is missing or not a string: {str(entry)[:200]}")
    size = entry.get("size")
    if not isinstance(size, int) or isinstance(size, bool) or not 0 < size <= MAX_ARCHIVE_BYTES:
        raise KernelArchiveError(f"{src}: {entry['file']}: size {size!r} is not a positive byte count")
    if not _FILE_NAME.fullmatch(entry["file"]) or not re.fullmatch(r"[0-9a-f]{64}", entry["sha256"]):
        raise KernelArchiveError(f"{src}: {entry['file']!r} is not a kernel file name (or its sha256 is malformed)")
    if entry["file"] != f"{entry['name']}-{_digest(entry)}.o":
        raise KernelArchiveError(f"{src}: {entry['file']} does not match the record stored with it")
    return entry


def _refusal(entry: dict[str, Any]) -> str | None:
    """Why this machine would not build the kernel the same (None: it would)."""
    if entry["cutlass_dsl"] != cutlass_dsl_version():
        return f"built with CuTeDSL {entry['cutlass_dsl']}, this machine has {cutlass_dsl_version()}"
    if not re.fullmatch(r"sm_\d+[af]?", entry["arch"]):
        return f"unknown architecture {entry['arch']!r}"
    if not re.fullmatch(r"autofp4\.kernels\.[a-z0-9_]+", entry["module"]):
        return f"{entry['module']!r} is not an autofp4 kernel module"
    try:
        source = _module_source_hash(entry["module"])
    except Exception as e:  # noqa: BLE001 - a module this autofp4 does not have, or cannot import
        return f"module {entry['module']} is not available here ({type(e).__name__})"
    if source != entry["source"]:
        return f"built from another version of {entry['module']}"
    return None


@contextlib.contextmanager
def _writing_to(d: Path) -> Iterator[None]:
    """An OSError inside is the cache folder's, named as such (not the archive's)."""
    try:
        yield
    except OSError as e:
        raise KernelArchiveError(f"cannot write to the kernel cache {d} ($AUTOFP4_KERNEL_CACHE): "
                                 f"{e.strerror or e}") from None


def import_archive(src: str | Path) -> ArchiveReport:
    """Unpack the kernels of archive ``src`` (from :func:`export_archive`) that this machine's
    modules and CuTeDSL would build the same into the cache; the others are refused and listed.
    Reads are bounded; a file that is not such an archive raises :class:`KernelArchiveError`."""
    d = _require_cache()
    src = Path(src)
    try:
        size = src.stat().st_size
    except OSError as e:
        raise KernelArchiveError(f"cannot read {src}: {e.strerror or e}") from None
    if not src.is_file():
        raise KernelArchiveError(f"{src} is not a regular file")
    if size > MAX_ARCHIVE_BYTES:
        raise KernelArchiveError(f"{src} is {size} bytes, above the {MAX_ARCHIVE_BYTES} an archive may hold")
    report = ArchiveReport()
    stage: Path | None = None
    created = False
    try:
        with tarfile.open(src, "r:gz") as tar:
            members: dict[str, tarfile.TarInfo] = {}
            for info in tar:
                if len(members) > MAX_KERNELS:
                    raise KernelArchiveError(f"{src}: more than {MAX_KERNELS} files")
                if not info.isfile() or info.name in members:
                    raise KernelArchiveError(f"{src}: {info.name!r} is not a plain file, or appears twice")
                members[info.name] = info
            info = members.get(MANIFEST)
            if info is None or info.size > MAX_MANIFEST_BYTES:
                raise KernelArchiveError(f"{src}: no {MANIFEST} (or one over {MAX_MANIFEST_BYTES} bytes): "
                                         "not an autofp4 kernel archive")
            try:
                manifest = json.loads(tar.extractfile(info).read())
            except (ValueError, RecursionError) as e:
                raise KernelArchiveError(f"{src}: {MANIFEST} is not valid JSON ({e})") from None
            if not isinstance(manifest, dict) or manifest.get("format") != ARCHIVE_FORMAT:
                raise KernelArchiveError(f"{src}: not an autofp4 kernel archive ({MANIFEST} has no "
                                         f"format {ARCHIVE_FORMAT!r})")
            if manifest.get("version") != ARCHIVE_VERSION:
                raise KernelArchiveError(f"{src}: archive version {manifest.get('version')!r}; this autofp4 "
                                         f"reads version {ARCHIVE_VERSION}")
            kernels = manifest.get("kernels")
            if not isinstance(kernels, list) or len(kernels) > MAX_KERNELS:
                raise KernelArchiveError(f"{src}: {MANIFEST} 'kernels' must be a list of at most {MAX_KERNELS}")
            entries = [_check_entry(e, src) for e in kernels]
            if len({e["file"] for e in entries}) != len(entries):
                raise KernelArchiveError(f"{src}: {MANIFEST} lists a kernel twice")
            extra = sorted(set(members) - {MANIFEST} - {e["file"] for e in entries})
            if extra:
                raise KernelArchiveError(f"{src}: files not in its manifest: {', '.join(extra[:5])}")
            # Every kernel is checked and written to a folder of its own inside the cache first;
            # only when all of them passed are they moved in: a refused archive writes nothing.
            staged: list[tuple[dict[str, Any], int]] = []
            for e in entries:
                why = _refusal(e)
                if why is not None:
                    report.skipped.append((e["file"], why))
                    continue
                info = members.get(e["file"])
                if info is None or info.size != e["size"]:
                    raise KernelArchiveError(f"{src}: {e['file']} is missing or not {e['size']} bytes")
                data = tar.extractfile(info).read(e["size"] + 1)
                if hashlib.sha256(data).hexdigest() != e["sha256"]:
                    raise KernelArchiveError(f"{src}: {e['file']} does not match its sha256 (damaged archive); "
                                             "nothing imported")
                path = d / e["file"]
                if path.exists() and path.with_suffix(".json").exists():
                    report.present += 1
                    continue
                with _writing_to(d):
                    if stage is None:
                        created = not d.exists()
                        d.mkdir(parents=True, exist_ok=True)
                        stage = Path(tempfile.mkdtemp(prefix=".import-", dir=d))
                    (stage / e["file"]).write_bytes(data)
                staged.append((e, len(data)))
            for e, size in staged:
                path = d / e["file"]
                with _writing_to(d):
                    _write_atomic(path.with_suffix(".json"),
                                  json.dumps({k: e[k] for k in _RECORD_KEYS}, sort_keys=True).encode())
                    os.replace(stage / e["file"], path)
                report.kernels += 1
                report.bytes += size
    except (tarfile.TarError, EOFError, OSError, UnicodeDecodeError) as e:
        raise KernelArchiveError(f"{src}: not a readable autofp4 kernel archive ({type(e).__name__}: {e})") from None
    finally:
        if stage is not None:
            shutil.rmtree(stage, ignore_errors=True)
            if created and report.kernels == 0:
                try:
                    d.rmdir()  # the cache folder this refused import made
                except OSError:
                    pass
    return report

