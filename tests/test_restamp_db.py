"""CPU checks of ``scripts/restamp_db.py``: which rows of an export it compiles and re-stamps."""
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import restamp_db as R  # noqa: E402

from autofp4.backends import get_backend  # noqa: E402


def _export(tmp_path, stale_hash: str | None) -> tuple[Path, list[dict]]:
    """Two current rows of the shipped export (a linear and a MoE one), the MoE one given
    ``stale_hash`` as its kernel hash if set."""
    doc = json.loads((ROOT / "tuning_db" / "nvidia-h200.json").read_text())
    rows = [next(r for r in doc["records"] if r["op"] == op) for op in ("linear", "moe")]
    for r in rows:
        assert r["backend_source"] == get_backend(r["backend"]).source_hash(r["config"])
    if stale_hash:
        rows[1] = dict(rows[1], backend_source=stale_hash)
    path = tmp_path / "export.json"
    path.write_text(json.dumps(dict(doc, records=rows)))
    return path, rows


def _run(monkeypatch, capsys, path, answer):
    """main() on ``path`` with the compiles answered by ``answer(tree, rows)``; the rows each
    compile call was given."""
    calls = []

    def compile_rows(tree, rows, arch, jobs):
        calls.append((tree, [r["backend_source"] for r in rows]))
        return [answer(tree, r) for r in rows]

    monkeypatch.setattr(R, "compile_rows", compile_rows)
    monkeypatch.setattr(sys, "argv", ["restamp_db.py", "--rev", "HEAD", str(path)])
    assert R.main() == 0
    return calls, capsys.readouterr().out


def test_rows_current_in_the_working_tree_are_not_compiled(tmp_path, monkeypatch, capsys):
    path, _ = _export(tmp_path, None)
    before = path.read_text()
    calls, out = _run(monkeypatch, capsys, path, lambda tree, r: {"hash": "", "cubins": {}, "error": "unexpected"})
    assert [rows for _, rows in calls] == [[], []]
    assert "0 of 0 rows not current re-stamped" in out and "2 rows current already" in out
    assert json.loads(path.read_text())["records"] == json.loads(before)["records"]


def test_a_retired_row_is_re_stamped_only_with_identical_kernels(tmp_path, monkeypatch, capsys):
    """A row whose hash the working tree no longer gives is compiled in both trees; it gets the
    working tree's hash when both compiles wrote the same files, and is left as it was otherwise."""
    old = "0123456789abcdef"
    for same, want in ((True, None), (False, old)):
        path, rows = _export(tmp_path, old)
        current = get_backend(rows[1]["backend"]).source_hash(rows[1]["config"])

        def answer(tree, r):
            at_rev = tree != str(R.REPO)
            cubins = {"k.cubin": "a" if (same or at_rev) else "b"}
            return {"hash": old if at_rev else current, "cubins": cubins, "error": ""}

        calls, out = _run(monkeypatch, capsys, path, answer)
        assert [rows for _, rows in calls] == [[old], [old]]
        got = json.loads(path.read_text())["records"]
        assert got[0]["backend_source"] == rows[0]["backend_source"]
        assert got[1]["backend_source"] == (want or current), out
        assert ("1 of 1 rows not current re-stamped" if same else "compiled kernels differ") in out
