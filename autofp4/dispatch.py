"""The dispatcher: ``(ProblemKey, M) -> (backend, config, runner)`` on every call.

The hot path (:meth:`Dispatcher.resolve`) is a dict lookup: ``(key, M)`` answers are memoized,
runners are compiled once per ``(backend, config, key)`` and serve every M. No SQL, no file
access, no tensor hashing. The process-wide dispatchers (:func:`get_dispatcher`) read the tuned
rows of a problem the first time they are asked about it, from every layer: the rows of the
running environment and that problem only (an indexed query of the user DB; the shipped exports
are read once per process), so the size of the DB does not show in the start-up time.

M buckets
---------
A call with ``M`` tokens belongs to the standard bucket ``bucket_for(M, DEFAULT_M_BUCKETS)``
(the power of two at or above ``M``, at most 8192). :func:`bucket_for` finds the nearest tuned
bucket at or above ``M`` (the largest when ``M`` is beyond all of them); its row runs the call
when it was tuned for the call's own bucket: at most the standard bucket and at least ``M``
(a row tuned at M = 100 serves 65..100; the 8192 row serves every larger M). A config that
declares the largest M it serves (an ``m_max`` field, like the Hopper decode kernel's) is not
stretched past it. Every other call runs its backend's default config *for that M*: a config
tuned for other token counts can be much slower there than the default heuristic (an H200
GEMM config tuned at M = 128 took 115 us at M = 64 where the default took 66 us, and 25% longer
than the default at M = 512..8192).

Misses
------
A call is a *miss* when it does not run a tuned row: its key has no tuned row, or none
tuned for its bucket. Misses are counted per ``(key, standard bucket)`` and appended (counts merged) to a
JSON file next to the user DB when the process exits, so ``autofp4 tune --from-misses``
can tune exactly what a workload needed.

Renewal and the miss hook
-------------------------
:func:`refresh` replaces each process-wide dispatcher by its renewal (:meth:`Dispatcher.renewed`:
the same compiled runners and miss counter, every problem's rows read again on its next call),
so rows stored since by this or another process are used without a restart; calls that kept a
runner check that their dispatcher is still the process-wide one. :func:`set_miss_hook` installs
a function the process-wide dispatchers call on every miss (just-in-time tuning,
:mod:`autofp4.tuning.jit`); tuned calls never reach it.
"""
from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import threading
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch

from .backends import available_backends, get_backend
from .backends.base import Backend, BackendConfig, Runner
from .problem import DEFAULT_M_BUCKETS, ProblemKey, bucket_for, is_moe, shape_errors

__all__ = [
    "DEFAULT_M_BUCKETS",
    "bucket_for",
    "Dispatcher",
    "Explanation",
    "get_dispatcher",
    "set_db",
    "reload",
    "user_db_path",
    "misses_path",
    "load_misses",
    "refresh",
    "set_miss_hook",
]

MISSES_VERSION = 1


_SOURCE_HASHES: dict[tuple[str, str | None], str] = {}


def backend_source_hash(backend: Backend, config: Any = None) -> str:
    """The hash of the source of the kernel ``backend`` runs ``config`` with (of every kernel of
    the backend without a config; "" when the source cannot be read, e.g. in a frozen install,
    and then rows are not checked against it)."""
    return _part_hash(backend, None if config is None else backend.source_part(config))


def backend_source_hashes(backend: Backend) -> set[str]:
    """The current source hash of each of ``backend``'s kernels (what its rows may carry)."""
    return {_part_hash(backend, part) for part in backend.source_parts}


def _part_hash(backend: Backend, part: str | None) -> str:
    h = _SOURCE_HASHES.get((backend.name, part))
    if h is None:
        try:
            h = backend.part_source_hash(part)
        except (OSError, TypeError, ImportError):
            h = ""
        _SOURCE_HASHES[(backend.name, part)] = h
    return h


def is_stale(rec: Any, backend: Backend) -> bool:
    """True when ``rec`` was measured with another version of the source of the kernel its
    config runs."""
    src = getattr(rec, "backend_source", None) or ""
    cur = backend_source_hash(backend, getattr(rec, "config", None) or {})
    return bool(src and cur and src != cur)


def row_is_stale(rec: Any) -> bool:
    """:func:`is_stale` for a row of any backend by name (rows of a backend this install cannot
    load are not judged: False)."""
    try:
        backend = get_backend(rec.backend)
    except Exception:  # an unknown or broken backend
        return False
    return is_stale(rec, backend)


def _norm_device(device: torch.device | str | int) -> torch.device:
    dev = torch.device(device) if not isinstance(device, torch.device) else device
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _checked_device(device: Any, what: str = "autofp4") -> torch.device:
    """:func:`_norm_device` of a device this machine has; ValueError naming it (after ``what``)
    otherwise."""
    try:
        dev = torch.device(device) if not isinstance(device, torch.device) else device
    except (TypeError, RuntimeError) as e:
        raise ValueError(f"{what}: {device!r} is not a device: {e}") from None
    from .weights import missing_device

    why = missing_device(dev)
    if why:
        raise ValueError(f"{what}: device {device!r}: {why}")
    return _norm_device(dev)


def _key_dict(key: ProblemKey) -> dict[str, Any]:
    return asdict(key)


#: ``hook(dispatcher, (key, standard M bucket)) -> dispatcher to resolve again, or None``
MissHook = Callable[["Dispatcher", tuple[ProblemKey, int]], "Dispatcher | None"]


_LOG = logging.getLogger("autofp4")


def log_from_env() -> None:
    """``AUTOFP4_LOG=info|debug``: the ``autofp4`` logger at that level, on standard error (info:
    what the first call of each problem and M bucket runs, and why; debug: of each M too). Any
    other value warns and changes nothing."""
    from .env import env_choice

    level = env_choice("AUTOFP4_LOG", {"info": "INFO", "debug": "DEBUG", "0": None, "off": None}, None,
                       "no logging")
    if level is None:
        return
    if not any(getattr(h, "_autofp4", False) for h in _LOG.handlers):
        h = logging.StreamHandler()
        h.setFormatter(logging.Formatter("%(name)s: %(message)s"))
        h._autofp4 = True  # type: ignore[attr-defined]
        _LOG.addHandler(h)
    _LOG.setLevel(level)


@dataclass(frozen=True)
class Explanation:
    """What a call of ``key`` with ``m`` tokens runs, and why (:meth:`Dispatcher.explain`)."""

    key: ProblemKey
    m: int
    bucket: int  # the call's M bucket (the power of two at or above m, at most 8192)
    backend: str
    config: Any
    tuned: bool  # a tuned row runs it (else the backend's default for m)
    row_bucket: int | None  # the M bucket of the tuned row that runs it
    why: str
    layer: str | None = None  # the DB layer that row came from, where the dispatcher knows it

    def __str__(self) -> str:
        k = self.key
        moe = f" E={k.experts} topk={k.topk}" if is_moe(k.op) else ""
        cfg = json.dumps(get_backend(self.backend).config_dict(self.config), sort_keys=True, separators=(",", ":"))
        return (f"{k.op} {k.fmt} {k.dtype} N={k.n} K={k.k}{moe} M={self.m} (bucket {self.bucket}): "
                f"{self.backend} {cfg}\n  {self.why}" + (f"\n  from {self.layer}" if self.layer else ""))


class Dispatcher:
    """Tuned rows of one device in memory, plus the runner cache and the miss counter.

    ``records`` are :class:`~autofp4.schema.TuningRecord` s in priority order. Several rows
    can answer one ``(key, bucket)`` (one per backend); the fastest measured one wins, the
    earlier one on ties (the user DB comes before the shipped files). ``rows_for``: a callable
    ``(ProblemKey) -> records`` (in priority order) asked once per problem, the first time the
    dispatcher is asked about it (with ``records``: for the problems they hold no row of);
    :func:`get_dispatcher` passes one that reads the DB layers. Rows measured in another
    environment than ``env`` (default: the current environment of ``device``), rows measured
    with another version of their backend's kernel source (``backend_source``; counted in
    ``stale_rows``: run the tuner again), rows whose backend does not run on ``device`` and rows
    whose config its backend rejects are ignored (one warning for the latter two).
    """

    def __init__(
        self,
        device: torch.device | str | int,
        records: Iterable[Any] = (),
        env: Any = None,
        misses_file: str | os.PathLike | None = None,
        rows_for: Callable[[ProblemKey], Iterable[Any]] | None = None,
    ) -> None:
        self.device = _norm_device(device)
        if env is None:
            from .env import current_environment

            env = current_environment(self.device)
        self.env = env
        self.env_key: str = env.key() if hasattr(env, "key") else str(env)
        # bound now, so misses go next to the DB this dispatcher was built from
        self.misses_file = Path(misses_file) if misses_file is not None else misses_path()
        # key -> (sorted tuned buckets, {bucket: (backend, config)})
        self._table: dict[ProblemKey, tuple[list[int], dict[int, tuple[Backend, BackendConfig]]]] = {}
        self._runners: dict[tuple[str, BackendConfig, ProblemKey], Runner] = {}
        self._memo: dict[tuple[ProblemKey, int], tuple[Backend, BackendConfig, Runner, Any]] = {}
        self._misses: dict[tuple[ProblemKey, int], int] = {}
        #: misses of an expert-parallel slice: (key, M bucket) -> the layer's global expert count
        self._miss_eg: dict[tuple[ProblemKey, int], int] = {}
        self._lock = threading.Lock()
        self._applies: dict[str, bool] = {}
        self.ignored: list[str] = []
        self.other_env_rows = 0
        self.stale_rows = 0
        self._rows_for = rows_for
        #: ``key -> [(layer, rows)]`` of the DB layers (for :meth:`explain`); None: unknown
        self.layers_for: Callable[[ProblemKey], list[tuple[str, list[Any]]]] | None = None
        self._logged: set[tuple[ProblemKey, int]] = set()  # (problem, M bucket)s logged (AUTOFP4_LOG)
        self._asked: set[ProblemKey] = set()  # the problems rows_for was asked about
        self._load_lock = threading.Lock()
        #: called on every miss (see :func:`set_miss_hook`); None: misses are only counted
        self.on_miss: MissHook | None = None
        self._load(records)

    def renewed(self) -> "Dispatcher":
        """A dispatcher that reads every problem's rows again from ``rows_for`` when next asked,
        sharing this one's compiled runners, miss counter and miss hook (the rows given as
        ``records`` are not kept: renew dispatchers that read their rows through ``rows_for``)."""
        new = object.__new__(Dispatcher)
        new.__dict__.update(self.__dict__)
        new._table, new._memo, new._asked = {}, {}, set()
        new._load_lock = threading.Lock()
        new.ignored, new.other_env_rows, new.stale_rows = [], 0, 0
        return new

    # -- loading ---------------------------------------------------------------------
    def _backend_applies(self, name: str) -> Backend | None:
        try:
            b = get_backend(name)
        except (KeyError, ImportError, AttributeError) as e:
            self._applies[name] = False
            self.ignored.append(f"backend {name!r} is not available: {e}")
            return None
        ok = self._applies.get(name)
        if ok is None:
            try:
                ok = bool(b.applies_to(self.device))
            except Exception:  # a broken probe means "does not apply"
                ok = False
            self._applies[name] = ok
        return b if ok else None

    def _load(self, records: Iterable[Any], only: ProblemKey | None = None) -> None:
        """Put ``records`` in the table (``only``: the rows of that problem; others are left out)."""
        staged: dict[ProblemKey, dict[int, tuple[float, Backend, BackendConfig]]] = {}
        ignored_before = len(self.ignored)
        for rec in records:
            rec_env = getattr(rec, "env_key", None)
            if rec_env is not None and rec_env != self.env_key:
                self.other_env_rows += 1
                continue
            try:
                key = ProblemKey(rec.op, rec.fmt, rec.dtype, rec.n, rec.k, rec.experts, rec.topk)
            except ValueError as e:
                self.ignored.append(f"row {rec.op} {rec.n}x{rec.k}: {e}")
                continue
            if only is not None and key != only:
                continue
            by_bucket = staged.setdefault(key, {})
            prev = by_bucket.get(rec.m_bucket)
            median = float(getattr(rec, "median_us", 0.0) or 0.0)
            if prev is not None and prev[0] <= median:
                continue  # an equally fast or faster row (or an earlier layer's) already answers
            b = self._backend_applies(rec.backend)
            if b is None:
                self.ignored.append(f"{rec.backend} row for {key} M<={rec.m_bucket}: backend does not run on {self.device}")
                continue
            if is_stale(rec, b):
                self.stale_rows += 1
                continue
            try:
                cfg = b.parse_config(rec.config)
                reason = b.supports(key) or b.is_valid(cfg, key)
            except Exception as e:  # pydantic errors, a backend's own checks
                reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            if reason:
                self.ignored.append(f"{rec.backend} row for {key} M<={rec.m_bucket}: {reason}")
                continue
            by_bucket[rec.m_bucket] = (median, b, cfg)
        for key, by_bucket in staged.items():
            if by_bucket:
                self._table[key] = (sorted(by_bucket), {m: (b, c) for m, (_, b, c) in by_bucket.items()})
        new = self.ignored[ignored_before:]
        if new:
            warnings.warn(
                f"autofp4: ignored {len(new)} tuning row(s) that cannot run on {self.device} "
                f"(first: {new[0]})",
                RuntimeWarning,
                stacklevel=3,
            )

    def _entry(self, key: ProblemKey) -> tuple[list[int], dict[int, tuple[Backend, BackendConfig]]] | None:
        """The table entry of ``key``, its rows read first (once) where ``rows_for`` gives them."""
        entry = self._table.get(key)
        if entry is None and self._rows_for is not None and key not in self._asked:
            with self._load_lock:
                if key not in self._asked:
                    self._load(self._rows_for(key), only=key)
                    self._asked.add(key)
            entry = self._table.get(key)
        return entry

    # -- lookups ---------------------------------------------------------------------
    def tuned(self, key: ProblemKey) -> dict[int, tuple[Backend, BackendConfig]]:
        """The tuned ``{bucket: (backend, config)}`` of ``key`` (empty when untuned)."""
        entry = self._entry(key)
        return dict(entry[1]) if entry else {}

    def __len__(self) -> int:
        """The tuned ``(key, bucket)`` pairs in memory (with ``rows_for``: of the problems asked
        about so far)."""
        return sum(len(e[0]) for e in self._table.values())

    def _fallback(self, key: ProblemKey, m: int) -> tuple[Backend, BackendConfig]:
        reasons = []
        for b in available_backends(self.device):
            why = b.supports(key)
            if why is None:
                return b, b.default(key, m)
            reasons.append(f"{b.name}: {why}")
        raise RuntimeError(f"no backend on {self.device} can run {key}: " + "; ".join(reasons))

    def _pick(self, key: ProblemKey, m: int) -> tuple[Backend, BackendConfig, bool]:
        std = bucket_for(m, DEFAULT_M_BUCKETS)
        entry = self._entry(key)
        if entry is not None:
            buckets, by_bucket = entry
            b = bucket_for(m, buckets)
            backend, cfg = by_bucket[b]
            m_max = getattr(cfg, "m_max", None)
            if min(m, std) <= b <= std and (m_max is None or m <= m_max):
                return backend, cfg, False
            return backend, backend.default(key, m), True  # tuned for other token counts
        backend, cfg = self._fallback(key, m)
        return backend, cfg, True

    def pick(self, key: ProblemKey, m: int) -> tuple[Backend, BackendConfig]:
        """The tuned ``(backend, config)`` for ``key`` at ``m`` tokens, else the default one."""
        backend, cfg, _ = self._pick(key, m)
        return backend, cfg

    def _log_pick(self, key: ProblemKey, m: int) -> None:
        """Log what a first call runs: at INFO the first of each (problem, M bucket), at DEBUG
        the first of each M."""
        first = (key, bucket_for(m, DEFAULT_M_BUCKETS)) not in self._logged
        if first or _LOG.isEnabledFor(logging.DEBUG):
            self._logged.add((key, bucket_for(m, DEFAULT_M_BUCKETS)))
            _LOG.log(logging.INFO if first else logging.DEBUG, "%s on %s",
                     str(self.explain(key, m)).replace("\n  ", "; "), self.device)

    def explain(self, key: ProblemKey, m: int) -> Explanation:
        """What a call of ``key`` with ``m`` tokens runs and why (counts no miss, compiles nothing)."""
        std = bucket_for(m, DEFAULT_M_BUCKETS)
        backend, cfg, miss = self._pick(key, m)
        entry = self._entry(key)
        if not miss:
            b = bucket_for(m, entry[0])
            layer = None
            if self.layers_for is not None:
                layer = next((label for label, recs in self.layers_for(key)
                              if any(r.m_bucket == b and r.backend == backend.name for r in recs)), None)
            return Explanation(key, m, std, backend.name, cfg, True, b, f"the tuned row of M bucket {b}", layer)
        if entry is not None:
            why = (f"tuned rows (M buckets {', '.join(map(str, entry[0]))}) serve other token counts: "
                   f"the {backend.name} default for M = {m}")
        else:
            why = f"no tuned row for this problem here: the {backend.name} default for M = {m}"
            if self.stale_rows or self.other_env_rows:
                why += (f" (rows read but not used: {self.stale_rows} of an older kernel, "
                        f"{self.other_env_rows} of another environment)")
        return Explanation(key, m, std, backend.name, cfg, False, None, why)

    def runner(self, backend: Backend, config: BackendConfig, key: ProblemKey) -> Runner:
        """The compiled runner for ``(backend, config, key)``; compiled once, reused for all M."""
        ck = (backend.name, config, key)
        r = self._runners.get(ck)
        if r is None:
            with self._lock:
                r = self._runners.get(ck)
                if r is None:
                    r = backend.compile(config, key)
                    self._runners[ck] = r
        return r

    def resolve(self, key: ProblemKey, m: int) -> tuple[Backend, BackendConfig, Runner]:
        """``(backend, config, runner)`` for a call with ``m`` tokens (memoized per ``(key, m)``)."""
        return self.resolve_entry(key, m)[:3]

    def resolve_entry(self, key: ProblemKey, m: int, experts_global: int = 0) -> tuple[Backend, BackendConfig, Runner, Any]:
        """:meth:`resolve` plus the miss this call counted (``None`` for a tuned pick). A caller
        that keeps the runner for later calls passes the miss to :meth:`count_miss` on each.
        ``experts_global``: for a MoE call on one rank's slice of an expert-parallel layer (an
        ``expert_map``), the layer's expert count, recorded with its miss (tuning the miss then
        routes among all of them, as the slice sees it)."""
        hit = self._memo.get((key, m))
        if hit is None:
            backend, cfg, miss = self._pick(key, m)
            if _LOG.isEnabledFor(logging.INFO):
                self._log_pick(key, m)
            runner = self.runner(backend, cfg, key)
            miss_key = (key, bucket_for(m, DEFAULT_M_BUCKETS)) if miss else None
            hit = (backend, cfg, runner, miss_key)
            if len(self._memo) > 1 << 16:
                self._memo.clear()
            self._memo[(key, m)] = hit
        if hit[3] is not None:
            renewed = self.count_miss(hit[3], experts_global)
            if renewed is not None:  # the miss hook stored a row for this call just now
                return renewed.resolve_entry(key, m, experts_global)
        return hit

    # -- misses ----------------------------------------------------------------------
    def count_miss(self, mk: tuple[ProblemKey, int], experts_global: int = 0) -> "Dispatcher | None":
        """Count one more call of an untuned ``(key, M bucket)`` (the miss of :meth:`resolve_entry`;
        ``experts_global`` as there) and pass it to the miss hook. Returns the dispatcher to
        resolve the call with again where the hook stored a row for it (blocking just-in-time
        tuning), else None."""
        with self._lock:
            first = not self._misses
            self._misses[mk] = self._misses.get(mk, 0) + 1
            if experts_global > mk[0].experts:
                self._miss_eg[mk] = experts_global
        if first:
            _register_pending(self)
        hook = self.on_miss
        return None if hook is None else hook(self, mk)

    def miss_experts_global(self, mk: tuple[ProblemKey, int]) -> int:
        """The global expert count recorded with a MoE slice's miss (0: not a slice)."""
        return self._miss_eg.get(mk, 0)

    def misses(self) -> list[tuple[ProblemKey, int, int]]:
        """The misses counted since the last flush: ``(key, standard M bucket, calls)``."""
        with self._lock:
            return [(k, m, c) for (k, m), c in self._misses.items()]

    def flush_misses(self, path: str | os.PathLike | None = None) -> Path | None:
        """Merge the counted misses into the misses JSON file (atomic replace); reset counts.

        ``path`` defaults to ``misses_file`` (given to the constructor, else the file next to
        the user DB in use when the dispatcher was built, :func:`misses_path`). Returns the
        path written, or ``None`` when there was nothing to write.
        """
        with self._lock:
            pending = dict(self._misses)
            eg = dict(self._miss_eg)
            self._misses.clear()
        if not pending:
            return None
        target = Path(path) if path is not None else self.misses_file
        with _folder_lock(target.parent):  # processes exiting at once add up
            try:  # a file that is not a misses file autofp4 reads (another version, other data) is kept
                existing = _read_misses(target) if os.path.lexists(target) else []
            except (ValueError, OSError) as e:
                warnings.warn(f"autofp4: misses not recorded: {target} is left as it is ({e}); "
                              f"{sum(pending.values())} misses of this process not written", RuntimeWarning,
                              stacklevel=2)
                return None
            merged: dict[tuple, int] = {}
            for key, m, c, g in existing:
                merged[(key, m)] = merged.get((key, m), 0) + c
                if g:
                    eg.setdefault((key, m), g)
            for mk, c in pending.items():
                merged[mk] = merged.get(mk, 0) + c
            _write_misses(target, merged, eg)
        return target


@contextlib.contextmanager
def _folder_lock(folder: Path, timeout_s: float = 10.0) -> Iterator[None]:
    """An exclusive ``flock`` on ``folder`` (no file left behind), for a read-modify-write of a
    file in it by several processes; without one (no fcntl, a folder that cannot be opened, still
    held by another process after ``timeout_s``) the block runs unlocked."""
    try:
        import fcntl

        fd = os.open(folder, os.O_RDONLY)
    except (ImportError, OSError):
        yield
        return
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.01)
        yield
    finally:
        os.close(fd)


# -- misses file ----------------------------------------------------------------------
def _write_misses(path: Path, merged: dict[tuple[ProblemKey, int], int], eg: dict[tuple[ProblemKey, int], int]) -> None:
    items = sorted(merged.items(), key=lambda kv: (-kv[1], str(kv[0][0]), kv[0][1]))
    doc = {
        "version": MISSES_VERSION,
        "misses": [{**_key_dict(k), "m": m, "count": c, **({"experts_global": eg[k, m]} if (k, m) in eg else {})}
                   for (k, m), c in items],
    }
    from .db import write_text_atomic

    write_text_atomic(path, json.dumps(doc, indent=1) + "\n")


#: the largest N, K or M a misses file may name (far above any model's)
_MAX_DIM = 1 << 20


_MAX_MISSES_BYTES = 64 * 2**20


#: the fields of a misses file's entry and their types; ``count``, ``experts``, ``topk`` and
#: ``experts_global`` may be left out (1, 0, 0, 0)
_MISS_FIELDS: dict[str, type] = {"op": str, "fmt": str, "dtype": str, "n": int, "k": int, "experts": int,
                                 "topk": int, "m": int, "count": int, "experts_global": int}
_MISS_REQUIRED = ("op", "fmt", "dtype", "n", "k", "m")
#: the errors listed for an invalid misses file
_MAX_MISS_ERRORS = 20


def _json_text(v: Any, limit: int = 60) -> str:
    """``v`` as the JSON it was read from (``true``, ``"64"``, ``NaN``), cut to ``limit`` characters."""
    try:
        text = json.dumps(v)
    except (TypeError, ValueError):
        text = repr(v)
    return text if len(text) <= limit else text[:limit] + "..."


def _miss_entry(e: Any) -> tuple[tuple[ProblemKey, int, int, int] | None, list[str]]:
    """One entry of a misses file, checked strictly: ``(key, m, count, experts_global)``, or None
    and what is wrong with it (each field named; ints are ints, not floats, strings or bools)."""
    if not isinstance(e, dict):
        return None, [f"{_json_text(e)} is not an object"]
    errors = [f"missing field {f!r}" for f in _MISS_REQUIRED if f not in e]
    errors += [f"unknown field {str(f)!r:.60}" for f in e if f not in _MISS_FIELDS]
    for f, t in _MISS_FIELDS.items():
        if f in e and not (isinstance(e[f], t) and not isinstance(e[f], bool)):
            errors.append(f"field {f!r}: {_json_text(e[f])} is not {'an integer' if t is int else 'a string'}")
    if errors:
        return None, errors
    n, k, m = e["n"], e["k"], e["m"]
    c, experts, topk, g = e.get("count", 1), e.get("experts", 0), e.get("topk", 0), e.get("experts_global", 0)
    top = DEFAULT_M_BUCKETS[-1]
    for f, v, lo, hi in (("n", n, 1, _MAX_DIM), ("k", k, 1, _MAX_DIM), ("count", c, 1, 2**63 - 1),
                         ("experts", experts, 0, 8192), ("topk", topk, 0, 8192), ("experts_global", g, 0, 8192)):
        if not lo <= v <= hi:
            errors.append(f"field {f!r}: {v} is not from {lo} to {hi}")
    if not 1 <= m <= top:
        errors.append(f"field 'm': {m} is not an M bucket the dispatcher looks up (1 to {top}; it counts a miss "
                      f"of M tokens at M's bucket, at most {top})")
    if errors:
        return None, errors
    try:
        key = ProblemKey(e["op"], e["fmt"], e["dtype"], n, k, experts, topk)
    except ValueError as err:
        return None, [str(err)]
    bad_shape = shape_errors(key.op, key.fmt, key.n, key.k)
    if bad_shape:
        return None, [f"field {f!r}: {why}" for f, why in bad_shape.items()]
    if g and (not is_moe(key.op) or g <= key.experts):
        return None, [f"experts_global={g} needs a MoE key with fewer experts, got {key}"]
    return (key, m, c, g), []


def _read_misses(path: Path) -> list[tuple[ProblemKey, int, int, int]]:
    """The entries of the misses file ``path``, checked; ``FileNotFoundError`` where there is none,
    ``ValueError`` naming it and what is wrong where it is not one autofp4 reads."""
    if not path.exists():
        raise FileNotFoundError(f"misses file not found: {path}")
    try:
        if not path.is_file():  # a FIFO or device would block or never end
            raise ValueError("not a regular file")
        if path.stat().st_size > _MAX_MISSES_BYTES:
            raise ValueError(f"larger than {_MAX_MISSES_BYTES} bytes")
        doc = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(doc, dict) or doc.get("version") != MISSES_VERSION:
            raise ValueError(f"expected a JSON object with version {MISSES_VERSION}")
        entries = doc.get("misses", [])
        if not isinstance(entries, list):
            raise ValueError(f"'misses' is a {type(entries).__name__}, not a list")
        out, errors = [], []
        for i, e in enumerate(entries):
            got, why = _miss_entry(e)
            if got is not None:
                out.append(got)
            errors += [f"misses[{i}]{' ' if w.startswith('field') else ': '}{w}" for w in why]
            if len(errors) >= _MAX_MISS_ERRORS:
                errors = errors[:_MAX_MISS_ERRORS] + [f"... (the entries after misses[{i}] were not checked)"]
                break
        if errors:
            raise ValueError("\n  ".join(errors))
        merged: dict[tuple, list] = {}  # a (problem, M, slice) listed twice: its counts add up
        for key, m, c, g in out:
            row = merged.setdefault((key, m, g), [key, m, 0, g])
            row[2] += c
        return [tuple(r) for r in merged.values()]
    except RecursionError:
        raise ValueError(f"invalid misses file {path}: JSON nested too deep to be a misses file") from None
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"invalid misses file {path}: {e}") from None


def load_misses(path: str | os.PathLike | None = None,
                experts_global: bool = False) -> list[tuple]:
    """The misses recorded in ``path`` (default :func:`misses_path`): ``(key, m, count)``; with
    ``experts_global``, ``(key, m, count, experts_global)`` (0 where the miss was not a MoE slice
    of an expert-parallel layer)."""
    got = _read_misses(Path(path) if path is not None else misses_path())
    return got if experts_global else [r[:3] for r in got]


# -- process-wide dispatchers -----------------------------------------------------------
_DB_PATH: Path | None = None
_DISPATCHERS: dict[torch.device, Dispatcher] = {}
_PENDING: list[Dispatcher] = []
_STATE_LOCK = threading.Lock()
_ATEXIT = False
_MISS_HOOK: "MissHook | None" = None


def user_db_path() -> Path:
    """The user DB file in use: the one given to :func:`set_db`, else ``db.default_db_path()``."""
    if _DB_PATH is not None:
        return _DB_PATH
    from .db import default_db_path

    return Path(default_db_path())


_WARNED_PATHS: set[Path] = set()
_NOT_DIRS: set[Path] = set()  # the files in the way of a warned DB path (its misses file is not written)


def _warn_unusable_db_path(path: Path) -> None:
    """Warn once per path when the user DB cannot exist where it is named: its nearest existing
    ancestor is not a directory (``AUTOFP4_DB=/etc/hostname/t.db``), so no row is read from it
    and none can be stored or tuned into it."""
    if path in _WARNED_PATHS:
        return
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                _WARNED_PATHS.add(path)
                _NOT_DIRS.add(parent)
                warnings.warn(f"autofp4: the tuning DB {path} cannot exist: {parent} is not a directory; "
                              "no tuned rows are read from it and none can be stored (set AUTOFP4_DB to a "
                              "file in a directory)", RuntimeWarning, stacklevel=4)
            return


def misses_path() -> Path:
    """The misses file next to the user DB (``<db>.misses.json``)."""
    return user_db_path().with_suffix(".misses.json")


def _flush_all() -> None:
    for d in list(_PENDING):
        if d.misses_file is not None and _NOT_DIRS.intersection(Path(d.misses_file).parents):
            continue  # its DB path was warned about: no second warning at exit
        try:
            d.flush_misses()
        except Exception as e:  # never fail interpreter exit
            warnings.warn(f"autofp4: could not write the misses file: {e}", RuntimeWarning)


def _register_pending(d: Dispatcher) -> None:
    global _ATEXIT
    with _STATE_LOCK:
        if d not in _PENDING:
            _PENDING.append(d)
        if not _ATEXIT:
            atexit.register(_flush_all)
            _ATEXIT = True


def get_dispatcher(device: torch.device | str | int | None = None) -> Dispatcher:
    """The process-wide :class:`Dispatcher` of ``device`` (default: the current CUDA device, else
    the CPU; built on first use; it reads a problem's rows from the DB layers,
    :func:`autofp4.db.load_layers`, the first time it is asked about it)."""
    d = _DISPATCHERS.get(device)  # fast path: tensors' devices carry an index
    if d is not None:
        return d
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    dev = _checked_device(device)
    with _STATE_LOCK:
        d = _DISPATCHERS.get(dev)
        if d is None:
            from .db import layer_results, load_layers
            from .env import current_environment

            env = current_environment(dev)
            db_path = user_db_path()
            _warn_unusable_db_path(db_path)

            def rows_for(key: ProblemKey, env: Any = env, db_path: Path = db_path) -> list[Any]:
                return load_layers(env, user_path=db_path, problem=key)

            d = Dispatcher(dev, env=env, misses_file=db_path.with_suffix(".misses.json"), rows_for=rows_for)
            d.layers_for = lambda key, env=env, db_path=db_path: layer_results(env, user_path=db_path, problem=key)
            d.on_miss = _MISS_HOOK
            _DISPATCHERS[dev] = d
    if isinstance(device, torch.device) and device == dev:
        _DISPATCHERS[device] = d
    return d


def refresh() -> None:
    """Replace every process-wide dispatcher by its renewal (:meth:`Dispatcher.renewed`): rows
    stored since they read theirs are used from the next call on, without a restart."""
    with _STATE_LOCK:
        renewals = {id(d): d.renewed() for d in _DISPATCHERS.values()}
        for dev, d in list(_DISPATCHERS.items()):
            _DISPATCHERS[dev] = renewals[id(d)]


def set_miss_hook(hook: MissHook | None) -> None:
    """Call ``hook(dispatcher, (key, standard M bucket))`` on every miss of the process-wide
    dispatchers (after it is counted; None: no hook). It returns the dispatcher to resolve the
    call with again (it stored a row for it) or None (the call runs its default)."""
    global _MISS_HOOK
    with _STATE_LOCK:
        _MISS_HOOK = hook
        for d in _DISPATCHERS.values():
            d.on_miss = hook


def set_db(path: str | os.PathLike | None) -> None:
    """Use ``path`` as the user tuning DB (``None``: back to the default) and drop dispatchers."""
    from .db import expand_path
    from .paths import unusable_path

    if path is not None:
        try:
            why = unusable_path(path)
            Path(path)  # bytes pass os.fspath, not Path
        except TypeError:
            raise TypeError(f"set_db(path): path must be a str, os.PathLike or None, "
                            f"got {type(path).__name__}") from None
        if why is not None:
            raise ValueError(f"set_db({path!r:.80}): {why}")
    new = expand_path(path, "the tuning DB path", file=True, written=True, sqlite=True) if path is not None else None
    if new is not None and new.is_dir():
        raise ValueError(f"set_db({path!r:.80}): that is a folder (a directory); name the DB file in it "
                         f"(such as {str(new / 'tuning.db')!r})")
    _use_db_path(new)


def _use_db_path(path: Path | None) -> None:
    """Make ``path`` (expanded; None: the default) the user DB and drop the dispatchers. The
    command line's ``--db``, whose commands each report a path they cannot use in their own terms
    (``info`` lists it), comes here directly."""
    global _DB_PATH
    _DB_PATH = path
    reload()


def reload() -> None:
    """Forget the loaded dispatchers; the next call reloads the DB layers."""
    with _STATE_LOCK:
        _DISPATCHERS.clear()
