"""safetensors files read and written piece by piece, with bounded memory.

:class:`SafetensorsReader` reads the tensors of a checkpoint directory (one file, several files or
shards listed in ``model.safetensors.index.json``) with plain file reads: a tensor, or rows of it,
is read into memory only when asked for, and nothing is memory-mapped (mapped pages of a
checkpoint larger than RAM would count in the process's resident memory).

:class:`ShardedWriter` writes a checkpoint whose tensors (names, dtypes, shapes) are all declared
before the first byte: it lays them out in shards of at most ``max_shard_size`` bytes, writes
each shard's header, and then takes each tensor's bytes in any order and in pieces (a byte
offset into the tensor), so a tensor larger than memory can be written row block by row block.
:meth:`ShardedWriter.close` checks every byte was written and writes
``model.safetensors.index.json`` when there is more than one shard (HF's naming:
``model.safetensors``, or ``model-00001-of-00003.safetensors`` ...).
"""
from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional, Union

import torch

from ..paths import REGULAR, kind_of, not_regular, path_problem

__all__ = ["SafetensorsReader", "ShardedWriter", "TensorInfo", "parse_size", "DTYPES"]

#: safetensors dtype names <-> torch dtypes
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
_NAMES = {v: k for k, v in DTYPES.items()}
_MAX_HEADER = 100 * 2**20  # safetensors' own limit on a header's size
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def parse_size(size: Union[int, str], name: str = "max_shard_size") -> int:
    """``5000000``, ``"5GB"``, ``"500MiB"`` -> bytes (decimal for KB/MB/GB, binary for KiB/MiB/GiB).
    Anything else (a float such as 1.5, a bool) is refused: ``name`` is the argument named in the error."""
    if not isinstance(size, (int, str)) or isinstance(size, bool):
        raise TypeError(f"{name} must be an int (bytes) or a size string like '5GB', "
                        f"got {type(size).__name__} {size!r}")
    if isinstance(size, int):
        if size <= 0:
            raise ValueError(f"{name} must be a positive number of bytes, got {size}")
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", str(size), re.IGNORECASE)
    if not m:
        raise ValueError(f"{name} must be bytes or a number with a unit (500MB, 5GB, 4GiB), got {size!r}")
    unit = (m.group(2) or "B").upper()
    mult = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
            "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}[unit]
    out = int(float(m.group(1)) * mult)
    if out <= 0:
        raise ValueError(f"{name} must be a positive size, got {size!r}")
    return out


def path_arg(value: Any, name: str, what: str) -> Path:
    """``value`` (a str or os.PathLike, not empty) as a Path; TypeError / ValueError naming
    ``name`` (the argument) after ``what`` (the function) otherwise: an empty str would be the
    current directory."""
    if isinstance(value, bool) or not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{what}: {name} must be a folder path (str or Path), got {type(value).__name__} {value!r:.80}")
    text = os.fspath(value)
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"{what}: {name} is an empty path {text!r}; name the folder")
    why = path_problem(text)
    if why is not None:
        raise ValueError(f"{what}: {name}={text!r:.80}: {why}")
    return Path(text)


@dataclass(frozen=True)
class TensorInfo:
    """Where one stored tensor is: its file, dtype, shape and the absolute byte range."""

    name: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute offset of its first byte in the file
    nbytes: int

    @property
    def row_bytes(self) -> int:
        """Bytes of one index of the first dimension (the whole tensor for a scalar)."""
        return self.nbytes // self.shape[0] if self.shape and self.shape[0] else self.nbytes


def _short(value: object, limit: int = 120) -> str:
    """``repr`` of a header value, cut to ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def read_header(path: Path, what: str = "autofp4") -> tuple[dict, int]:
    """A safetensors file's header (tensor name -> entry, ``__metadata__``) and the offset of its
    data; a file that is not a safetensors file is named."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise ValueError("shorter than a safetensors header")
            (n,) = struct.unpack("<Q", raw)
            if n > _MAX_HEADER or 8 + n > size:
                raise ValueError(f"header length {n} does not fit the file ({size} bytes)")
            header = json.loads(f.read(n))
    except RecursionError:
        raise ValueError(f"{what}: {path} is not a readable safetensors file: its header is nested too deeply") from None
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{what}: {path} is not a readable safetensors file: {e}") from None
    if not isinstance(header, dict):
        raise ValueError(f"{what}: {path} is not a readable safetensors file: its header is not an object")
    data_start = 8 + n
    end = 0
    spans: list[tuple[int, int, str]] = []
    meta = header.get("__metadata__")
    if meta is not None:
        if not isinstance(meta, dict):
            raise ValueError(f"{what}: {path}: __metadata__ must be an object of strings (safetensors' format), "
                             f"got {_short(meta)}")
        for k, v in meta.items():
            if not isinstance(v, str):
                raise ValueError(f"{what}: {path}: __metadata__[{k!r}] must be a string (safetensors' format), "
                                 f"got {_short(v)}")
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict):
            raise ValueError(f"{what}: {path}: tensor {name!r} has an entry safetensors does not define: {_short(entry)}")
        for key, count in (("shape", None), ("data_offsets", 2)):
            v = entry.get(key)
            # JSON integers only: safetensors refuses "64", 64.0 and true where a size goes
            if (not isinstance(v, list) or (count is not None and len(v) != count)
                    or not all(type(x) is int and x >= 0 for x in v)):
                want = "two non-negative integers" if count else "a list of non-negative integers"
                raise ValueError(f"{what}: {path}: tensor {name!r}: {key} must be {want}, got {_short(v)}")
        try:
            dtype = DTYPES[entry["dtype"]]
        except (KeyError, TypeError):
            raise ValueError(f"{what}: {path}: tensor {name!r} has an entry safetensors does not define "
                             f"(or a dtype autofp4 does not read): {_short(entry)}") from None
        shape = tuple(entry["shape"])
        a, b = entry["data_offsets"]
        if min(shape, default=0) < 0 or b - a != math.prod(shape) * _itemsize(dtype) or a < 0:
            raise ValueError(f"{what}: {path}: tensor {name!r} has {b - a} bytes for {entry['dtype']} {list(shape)}")
        spans.append((a, b, name))
        if b > end:
            end, last = b, name
    if data_start + end > size:
        raise ValueError(f"{what}: {path} is truncated (or its header is wrong): tensor {last!r} ends at byte "
                         f"{data_start + end}, the file has {size}")
    if data_start + end < size:  # the safetensors library refuses such a file too
        raise ValueError(f"{what}: {path} has {size - data_start - end} bytes after its last tensor's data (a "
                         "safetensors file ends with its data): damaged, or something was appended")
    at, prev = 0, None
    for a, b, name in sorted(spans):  # back to back, as safetensors requires: no overlap, no gap
        if a != at:
            why = f"overlaps {prev!r}" if a < at else f"leaves a gap of {a - at} bytes after {prev!r}"
            raise ValueError(f"{what}: {path}: the bytes of tensor {name!r} ({a}..{b}) {why}")
        at, prev = b, name
    return header, data_start


def present_file(path: Path, what: str) -> bool:
    """Whether the optional file ``path`` of a checkpoint is there (False: no entry of that name);
    ``ValueError`` naming it where the entry is a link to nothing, or not a regular file (a
    directory, FIFO or device, which a reader would misread or block on)."""
    kind = kind_of(path)
    if kind is None:
        return False
    if kind != REGULAR:
        raise ValueError(f"{what}: {not_regular(path, kind)}")
    return True


def shard_files(root: Path, what: str) -> tuple[list[Path], Optional[dict[str, str]]]:
    """The safetensors files of a checkpoint directory (the shards its index lists, or every
    ``*.safetensors``) and the index's weight map (None without an index): shard names must be
    file names in ``root``, listed shards must exist and be regular files (never a pipe or a
    device a reader would block on)."""
    index = root / INDEX
    weight_map = None
    if present_file(index, what):
        try:
            doc = json.loads(index.read_text())
        except (ValueError, OSError, RecursionError) as e:
            raise ValueError(f"{what}: {index} is not valid JSON: {e}") from None
        weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{what}: {index} has no 'weight_map' of tensor names to shard files")
        bad = next(((k, v) for k, v in weight_map.items() if not isinstance(v, str)), None)
        if bad is not None:
            raise ValueError(f"{what}: {index}: weight_map[{str(bad[0])[:80]!r}] is a {type(bad[1]).__name__} "
                             f"({str(bad[1])[:80]}), not a shard file name")
        weight_map = {str(k): v for k, v in weight_map.items()}
        names = sorted(set(weight_map.values()))
        for v in names:
            if not v or Path(v).name != v or v in (".", "..") or len(v.encode()) > 255:
                raise ValueError(f"{what}: {index} lists the shard {v[:80]!r}{'...' if len(v) > 80 else ''}: a shard "
                                 f"must be a file name in {root} (no directories, no absolute paths, at most 255 bytes)")
        single = root / SINGLE
        if SINGLE not in names and (single.exists() or single.is_symlink()):
            # transformers loads model.safetensors when it exists and ignores the index: the
            # loaders would read different weights from the same folder
            raise ValueError(f"{what}: {root} is an ambiguous checkpoint: it holds both {SINGLE} and {INDEX} "
                             f"(which lists other shards: {', '.join(names[:3])}{', ...' if len(names) > 3 else ''}); "
                             f"transformers reads {SINGLE}, autofp4 would read the index: remove one of them")
        files = [root / v for v in names]
        for f in files:
            if not f.exists():
                raise FileNotFoundError(f"{what}: shard {f.name} listed in {index} does not exist in {root}")
    else:
        files = sorted(root.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{what}: no *.safetensors file (or {INDEX}) in {root}")
    for f in files:
        kind = kind_of(f)
        if kind != REGULAR:
            raise ValueError(f"{what}: {not_regular(f, kind)}")
    return files, weight_map


class SafetensorsReader:
    """The tensors of a checkpoint directory, read by name (see the module's docstring)."""

    def __init__(self, root: Union[str, Path], what: str = "autofp4") -> None:
        root = Path(root)
        self.root = root
        files, weight_map = shard_files(root, what)
        self.tensors: dict[str, TensorInfo] = {}
        for f in files:
            header, start = read_header(f, what)
            for name, e in header.items():
                if name == "__metadata__":
                    continue
                if name in self.tensors:
                    raise ValueError(f"{what}: tensor {name!r} is stored in both {self.tensors[name].file.name} and {f.name}")
                a, b = e["data_offsets"]
                self.tensors[name] = TensorInfo(name, f, DTYPES[e["dtype"]], tuple(e["shape"]), start + a, b - a)
        if weight_map is not None:
            for k, v in weight_map.items():
                if k not in self.tensors or self.tensors[k].file.name != v:
                    raise ValueError(f"{what}: {INDEX} puts {k!r} in {v}, but that file does not hold it")
        self._handles: dict[Path, object] = {}

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def info(self, name: str) -> TensorInfo:
        return self.tensors[name]

    def _file(self, path: Path):
        f = self._handles.get(path)
        if f is None:
            f = self._handles[path] = open(path, "rb")
        return f

    def read(self, name: str, rows: Optional[tuple[int, int]] = None) -> torch.Tensor:
        """Tensor ``name`` (or its first-dimension indices ``rows = (start, end)``) as a new CPU tensor."""
        t = self.tensors[name]
        shape = list(t.shape)
        offset, nbytes = t.start, t.nbytes
        if rows is not None:
            a, b = rows
            if not shape or not 0 <= a <= b <= shape[0]:
                raise IndexError(f"rows {rows} out of range for {name!r} of shape {t.shape}")
            offset += a * t.row_bytes
            nbytes = (b - a) * t.row_bytes
            shape[0] = b - a
        buf = bytearray(nbytes)
        f = self._file(t.file)
        f.seek(offset)
        view = memoryview(buf)
        got = 0
        while got < nbytes:
            n = f.readinto(view[got:])
            if not n:
                raise ValueError(f"{t.file} ended inside tensor {name!r}")
            got += n
        if nbytes == 0:
            return torch.empty(shape, dtype=t.dtype)
        return torch.frombuffer(buf, dtype=torch.uint8).view(t.dtype).reshape(shape)

    def close(self) -> None:
        for f in self._handles.values():
            f.close()
        self._handles.clear()


@dataclass
class _Planned:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    shard: int = 0
    offset: int = 0  # absolute in its shard file
    written: int = 0


class ShardedWriter:
    """A checkpoint's safetensors shards, declared first and filled later (see the module's docstring).

    ``declared``: ``(name, dtype, shape)`` in the order the tensors should sit in the files."""

    def __init__(self, root: Union[str, Path], declared: Iterable[tuple[str, torch.dtype, tuple[int, ...]]],
                 max_shard_size: Union[int, str] = "5GB", metadata: Optional[dict[str, str]] = None) -> None:
        self.root = Path(root)
        limit = parse_size(max_shard_size, "max_shard_size")
        self._tensors: dict[str, _Planned] = {}
        shards: list[list[_Planned]] = [[]]
        size = 0
        for name, dtype, shape in declared:
            if name in self._tensors:
                raise ValueError(f"tensor {name!r} is declared twice")
            if dtype not in _NAMES:
                raise TypeError(f"tensor {name!r}: safetensors has no dtype for {dtype}")
            p = _Planned(name, dtype, tuple(int(s) for s in shape), math.prod(shape) * _itemsize(dtype))
            if shards[-1] and size + p.nbytes > limit:
                shards.append([])
                size = 0
            shards[-1].append(p)
            size += p.nbytes
            self._tensors[name] = p
        if not self._tensors:
            raise ValueError("a checkpoint needs at least one tensor")
        n = len(shards)
        self.files = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        self._fds: list[int] = []
        meta = {"format": "pt", **(metadata or {})}
        for i, members in enumerate(shards):
            # wider dtypes first, so every tensor starts at a multiple of its element size
            members.sort(key=lambda p: -_itemsize(p.dtype))
            header: dict = {"__metadata__": meta}
            at = 0
            for p in members:
                p.shard = i
                header[p.name] = {"dtype": _NAMES[p.dtype], "shape": list(p.shape), "data_offsets": [at, at + p.nbytes]}
                at += p.nbytes
            raw = json.dumps(header, separators=(",", ":")).encode()
            raw += b" " * (-len(raw) % 8)
            start = 8 + len(raw)
            for p in members:
                p.offset += start + header[p.name]["data_offsets"][0]
            path = self.root / self.files[i]
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                self._fds.append(fd)
                os.pwrite(fd, struct.pack("<Q", len(raw)) + raw, 0)
                os.ftruncate(fd, start + at)
            except OSError as e:  # a file size limit, a full disk: the file named
                raise OSError(e.errno, f"{e.strerror} (writing {start + at} bytes)", str(path)) from None

    @property
    def total_size(self) -> int:
        return sum(p.nbytes for p in self._tensors.values())

    def write(self, name: str, tensor: torch.Tensor, at: int = 0) -> None:
        """``tensor``'s bytes into the declared tensor ``name``, starting ``at`` bytes into it
        (a whole tensor, or a piece of it: consecutive rows)."""
        p = self._tensors.get(name)
        if p is None:
            raise KeyError(f"tensor {name!r} was not declared")
        t = tensor.detach()
        if t.dtype != p.dtype:
            raise TypeError(f"tensor {name!r} is declared {p.dtype}, got {t.dtype}")
        data = t.contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        if at < 0 or at + len(data) > p.nbytes:
            raise ValueError(f"tensor {name!r}: bytes {at}..{at + len(data)} outside its {p.nbytes}")
        view = memoryview(data)
        done = 0
        try:
            while done < len(data):
                done += os.pwrite(self._fds[p.shard], view[done:], p.offset + at + done)
        except OSError as e:
            raise OSError(e.errno, e.strerror, str(self.root / self.files[p.shard])) from None
        p.written += len(data)

    def close(self) -> dict[str, str]:
        """Close the files, check every declared byte was written, write the index when sharded;
        returns the weight map (tensor name -> file name)."""
        for fd in self._fds:
            os.fsync(fd)
            os.close(fd)
        self._fds = []
        short = [p.name for p in self._tensors.values() if p.written != p.nbytes]
        if short:
            raise RuntimeError(f"{len(short)} declared tensors were not written completely: {short[:5]}")
        weight_map = {name: self.files[p.shard] for name, p in sorted(self._tensors.items())}
        if len(self.files) > 1:
            doc = {"metadata": {"total_size": self.total_size}, "weight_map": weight_map}
            (self.root / INDEX).write_text(json.dumps(doc, indent=2) + "\n")
        return weight_map

    def abort(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []
