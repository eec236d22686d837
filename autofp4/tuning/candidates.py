"""The candidate configs of a job: each backend's default, the winners stored for the job and
for its neighbours, the backends' seeds, then every backend's candidates; which backends apply
to a problem, and the results already stored for a job."""
from __future__ import annotations

import functools
import inspect
import json
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Sequence

from ..backends.base import Backend, BackendConfig
from ..dispatch import is_stale
from ..problem import FORMATS, ProblemKey
from ..schema import TuningRecord
from .jobs import _Ctx


@functools.lru_cache(maxsize=1 << 12)
def _value_text(kind: type, value: Any) -> str:
    """The JSON text of one scalar config value (``kind``: its type, so that True and 1 differ)."""
    return json.dumps(value, allow_nan=False)


@functools.lru_cache(maxsize=1 << 18)
def _field_texts(backend: Backend, cfg: BackendConfig) -> dict[str, str]:
    """``{field: JSON text of its value}`` of a stored config (``kernel`` included), remembered:
    built from a few hundred distinct scalar texts instead of one ``json.dumps`` per value.
    Callers must not change the dict."""
    d = backend.config_dict(cfg)
    if not all(isinstance(v, (bool, int, float, str, type(None))) for v in d.values()):
        return {k: json.dumps(v, sort_keys=True, separators=(",", ":"), allow_nan=False) for k, v in d.items()}
    return {k: _value_text(type(v), v) for k, v in d.items()}


@functools.lru_cache(maxsize=1 << 18)
def _cfg_json(backend: Backend, cfg: BackendConfig) -> str:
    """The canonical JSON of ``backend``'s (frozen, hashable) config as stored (what
    :func:`autofp4.schema.config_json` gives), remembered: every M bucket of a shape lists the same
    30-40 thousand Hopper configs, and a just-in-time worker meets a model's shapes in turn (a
    cache smaller than their union misses on every one)."""
    texts = _field_texts(backend, cfg)
    return "{" + ",".join(f"{_value_text(str, k)}:{texts[k]}" for k in sorted(texts)) + "}"


@dataclass(frozen=True)
class _Cand:
    backend: Backend
    config: BackendConfig
    config_json: str
    first: bool = False  # the job's default or a backend's seed: tried before sampling
    prior: bool = False  # a winner stored by an earlier run: measured even past the job's time share

    @property
    def ident(self) -> str:
        return f"{self.backend.name}:{self.config_json}"


def _valid_defaults(key: ProblemKey, m: int, backends: Sequence[Backend]) -> Iterator[_Cand]:
    """Each backend's default config for ``(key, m)`` where valid, in backend order: the first
    is every job's first trial."""
    for b in backends:
        cfg = b.default(key, m)
        if b.is_valid(cfg, key) is None:
            yield _Cand(b, cfg, _cfg_json(b, cfg), first=True)


def _sibling_records(recs: Iterable[TuningRecord], key: ProblemKey, m: int) -> list[TuningRecord]:
    """Among ``recs`` (one environment's rows), the winners of the jobs nearest to ``(key, m)``:
    the same problem in the other formats at the same M bucket, then in the same format at the
    nearest stored M buckets below and above. Configs do not name the format or M, and the
    winner of a neighbour is a better first guess than a random sample."""
    same = [r for r in recs if (r.op, r.dtype, r.n, r.k, r.experts, r.topk)
            == (key.op, key.dtype, key.n, key.k, key.experts, key.topk)]
    out = [r for r in same if r.fmt != key.fmt and r.m_bucket == m]
    mine = {r.m_bucket for r in same if r.fmt == key.fmt}
    near = [max((b for b in mine if b < m), default=None), min((b for b in mine if b > m), default=None)]
    out += [r for b in near if b is not None for r in same if r.fmt == key.fmt and r.m_bucket == b]
    return out


#: winners of other problems a job tries first (after its own and its neighbours')
OTHER_PROBLEM_WINNERS = 4


def _other_problem_winners(recs: Iterable[TuningRecord], key: ProblemKey, m: int, backends: Sequence[Backend],
                           limit: int = OTHER_PROBLEM_WINNERS) -> list[tuple[Backend, BackendConfig]]:
    """Up to ``limit`` distinct configs, valid for ``key``, that won other problems of the same op
    and dtype at the same M bucket: among ``recs`` (rows of any environment) and the shipped
    exports' rows (other GPUs' too), the same format first, then the shapes nearest to ``key`` (N,
    K and experts on a log scale). A shape nobody tuned starts from what won its neighbours, not
    only from the seeds."""
    import math

    from ..db import shipped_raw_winners

    by_name = {b.name: b for b in backends}
    rows = [(r.backend, r.config, r.fmt, r.n, r.k, r.experts, r.topk) for r in recs
            if (r.op, r.dtype, r.m_bucket) == (key.op, key.dtype, m)]
    for r in shipped_raw_winners(key.op, key.dtype, m):
        try:
            rows.append((r["backend"], dict(r["config"]), r["fmt"], int(r["n"]), int(r["k"]), int(r.get("experts", 0)),
                         int(r.get("topk", 0))))
        except (KeyError, TypeError, ValueError):
            continue

    def far(a: int, b: int) -> float:
        return abs(math.log2(max(a, 1) / max(b, 1)))

    scored = []
    for backend, config, fmt, n, k, experts, topk in rows:
        if backend not in by_name or (n, k, experts, topk) == (key.n, key.k, key.experts, key.topk):
            continue  # the same problem's rows are its own or its siblings
        scored.append(((fmt != key.fmt, far(n, key.n) + far(k, key.k) + far(experts, key.experts)), backend, config))
    scored.sort(key=lambda t: t[0])
    out: list[tuple[Backend, BackendConfig]] = []
    seen: set[str] = set()
    for _, backend, config in scored:
        b = by_name[backend]
        try:
            cfg = b.parse_config(config)
        except (TypeError, ValueError):
            continue
        ident = _cfg_json(b, cfg)
        if ident in seen or b.is_valid(cfg, key) is not None:
            continue
        seen.add(ident)
        out.append((b, cfg))
        if len(out) == limit:
            break
    return out


def _first_candidates(
    key: ProblemKey, m: int, backends: Sequence[Backend], stored: Sequence[tuple[Backend, BackendConfig]] = (),
    seeds: int | None = None, siblings: Sequence[tuple[Backend, BackendConfig]] = (),
) -> Iterator[_Cand]:
    """The configs a job tries before any search, in order, valid ones only (repeats possible):
    the first backend's default, the ``stored`` winners of an earlier run (a re-tune starts from
    them), each followed by its backend's ``variants`` of it, the winners of neighbouring jobs
    (``siblings``: :func:`_sibling_records`, then :func:`_other_problem_winners`), the other
    backends' defaults, then each backend's seeds (its first ``seeds``)."""
    defaults = list(_valid_defaults(key, m, backends))
    yield from defaults[:1]
    for b, cfg in stored:
        for c in (cfg, *b.variants(cfg, key, m)):
            if b.is_valid(c, key) is None:
                yield _Cand(b, c, _cfg_json(b, c), first=True, prior=c is cfg)
    for b, cfg in siblings:
        if b.is_valid(cfg, key) is None:
            yield _Cand(b, cfg, _cfg_json(b, cfg), first=True)
    yield from defaults[1:]
    for b in backends:
        for cfg in list(b.seeds(key, m))[:seeds]:
            if b.is_valid(cfg, key) is None:
                yield _Cand(b, cfg, _cfg_json(b, cfg), first=True)


def _candidates(
    key: ProblemKey, m: int, backends: Sequence[Backend], stored: Sequence[tuple[Backend, BackendConfig]] = (),
    siblings: Sequence[tuple[Backend, BackendConfig]] = (),
) -> list[_Cand]:
    """:func:`_first_candidates` (marked ``first``: tried before the search samples), then
    every backend's candidates (valid ones: ``Backend.candidates`` checks them, so they are not
    checked twice)."""
    return _job_candidates(key, m, backends, stored, siblings)[0]


def _job_candidates(
    key: ProblemKey, m: int, backends: Sequence[Backend], stored: Sequence[tuple[Backend, BackendConfig]] = (),
    siblings: Sequence[tuple[Backend, BackendConfig]] = (), firsts_within: int | None = None,
) -> tuple[list[_Cand], bool]:
    """:func:`_candidates`, and whether they were narrowed to the first ones: with
    ``firsts_within`` (a job that tries only its ranked first candidates, on a budget of that many
    trials), where there are more candidates than that (the job's search would sample them),
    only the first ``firsts_within // 2`` (at least one) of :func:`_first_candidates`, the ones
    the search queues before it samples; the rest of the grid is not built."""
    out: list[_Cand] = []
    seen: set[str] = set()

    def add(c: _Cand) -> None:
        if c.ident not in seen:
            seen.add(c.ident)
            out.append(c)

    for c in _first_candidates(key, m, backends, stored, siblings=siblings):
        add(c)
    n_first = len(out)
    for b in backends:
        for cfg in _iter_backend_candidates(b, key, m):
            add(_Cand(b, cfg, _cfg_json(b, cfg)))
            if firsts_within is not None and len(out) > firsts_within:
                return out[: min(n_first, max(1, firsts_within // 2))], True
    return out, False


def _iter_backend_candidates(b: Backend, key: ProblemKey, m: int) -> Iterator[BackendConfig]:
    """:func:`_backend_candidates` one at a time where the backend can list them so
    (``iter_candidates``)."""
    lazy = getattr(b, "iter_candidates", None)
    return iter(lazy(key, m)) if callable(lazy) else iter(_backend_candidates(b, key, m))


def _backend_candidates(b: Backend, key: ProblemKey, m: int) -> list[BackendConfig]:
    """``b.candidates(key, m)`` where the backend narrows its grid by M, else ``candidates(key)``."""
    try:
        takes_m = "m" in inspect.signature(b.candidates).parameters
    except (TypeError, ValueError):
        takes_m = False
    return list(b.candidates(key, m=m) if takes_m else b.candidates(key))


def _applicable(key: ProblemKey, backends: Sequence[Backend], reference_as_fallback: bool = False) -> list[Backend]:
    """The backends that support ``key``. With ``reference_as_fallback`` (backends chosen
    automatically) the reference backend, the correctness oracle, is only a candidate where
    no other backend supports the key: it would cost a trial per job and never win."""
    out = [b for b in backends if b.supports(key) is None]
    if reference_as_fallback and any(b.name != "reference" for b in out):
        out = [b for b in out if b.name != "reference"]
    return out


def _stored_results(db: Any, ctx: _Ctx, key: ProblemKey, m: int, backends: list[Backend]
                    ) -> tuple[list[TuningRecord], list[TuningRecord], list[TuningRecord]]:
    """This environment's results for the job: those measured with the current source of their
    config's kernel, the stale ones (an older source: the job runs again, but their winners
    are still the best first guesses of the new run), and the rows of the same problem in every
    format and M bucket (for :func:`_sibling_records`). One query (every format named: the
    DB's problem index serves it)."""
    by_name = {b.name: b for b in backends}
    problem = db.results(ctx.env_key, op=key.op, fmt=list(FORMATS), dtype=key.dtype, backend=list(by_name), n=key.n,
                         k=key.k, experts=key.experts, topk=key.topk)
    recs = [r for r in problem if r.fmt == key.fmt and r.m_bucket == m]
    stale = [is_stale(r, by_name[r.backend]) for r in recs]
    return [r for r, s in zip(recs, stale) if not s], [r for r, s in zip(recs, stale) if s], problem


def _parsed(recs: Iterable[TuningRecord], backends: Sequence[Backend]) -> list[tuple[Backend, BackendConfig]]:
    """The records' configs, parsed by their backends (among ``backends``; records of other
    backends and configs that no longer parse are left out)."""
    by_name = {b.name: b for b in backends}
    out = []
    for r in recs:
        try:
            out.append((by_name[r.backend], by_name[r.backend].parse_config(r.config)))
        except (KeyError, TypeError, ValueError):
            continue
    return out
