"""Opcode mix of one kernel from Nsight Compute's per-instruction SASS view.

What it reports: executed warp instructions per opcode (and per weight word step when
``--words``, the number of 32-lane warp steps over the weight words, is given), then with
``--hot N`` the N SASS lines executed most often, in address order, with their stall samples:
the inner loop. It reads a CSV export of a saved report, so it runs anywhere (no GPU);
``scripts/profile_kernels.py --ncu --full`` runs it on every report it saves.

    ncu -i REPORT.ncu-rep --page source --print-source sass --csv > sass.csv
    python scripts/sass_mix.py sass.csv --nk 57344,8192 [--hot 60]
"""
import argparse
import csv
import io
import re
import sys
from collections import Counter


def _num(s: str) -> float:
    s = (s or "").replace(",", "").strip()
    try:
        return float(s)
    except ValueError:
        return 0.0


def read_rows(path: str) -> list[dict]:
    text = open(path, encoding="utf-8", errors="replace").read()
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if '"Source"' in ln and "Instructions Executed" in ln), None)
    if start is None:
        sys.exit(f"{path}: no SASS table with a 'Source' and an 'Instructions Executed' column")
    return list(csv.DictReader(io.StringIO("\n".join(lines[start:]))))


def opcode(src: str) -> str:
    src = re.sub(r"^@!?U?P\w+\s+", "", src.strip())
    return src.split(" ")[0].split(".")[0] if src else ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv")
    ap.add_argument("--words", type=float, default=0.0, help="warp word steps (N*K/8/32)")
    ap.add_argument("--nk", default="", help="N,K of the weight: sets --words to N*K/256")
    ap.add_argument("--hot", type=int, default=0)
    args = ap.parse_args()
    if args.nk:
        n, k = (int(v) for v in args.nk.split(","))
        args.words = n * k / 256
    rows = read_rows(args.csv)
    exe_col = next(c for c in rows[0] if c.startswith("Instructions Executed"))
    stall_col = next((c for c in rows[0] if c.startswith("Warp Stall Sampling (All")), None)
    mix: Counter = Counter()
    total = 0.0
    for r in rows:
        n = _num(r[exe_col])
        mix[opcode(r["Source"])] += n
        total += n
    per = f", {total / args.words:.1f} per word" if args.words else ""
    print(f"{total:.0f} warp instructions{per}")
    for op, n in mix.most_common(24):
        w = f" {n / args.words:6.2f}/word" if args.words else ""
        print(f"  {op:<12} {n:12.0f} {100 * n / total:5.1f}%{w}")
    if args.hot:
        hot = sorted(rows, key=lambda r: -_num(r[exe_col]))[: args.hot]
        hot_ids = {id(r) for r in hot}
        print(f"\nthe {args.hot} most executed lines, in address order (executed, stall samples):")
        for r in rows:
            if id(r) in hot_ids:
                st = _num(r[stall_col]) if stall_col else 0
                print(f"  {r.get('Address', ''):>6} {_num(r[exe_col]):10.0f} {st:7.0f}  {r['Source'].strip()}")


if __name__ == "__main__":
    main()
