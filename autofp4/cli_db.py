"""``autofp4 db``: inspect, export, import, merge, diff and prune the tuning database.

Exit codes: 0 success; 1 nothing found (``show``) or differences found (``diff``);
2 bad input (missing file, invalid JSON, failed validation, unreadable or read-only database).
"""
from __future__ import annotations

import argparse
import os
import sqlite3
import sys
from pathlib import Path
from typing import Any, Sequence, TextIO

from .db import (
    SQLITE_SIDE_FILES,
    is_sqlite_file,
    sqlite_would_open,
    Difference,
    MergeReport,
    TuningDB,
    TuningDBError,
    TuningFileError,
    default_db_path,
    expand_path,
)
from .paths import REGULAR, arg_type, kind_of, not_regular
from .problem import DTYPES, FORMATS, OPS
from .schema import MAX_DIM, MAX_EXPERTS, TuningRecord, config_json

SUBCOMMANDS = ("list", "show", "export", "import", "merge", "diff", "prune")
_DESCRIPTION = """Inspect, export, import, merge, diff and prune the tuning database.

Exit codes: 0 success; 1 nothing found (show) or differences found (diff);
2 bad input (missing file, invalid JSON, failed validation, unreadable or read-only database)."""


class UsageError(Exception):
    """Bad command-line input (exit code 2)."""


# --------------------------------------------------------------------------------------
# parser
# --------------------------------------------------------------------------------------
def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--db", metavar="PATH", default=None,
                   help="tuning database (default: $AUTOFP4_DB or ~/.cache/autofp4/tuning.db)")


def _int_in(lo: int, hi: int):
    """An argparse type: an integer from ``lo`` to ``hi`` (the range the tuning DB stores; argparse
    names the option in its error)."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"expected an integer from {lo} to {hi}, got {text}")
        return v

    parse.__name__ = "integer"  # argparse's "invalid <name> value" line
    return parse


def _backend_filter(text: str) -> str:
    """An argparse type: a backend name to filter by (an empty one, as an unset shell variable
    gives, is refused rather than matching nothing)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"expected a backend name, got {text!r}")
    return text.strip()


_backend_filter.__name__ = "backend"


def _add_key_filters(p: argparse.ArgumentParser) -> None:
    p.add_argument("--op", choices=OPS)
    p.add_argument("--fmt", choices=FORMATS)
    p.add_argument("--dtype", choices=DTYPES)
    p.add_argument("--backend", type=_backend_filter)
    p.add_argument("--m", "--m-bucket", dest="m_bucket", type=_int_in(1, MAX_DIM), metavar="M", help="M bucket")
    p.add_argument("--n", type=_int_in(1, MAX_DIM))
    p.add_argument("--k", type=_int_in(1, MAX_DIM))
    p.add_argument("--experts", type=_int_in(0, MAX_EXPERTS))
    p.add_argument("--topk", type=_int_in(0, MAX_EXPERTS))
    p.add_argument("--env", default="all", metavar="current|all|KEY",
                   help="environment: the running one, all (default) or an env key")


def add_db_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``db`` and its sub-commands on ``subparsers`` (from ``add_subparsers()``)."""
    db = subparsers.add_parser("db", help="inspect and share the tuning database", description=_DESCRIPTION,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = db.add_subparsers(dest="db_command", metavar="{" + ",".join(SUBCOMMANDS) + "}")
    sub.required = True

    p = sub.add_parser("list", help="table of tuned results")
    _add_common(p)
    _add_key_filters(p)

    p = sub.add_parser("show", help="one key's result rows and all of its trials")
    _add_common(p)
    _add_key_filters(p)

    p = sub.add_parser("export", help="write results as sorted, reviewable JSON")
    _add_common(p)
    p.add_argument("--out", required=True, type=arg_type(True, "tuning.json", written=True), metavar="FILE", help="the JSON file to write ('-': standard output)")
    p.add_argument("--env", default="all", metavar="current|all|KEY")

    p = sub.add_parser("import", help="validate an export and merge it in")
    _add_common(p)
    p.add_argument("file", type=arg_type(True, "tuning.json"), metavar="FILE")
    p.add_argument("--replace", action="store_true",
                   help="the file's rows win every key (default: the better-evidenced row wins)")

    p = sub.add_parser("merge", help="merge another database or export in")
    _add_common(p)
    p.add_argument("other", type=arg_type(True, "other.db"), metavar="OTHER.db|OTHER.json")

    p = sub.add_parser("diff", help="keys whose rows differ from another database or export")
    _add_common(p)
    p.add_argument("other", type=arg_type(True, "other.db"), metavar="OTHER.db|OTHER.json")

    p = sub.add_parser("prune", help="delete old, foreign-environment or failed rows")
    _add_common(p)
    p.add_argument("--older-than-days", type=float, metavar="DAYS")
    p.add_argument("--env", default=None, metavar="current|KEY", help="rows of this environment")
    p.add_argument("--keep-current-env-only", action="store_true",
                   help="delete rows of every environment but the running one")
    p.add_argument("--failed-trials", action="store_true", help="delete failed trials only")
    p.add_argument("--stale", action="store_true",
                   help="delete the results measured with an older source of their kernel (never used; "
                        "a re-tune tries their winners first, so prune them after re-tuning)")
    p.add_argument("--unused-buckets", action="store_true",
                   help="delete the results of M buckets the dispatcher never looks up (e.g. tuned with an "
                        "--m above 8192 by an older autofp4); import and merge refuse such rows")

    db.set_defaults(func=run_db)
    return db


# --------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------
def _db_path(args: argparse.Namespace) -> Path:
    return expand_path(args.db, "--db", file=True, written=True, sqlite=True) if getattr(args, "db", None) is not None else default_db_path()


def _not_a_file(path: Path) -> str | None:
    """Why the existing ``path`` cannot be a tuning database file (None: it is a regular file)."""
    kind = kind_of(path)
    if kind == "a directory":
        return f"{path} is a directory, not a tuning database file"
    if kind not in (None, REGULAR):
        return f"{not_regular(path, kind)}, not a tuning database"
    return None


def _open(args: argparse.Namespace, *, write: bool) -> TuningDB:
    path = _db_path(args)
    why = _not_a_file(path)
    if why is not None:
        raise UsageError(why)
    if write:
        return TuningDB(path)
    if not path.is_file():
        raise UsageError(f"no tuning database at {path}")
    try:
        return TuningDB(path, readonly=True)
    except TuningDBError as e:
        if "needs migrating" not in str(e):
            raise
        return TuningDB(path)  # an older schema: migrate it once, then read


def _env_key(spec: str | None) -> str | None:
    if spec is None or spec == "all":
        return None
    if spec == "current":
        from .env import current_environment

        return current_environment().key()
    if len(spec) != 16 or any(c not in "0123456789abcdef" for c in spec):
        raise UsageError(f"--env must be 'current', 'all' or a 16-hex-digit env key, got {spec!r}")
    return spec


def _filters(args: argparse.Namespace) -> dict[str, Any]:
    names = ("op", "fmt", "dtype", "backend", "m_bucket", "n", "k", "experts", "topk")
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}


def _fmt_us(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def _table(rows: list[list[str]], header: list[str], out: TextIO) -> None:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    right = {i for i, h in enumerate(header) if h in {"M", "N", "K", "E", "topk", "median_us", "default_us",
                                                        "speedup", "spread_us", "m", "samples"}}
    for row in [header, *rows]:
        cells = [str(c).rjust(w) if i in right else str(c).ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
        print("  ".join(cells).rstrip(), file=out)


def _result_rows(recs: list[TuningRecord]) -> list[list[str]]:
    rows = []
    for r in recs:
        sp = r.speedup
        rows.append([
            r.op, r.fmt, r.dtype, r.backend, str(r.m_bucket), str(r.n), str(r.k), str(r.experts),
            str(r.topk), _fmt_us(r.median_us), _fmt_us(r.default_median_us),
            "-" if sp is None else f"{sp:.2f}x", r.env_key,
        ])
    return rows


RESULT_HEADER = ["op", "fmt", "dtype", "backend", "M", "N", "K", "E", "topk",
                 "median_us", "default_us", "speedup", "env"]


def _print_report(rep: MergeReport, out: TextIO) -> None:
    print(rep.summary(), file=out)
    for c in rep.conflicts:
        print(f"  conflict: {c.describe()}", file=out)


# --------------------------------------------------------------------------------------
# sub-commands
# --------------------------------------------------------------------------------------
def _is_export(path: Path) -> bool:
    """Whether ``path`` is a file that reads as an export (JSON: its first non-blank byte ``{``),
    not a database."""
    try:
        if not path.is_file():
            return False
        with path.open("rb") as f:
            head = f.read(4096).lstrip()
    except OSError:
        return False
    return head[:1] == b"{"


def _export_results(path: Path, env_key: str | None, filters: dict[str, Any]) -> list[TuningRecord]:
    """The results of the export at ``path`` (of ``env_key``, or all) that match ``filters``."""
    from .db import read_export

    doc = read_export(path)
    recs = [r.to_record(doc.environments[r.env_key]) for r in doc.records if env_key in (None, r.env_key)]
    return [r for r in recs if all(getattr(r, f) == v for f, v in filters.items())]


def _layers(args: argparse.Namespace, env_key: str | None) -> list[tuple[str, list[TuningRecord]]]:
    """``(label, results)`` of what ``list`` reads: the file of ``--db`` (a database or an
    export), else every layer the dispatcher reads, in its order (the user database, then each
    shipped export)."""
    from .db import shipped_db_files

    filters = _filters(args)
    if getattr(args, "db", None) is not None:
        path = _db_path(args)
        if _is_export(path):
            return [(str(path), _export_results(path, env_key, filters))]
        with _open(args, write=False) as db:
            return [(str(path), db.results(env_key, **filters))]
    out = []
    user = default_db_path()
    why = _not_a_file(user)
    if why is not None:  # the dispatcher warns and reads no rows from it
        raise UsageError(f"the user tuning DB{' ($AUTOFP4_DB)' if os.environ.get('AUTOFP4_DB') else ''}: {why}")
    if user.is_file():
        with TuningDB(user, readonly=True) as db:
            out.append(("user", db.results(env_key, **filters)))
    for f in shipped_db_files():
        out.append((f.name, _export_results(f, env_key, filters)))
    return out


def _cmd_list(args: argparse.Namespace, out: TextIO) -> int:
    layers = _layers(args, _env_key(args.env))
    if getattr(args, "db", None) is not None:
        recs = layers[0][1]
        _table(_result_rows(recs), RESULT_HEADER, out)
        print(f"{len(recs)} results", file=out)
        return 0
    # every layer the dispatcher reads: where a key is in several, the first one's row runs
    rows = [[label, *row] for label, recs in layers for row in _result_rows(recs)]
    _table(rows, ["layer", *RESULT_HEADER], out)
    names = ", ".join(f"{label} ({len(recs)})" for label, recs in layers) or "none"
    print(f"{len(rows)} results in {len(layers)} layers, in the order the dispatcher reads them: {names}",
          file=out)
    return 0


def _cmd_show(args: argparse.Namespace, out: TextIO) -> int:
    filters = _filters(args)
    env_key = _env_key(args.env)
    path = _db_path(args)
    if _is_export(path):  # an export: results, no trials
        recs, trials, envs = _export_results(path, env_key, filters), [], {}
    else:
        with _open(args, write=False) as db:
            recs = db.results(env_key, **filters)
            trials = db.trials(env_key, **filters)
            envs = db.environments()
    if not recs and not trials:
        print("no results or trials match", file=out)
        return 1
    for r in recs:
        print(f"result  {r.describe()}  env={r.env_key}", file=out)
        print(f"  config      {config_json(r.config)}", file=out)
        print(f"  median_us   {_fmt_us(r.median_us)} (spread {_fmt_us(r.spread_us)}, {r.samples} samples)", file=out)
        sp = r.speedup
        print(f"  default_us  {_fmt_us(r.default_median_us)}"
              f"{'' if sp is None else f' (speedup {sp:.2f}x)'}", file=out)
        print(f"  source      {r.backend_source or '-'}  created {r.created_at}", file=out)
        print(f"  env         {r.env.gpu_name}, sm={r.env.sm_count}, cc={r.env.compute_capability}, "
              f"driver={r.env.driver or '-'}, cuda={r.env.cuda or '-'}, torch={r.env.torch}, "
              f"cutlass_dsl={r.env.cutlass_dsl or '-'}, autofp4={r.env.autofp4}", file=out)
    if trials:
        print(f"trials ({len(trials)}):", file=out)
        rows = [[t.backend, str(t.m_bucket), str(t.m), t.outcome, _fmt_us(t.median_us), _fmt_us(t.spread_us),
                 config_json(t.config), t.env_key, t.error.splitlines()[0][:80] if t.error else ""]
                for t in trials]
        _table(rows, ["backend", "M", "m", "outcome", "median_us", "spread_us", "config", "env", "error"], out)
    unknown = {t.env_key for t in trials} - set(envs)
    if unknown:
        print(f"(trials of unrecorded environments: {', '.join(sorted(unknown))})", file=out)
    return 0


def _cmd_export(args: argparse.Namespace, out: TextIO) -> int:
    from .db import export_json

    env_key = _env_key(args.env)
    if args.out != "-":
        _check_export_target(Path(args.out), _db_path(args))
    with _open(args, write=False) as db:
        if args.out == "-":
            doc = db.export_doc(env_key)
            out.write(export_json(doc))
            out.flush()
            print(f"wrote {len(doc.records)} records ({len(doc.environments)} environments) to standard output",
                  file=sys.stderr)
            return 0
        doc = db.export(args.out, env_key)
    print(f"wrote {len(doc.records)} records ({len(doc.environments)} environments) to {args.out}", file=out)
    return 0


def _check_export_target(target: Path, source: Path) -> None:
    """``db export --out``: an export replaces its target, so only a new file or an earlier export
    (never the database being exported, an SQLite file or its side files, a misses file, any other
    file)."""
    try:
        if target.exists() and source.exists() and target.resolve() == source.resolve():
            raise UsageError(f"--out {target} is the database being exported; write the export elsewhere")
        if target.is_dir():
            raise UsageError(f"--out {target} is a directory")
        if target.exists() and not target.is_file():
            raise UsageError(f"--out {target} is not a regular file (a device, FIFO or socket); an export "
                             "replaces its target, so name a file")
        for parent in target.absolute().parents:
            if parent.exists():
                if not parent.is_dir():
                    raise UsageError(f"--out {target}: {parent} is a file, not a folder")
                break
        if is_sqlite_file(target):
            raise UsageError(f"--out {target} is an SQLite database; an export would replace it")
        for suffix, what in SQLITE_SIDE_FILES.items():
            base = target.with_name(target.name[: -len(suffix)]) if target.name.endswith(suffix) else None
            if base is not None and (sqlite_would_open(base) or (source.exists() and base.resolve() == source.resolve())):
                raise UsageError(f"--out {target} is the {what} of the SQLite database {base}, which SQLite "
                                 "writes and deletes (an export there would corrupt or lose it); write the export "
                                 "elsewhere")
        if target.is_file():  # only an earlier export is replaced (not a misses file, not someone's data)
            from .db import read_export

            try:
                read_export(target)
            except (TuningFileError, TuningDBError) as e:
                first = str(e).splitlines()[0] if str(e) else type(e).__name__
                raise UsageError(f"--out {target} exists and is not a tuning export ({first}); an export would "
                                 "replace it: name a new file, or remove this one first") from None
    except OSError as e:
        raise UsageError(f"--out {target}: {e.strerror or e}") from None


def _cmd_import(args: argparse.Namespace, out: TextIO) -> int:
    _check_other(args.file)
    with _open(args, write=True) as db:
        rep = db.import_file(args.file, replace=args.replace)
    _print_report(rep, out)
    return 0


def _check_other(other: str) -> None:
    """An input file must exist and be a regular file (a directory or a device is named as such)."""
    kind = kind_of(other)
    if kind == REGULAR:
        return
    if kind == "a directory":
        raise UsageError(f"{other} is a directory, not a file")
    if kind is None:
        raise UsageError(f"no such file: {other}")
    raise UsageError(not_regular(other, kind))


def _cmd_merge(args: argparse.Namespace, out: TextIO) -> int:
    _check_other(args.other)
    with _open(args, write=True) as db:
        rep = db.merge(args.other)
    _print_report(rep, out)
    return 0


def _cmd_diff(args: argparse.Namespace, out: TextIO) -> int:
    _check_other(args.other)
    with _open(args, write=False) as db:
        diffs: list[Difference] = db.diff(args.other)
    for d in diffs:
        print(d.describe(), file=out)
    print(f"{len(diffs)} differences", file=out)
    return 1 if diffs else 0


def _cmd_prune(args: argparse.Namespace, out: TextIO) -> int:
    if args.env == "all":
        raise UsageError("prune --env takes 'current' or an env key, not 'all'")
    env_key = _env_key(args.env)
    others = (args.older_than_days is not None or env_key is not None or args.keep_current_env_only
              or args.failed_trials)
    alone = [f"--{n.replace('_', '-')}" for n in ("stale", "unused_buckets") if getattr(args, n)]
    if not others and not alone:
        raise UsageError("prune needs at least one of --older-than-days, --env, "
                         "--keep-current-env-only, --failed-trials, --stale, --unused-buckets")
    if alone and (others or len(alone) > 1):
        raise UsageError(f"prune {alone[0]} takes no other criterion")
    if args.older_than_days is not None and not 0 <= args.older_than_days <= 100_000:
        raise UsageError(f"--older-than-days must be between 0 and 100000 (about 270 years), got {args.older_than_days}")
    with _open(args, write=True) as db:
        if args.stale:
            from .dispatch import row_is_stale

            n = db.delete_results(r for r in db.results() if row_is_stale(r))
        elif args.unused_buckets:
            from .db import unused_bucket

            n = db.delete_results(r for r in db.results() if unused_bucket(r))
        else:
            n = db.prune(older_than_days=args.older_than_days, env_key=env_key,
                         keep_current_env_only=args.keep_current_env_only, failed_trials=args.failed_trials)
        counts = db.counts()
    print(f"deleted {n} rows; {counts['results']} results and {counts['trials']} trials remain", file=out)
    return 0


_COMMANDS = {
    "list": _cmd_list,
    "show": _cmd_show,
    "export": _cmd_export,
    "import": _cmd_import,
    "merge": _cmd_merge,
    "diff": _cmd_diff,
    "prune": _cmd_prune,
}


def run_db(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Run the parsed ``db`` sub-command; returns the exit code (2 for bad input)."""
    out = out or sys.stdout
    err = err or sys.stderr
    cmd = _COMMANDS.get(getattr(args, "db_command", None) or "")
    if cmd is None:
        print(f"error: expected a db sub-command ({', '.join(SUBCOMMANDS)})", file=err)
        return 2
    try:
        return cmd(args, out)
    except (UsageError, TuningDBError, TuningFileError, ValueError, OSError) as e:
        print(f"error: {e}", file=err)
        return 2
    except sqlite3.Error as e:  # a database damaged past what opening it checks
        print(f"error: {_db_path(args)}: {e}", file=err)
        return 2


def main(argv: Sequence[str] | None = None) -> int:
    """Stand-alone entry: ``python -m autofp4.cli_db list ...`` (same as ``autofp4 db ...``)."""
    parser = argparse.ArgumentParser(prog="autofp4")
    add_db_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["db", *(sys.argv[1:] if argv is None else argv)])
    return run_db(args)


if __name__ == "__main__":
    sys.exit(main())
