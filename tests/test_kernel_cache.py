"""The disk kernel cache with the real CuTeDSL compiler (sm_90a, no GPU needed)."""
import os
import warnings

import pytest
import torch

pytest.importorskip("cutlass")

from autofp4 import kernel_cache  # noqa: E402
from autofp4.kernels import w4a16_decode as D  # noqa: E402

# compiles CuTeDSL kernels on the CPU (minutes on 2 cores): not in the quick subset
pytestmark = pytest.mark.compile

N, K = 256, 1024


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CUTE_DSL_ARCH", os.environ.get("CUTE_DSL_ARCH", "sm_90a"))
    kernel_cache.target_arch.cache_clear()
    monkeypatch.setenv("AUTOFP4_KERNEL_CACHE", str(tmp_path / "kc"))
    yield tmp_path / "kc"
    kernel_cache.target_arch.cache_clear()


def _compile_decode(cfg, counter):
    def build():
        counter.append(cfg)
        return D._compile_now(cfg, N, K, "nvfp4", "bfloat16", False, "")
    return kernel_cache.compile_cached("w4a16_decode", D.__name__, (cfg, N, K, "nvfp4", "bfloat16", False), build)


def _no_compile():
    raise AssertionError("compiled although the kernel is cached")


def test_compile_stores_and_a_second_call_loads(cache):
    calls = []
    cfg = D.DecodeConfig(warps=4, k_split=2, m_max=16)
    fn = _compile_decode(cfg, calls)
    assert callable(fn) and calls == [cfg]
    files = list(cache.glob("w4a16_decode-*.o"))
    assert len(files) == 1 and files[0].stat().st_size > 10_000
    assert not list(cache.glob(".*"))  # no temporary file left behind
    again = kernel_cache.compile_cached("w4a16_decode", D.__name__, (cfg, N, K, "nvfp4", "bfloat16", False), _no_compile)
    assert callable(again)
    # a different config is a different kernel
    other = D.DecodeConfig(warps=8, k_split=2, m_max=16)
    _compile_decode(other, calls)
    assert calls == [cfg, other] and len(list(cache.glob("*.o"))) == 2


def test_key_covers_name_params_source_and_arch(cache, monkeypatch):
    cfg = D.DecodeConfig()
    base = kernel_cache.cache_key("w4a16_decode", D.__name__, (cfg, N, K))
    assert base == kernel_cache.cache_key("w4a16_decode", D.__name__, (cfg, N, K))
    assert base != kernel_cache.cache_key("w4a16_decode", D.__name__, (cfg, N, K + 16))
    assert base != kernel_cache.cache_key("other", D.__name__, (cfg, N, K))
    assert base != kernel_cache.cache_key("w4a16_decode", "autofp4.kernels.sm90_w4a16_gemm", (cfg, N, K))
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_100a")
    kernel_cache.target_arch.cache_clear()
    assert base != kernel_cache.cache_key("w4a16_decode", D.__name__, (cfg, N, K))


def test_damaged_file_is_replaced(cache):
    calls = []
    cfg = D.DecodeConfig(warps=2, k_split=1, m_max=8)
    _compile_decode(cfg, calls)
    (path,) = cache.glob("*.o")
    path.write_bytes(os.urandom(4096))
    with pytest.warns(UserWarning, match="cannot load"):
        fn = _compile_decode(cfg, calls)
    assert callable(fn) and len(calls) == 2
    assert path.stat().st_size > 10_000
    kernel_cache.compile_cached("w4a16_decode", D.__name__, (cfg, N, K, "nvfp4", "bfloat16", False), _no_compile)


def test_off_compiles_every_time(cache, monkeypatch):
    monkeypatch.setenv("AUTOFP4_KERNEL_CACHE", "off")
    assert kernel_cache.cache_dir() is None
    calls = []
    cfg = D.DecodeConfig(warps=4, k_split=1, m_max=8)
    _compile_decode(cfg, calls)
    _compile_decode(cfg, calls)
    assert len(calls) == 2 and not cache.exists()


def test_unwritable_directory_still_returns_the_kernel(cache, tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("AUTOFP4_KERNEL_CACHE", str(blocker / "kc"))
    calls = []
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        fn = _compile_decode(D.DecodeConfig(warps=4, k_split=1, m_max=8), calls)
    assert callable(fn) and len(calls) == 1
    assert any("cannot store" in str(x.message) for x in w)


def test_clear_removes_cached_kernels(cache):
    _compile_decode(D.DecodeConfig(warps=4, k_split=1, m_max=8), [])
    assert kernel_cache.clear() == 1 and not list(cache.glob("*.o"))


@pytest.mark.gpu
def test_kernel_compiled_by_another_process_runs_correctly(tmp_path, monkeypatch, gen):
    """The tuner's compile workers hand kernels to the timing process through the cache."""
    import subprocess
    import sys

    import torch

    import autofp4

    cache_path = tmp_path / "kc"
    monkeypatch.setenv("AUTOFP4_KERNEL_CACHE", str(cache_path))
    kernel_cache.target_arch.cache_clear()
    cfg = D.DecodeConfig(warps=4, k_split=2, m_max=16)
    code = (f"from autofp4.kernels import w4a16_decode as D; "
            f"D.compile_only(D.{cfg!r}, {N}, {K}, 'nvfp4', 'bfloat16')")
    env = {**os.environ, "CUTE_DSL_ARCH": kernel_cache.target_arch()}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=300)
    assert len(list(cache_path.glob("*.o"))) == 2  # with and without bias
    fn = kernel_cache.compile_cached("w4a16_decode", D.__name__, (cfg, N, K, "nvfp4", "bfloat16", False), _no_compile)
    w = autofp4.quantize(torch.randn(N, K, generator=gen).cuda(), "nvfp4")
    p = D.pack_weight(w)
    x = torch.randn(7, K, generator=gen).cuda().to(torch.bfloat16)
    out = torch.empty(7, N, dtype=torch.bfloat16, device="cuda")
    ws = torch.empty(2, 7, N, dtype=torch.float32, device="cuda")
    cnt = torch.zeros(N // 16, dtype=torch.int32, device="cuda")
    dummy = torch.zeros(1, dtype=torch.bfloat16, device="cuda")
    fn(x, p.data, p.scales, p.alpha, out, dummy, ws, cnt, p.scale_add[0], 0)
    ref = x.double() @ w.dequantize(torch.float64).T
    torch.cuda.synchronize()
    # split_reduce="kernel": the main kernel writes partials and the reduce kernel the output
    err = (out.double() - ref).norm() / ref.norm()
    assert err < 1e-2, err


def test_cli_reports_and_clears_the_cache(cache, capsys):
    from autofp4.cli import main

    _compile_decode(D.DecodeConfig(warps=4, k_split=2, m_max=8), [])
    assert main(["cache"]) == 0
    text = capsys.readouterr().out
    assert str(cache) in text and "1 compiled kernel," in text
    assert main(["info", "--device", "cpu"]) == 0
    assert "kernel cache:  " + str(cache) in capsys.readouterr().out
    assert main(["cache", "--clear"]) == 0
    text = capsys.readouterr().out
    assert "removed 1 compiled kernels" in text and "0 compiled kernels" in text
    assert not list(cache.glob("*.o"))


def test_code_only_drops_prose_and_keeps_code():
    """The source hashes (tuning rows, kernel cache) cover code, not comments or docstrings."""
    src = (
        '"""Module doc."""\n'
        "import os  # why\n"
        "\n"
        'X = "# not a comment"\n'
        "\n"
        "\n"
        "class C:\n"
        '    """Class doc."""\n'
        "    y = 1\n"
        "\n"
        "\n"
        "def f(a):\n"
        '    """Doc\n'
        '    on two lines."""\n'
        "    # a comment line\n"
        "    return a + 1  # trailing\n"
    )
    code = kernel_cache.code_only(src)
    assert code.splitlines() == ["import os", 'X = "# not a comment"', "class C:", "    y = 1",
                                 "def f(a):", "    return a + 1"]
    reworded = (src.replace("Module doc.", "Other words.").replace("# why", "# because, at length")
                .replace("on two lines.", "on three\n    lines.").replace("# a comment line", "# another"))
    assert kernel_cache.code_only(reworded) == code
    assert kernel_cache.code_only(src.replace("a + 1", "a + 2")) != code
    assert kernel_cache.code_only(src.replace('"# not a comment"', '"# changed"')) != code
    # on a real kernel module: a docstring edit keeps its hash, a constant does not
    text = open(D.__file__).read()
    assert kernel_cache.code_only(text) == kernel_cache.code_only(text.replace("How it works", "How it runs"))
    assert kernel_cache.code_only(text) != kernel_cache.code_only(text.replace("GROUP_K = CHUNK_K * CHUNKS",
                                                                                "GROUP_K = CHUNK_K * 4"))


TINY_LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 256,
              "intermediate_size": 512, "num_hidden_layers": 1, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 1000}


def _cli(*argv):
    import io

    from autofp4.cli import main

    out, err = io.StringIO(), io.StringIO()
    return main([str(a) for a in argv], out=out, err=err), out.getvalue(), err.getvalue()


def test_cli_warm_compiles_a_models_defaults_then_loads_them(cache, tmp_path, monkeypatch):
    """``autofp4 cache --warm``: the default kernels of a model's shapes land in the cache (no
    GPU: --arch), and the backend's compile of the same default then loads, not compiles."""
    import json

    from autofp4 import kernel_cache as kc
    from autofp4.backends import get_backend
    from autofp4.problem import ProblemKey

    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(TINY_LLAMA))
    rc, out, err = _cli("cache", "--warm", path, "--m", "1,64", "--arch", "sm_90a", "--workers", "1",
                        "--no-progress")
    assert rc == 0, err
    # qkv, o, gate_up, down x (the decode default at M = 1, with and without bias; the GEMM's at 64)
    assert "compiled 8 kernel configs for sm_90a" in out
    files = sorted(cache.glob("*.o"))
    assert len([f for f in files if f.name.startswith("w4a16_decode-")]) == 8
    assert len([f for f in files if f.name.startswith("sm90_w4a16_gemm-")]) == 4
    compiled = []
    real = kc.compile_cached
    monkeypatch.setattr(kc, "compile_cached",
                        lambda name, mod, params, fn: real(name, mod, params, lambda: compiled.append(name) or fn()))
    b = get_backend("sm90_w4a16")
    key = ProblemKey("linear", "nvfp4", "bfloat16", 1024, 256)  # gate_up
    b.compile(b.default(key, 64), key)
    b.compile(b.default(key, 1), key)
    assert compiled == []  # both loaded from the warmed cache
    assert sorted(cache.glob("*.o")) == files


def test_cli_warm_with_a_db_adds_its_winners(cache, tmp_path, monkeypatch):
    """``--db``: the winners a tuning DB stores for the model's jobs are compiled too (what the
    dispatcher will run), also rows measured with another kernel source (what a re-tune tries
    right after the default)."""
    import json

    from autofp4 import kernel_cache as kc
    from autofp4.backends import get_backend
    from autofp4.problem import ProblemKey
    from autofp4.db import TuningDB
    from autofp4.env import current_environment
    from autofp4.schema import TuningRecord

    b = get_backend("sm90_w4a16")
    key = ProblemKey("linear", "nvfp4", "bfloat16", 256, 256)  # the model's o projection
    common = {"kernel": "decode", "k_split": 1, "m_max": 8, "prefetch": False, "split_reduce": "kernel",
              "tiles_per_warp": 1}
    won, stale, other = {**common, "warps": 2}, {**common, "warps": 8}, {**common, "warps": 16}
    assert b.is_valid(b.parse_config(won), key) is None and b.parse_config(won) != b.default(key, 1)

    def row(config, source):
        return TuningRecord.model_validate(dict(
            op="linear", fmt="nvfp4", dtype="bfloat16", backend=b.name, m_bucket=1, n=256, k=256,
            config=config, median_us=5.0, spread_us=0.1, samples=10, backend_source=source,
            env=current_environment(torch.device("cpu"))))

    db_path = tmp_path / "tuned.db"
    with TuningDB(db_path) as db:
        db.upsert_result(row(won, b.source_hash(won)))
        db.upsert_result(row(stale, "fedcba9876543210").model_copy(update={"m_bucket": 16}))
        db.upsert_result(row(other, b.source_hash(other)).model_copy(update={"n": 768}))  # not the model's
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(TINY_LLAMA))
    rc, out, err = _cli("cache", "--warm", path, "--m", "1,16", "--db", db_path, "--arch", "sm_90a",
                        "--workers", "1", "--no-progress")
    assert rc == 0, err
    # 4 shapes x 2 defaults, the two winners and each one's two dependent-launch variants (with
    # the early and the late trigger; the late one shares the winner's binary)
    assert "compiled 14 kernel configs" in out
    compiled = []
    real = kc.compile_cached
    monkeypatch.setattr(kc, "compile_cached",
                        lambda name, mod, params, fn: real(name, mod, params, lambda: compiled.append(name) or fn()))
    for cfg in (won, stale):
        b.compile(b.parse_config(cfg), key)
        b.compile(b.parse_config({**cfg, "pdl": True, "pdl_early": True}), key)
    assert compiled == []
    b.compile(b.parse_config(other), key)
    assert compiled == ["w4a16_decode"]  # a row of a shape the model does not have was not warmed
    assert _cli("cache", "--warm", path, "--db", tmp_path / "none.db", "--arch", "sm_90a")[0] == 2
    assert _cli("cache", "--warm", path, "--db", tmp_path / "none.json", "--arch", "sm_90a")[0] == 2
    (tmp_path / "bad.json").write_text("[1, 2]")
    assert _cli("cache", "--warm", path, "--db", tmp_path / "bad.json", "--arch", "sm_90a")[0] == 2


def test_cli_warm_bad_input(cache, tmp_path, monkeypatch):
    import json

    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(TINY_LLAMA))
    assert _cli("cache", "--warm", tmp_path / "missing.json", "--arch", "sm_90a")[0] == 2
    assert _cli("cache", "--warm", path, "--arch", "sm90")[0] == 2
    assert _cli("cache", "--warm", path, "--arch", "sm_90a", "--backend", "nope")[0] == 2
    if not torch.cuda.is_available():  # no target named and none to detect
        monkeypatch.delenv("CUTE_DSL_ARCH")
        kernel_cache.target_arch.cache_clear()
        rc, _, err = _cli("cache", "--warm", path)
        assert rc == 2 and "--arch" in err
    import time

    t = time.time()
    rc, _, err = _cli("cache", "--warm", path, "--arch", "sm_1")  # well formed, no kernel targets it
    assert rc == 2 and "sm_90a, sm_100a" in err and "Traceback" not in err and time.time() - t < 5
    a_file = tmp_path / "not-a-dir"
    a_file.write_text("x")
    monkeypatch.setenv("AUTOFP4_KERNEL_CACHE", str(a_file))
    rc, out, err = _cli("cache", "--warm", path, "--arch", "sm_90a")
    assert rc == 2 and "is not a directory" in err and "compiled" not in out
    monkeypatch.setenv("AUTOFP4_KERNEL_CACHE", "off")
    assert _cli("cache", "--warm", path, "--arch", "sm_90a")[0] == 2


def test_dependent_launch_is_a_launch_argument_not_a_second_binary(cache):
    """Configs that differ only in ``pdl`` share one compiled kernel."""
    from dataclasses import replace

    from autofp4.kernels import sm90_w4a16_gemm as G

    cfg = D.DecodeConfig(warps=4, k_split=2, m_max=16)
    D.compile_only(cfg, N, K, "nvfp4", "bfloat16")
    gcfg = G.Sm90GemmConfig(tile_n=128, tile_m=64, tile_k=128, stages=4)
    G.compile_only(gcfg, N, K, "nvfp4", "bfloat16")
    files = sorted(cache.glob("*.o"))
    assert len(files) == 3
    D.compile_only(replace(cfg, pdl=True), N, K, "nvfp4", "bfloat16")
    G.compile_only(replace(gcfg, pdl=True), N, K, "nvfp4", "bfloat16")
    assert sorted(cache.glob("*.o")) == files


def test_cli_warm_ops_moe_compiles_only_the_expert_kernels(cache, tmp_path):
    """``--ops moe``: a MoE model's expert kernels are compiled, its attention linears are not."""
    import json

    path = tmp_path / "tiny-moe.json"
    path.write_text(json.dumps({**TINY_LLAMA, "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
                                "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 256,
                                "head_dim": 64}))
    rc, out, err = _cli("cache", "--warm", path, "--ops", "moe", "--m", "1", "--arch", "sm_90a", "--workers", "1",
                        "--no-progress")
    assert rc == 0, err
    names = {f.name.split("-")[0] for f in cache.glob("*.o")}
    assert names and all("moe" in n for n in names), names
    assert _cli("cache", "--warm", path, "--ops", "attention", "--arch", "sm_90a")[0] == 2


@pytest.mark.parametrize("compiler_first", [False, True], ids=["cli", "compiler-imported-first"])
def test_cli_warm_builds_for_the_named_arch_without_a_gpu(tmp_path, compiler_first):
    """``--arch sm_90a --workers 1`` on a machine with no GPU and no ``$CUTE_DSL_ARCH``: the
    decode kernel (which takes its target from CuTeDSL's, read when CuTeDSL is imported; no GPU
    makes that sm_100a) is built for sm_90a, also in a process that imported CuTeDSL before."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(TINY_LLAMA))
    cache = tmp_path / "kernels"
    script = tmp_path / "warm.py"
    script.write_text(("import cutlass.cute\n" if compiler_first else "") +
                      "import sys\nfrom autofp4.cli import main\n"
                      "if __name__ == '__main__':\n    sys.exit(main(sys.argv[1:]))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("CUTE_DSL_ARCH", "CUDA_VISIBLE_DEVICES")}
    env.update(AUTOFP4_KERNEL_CACHE=str(cache), CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, str(script), "cache", "--warm", str(path), "--m", "1", "--arch", "sm_90a",
                        "--workers", "1", "--no-progress"], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    files = sorted(cache.glob("w4a16_decode-*.o"))
    assert len(files) == 8
    for f in files:
        assert b"sm_100" not in f.read_bytes(), f"{f.name} was built for another GPU"


# -- archives: a warmed cache that travels ---------------------------------------------------
def _tar(path, files: dict) -> None:
    """A gzipped tar of ``files`` {name: bytes}, written here without the exporter."""
    import io
    import tarfile

    with tarfile.open(path, "w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def _read_archive(path) -> tuple[dict, dict]:
    import json
    import tarfile

    with tarfile.open(path, "r:gz") as tar:
        files = {m.name: tar.extractfile(m).read() for m in tar}
    return json.loads(files.pop("manifest.json")), files


def _other_cache(monkeypatch, path):
    monkeypatch.setenv("AUTOFP4_KERNEL_CACHE", str(path))
    return path


def test_an_exported_cache_imported_elsewhere_loads_without_compiling(cache, tmp_path, monkeypatch, capsys):
    from autofp4.cli import main

    cfgs = [D.DecodeConfig(warps=4, k_split=2, m_max=8), D.DecodeConfig(warps=2, k_split=1, m_max=16)]
    for cfg in cfgs:
        _compile_decode(cfg, [])
    # a kernel compiled by an earlier autofp4 has no record: left out, and said so
    (cache / f"w4a16_decode-{'0' * 32}.o").write_bytes(os.urandom(2048))
    archive = tmp_path / "share" / "kernels.tar.gz"
    assert main(["cache", "--export", str(archive)]) == 0
    outs = capsys.readouterr()
    assert "exported 2 kernels" in outs.out and "1 left out" in outs.out and "no record" in outs.err
    manifest, files = _read_archive(archive)
    assert manifest["format"] == "autofp4-kernel-cache" and len(manifest["kernels"]) == 2
    assert {e["file"] for e in manifest["kernels"]} == set(files)
    assert all(files[e["file"]] == (cache / e["file"]).read_bytes() for e in manifest["kernels"])

    other = _other_cache(monkeypatch, tmp_path / "elsewhere")
    assert main(["cache", "--import", str(archive)]) == 0
    assert "imported 2 kernels" in capsys.readouterr().out
    assert sorted(p.name for p in other.glob("*.o")) == sorted(files)
    for cfg in cfgs:  # loaded from the imported files, not compiled
        kernel_cache.compile_cached("w4a16_decode", D.__name__, (cfg, N, K, "nvfp4", "bfloat16", False), _no_compile)
    assert main(["cache", "--import", str(archive)]) == 0
    assert "imported 0 kernels (0.0 MiB) from" in capsys.readouterr().out
    report = kernel_cache.import_archive(archive)
    assert (report.kernels, report.present, report.skipped) == (0, 2, [])


def test_an_import_into_a_cache_that_cannot_be_written_names_the_cache(cache, tmp_path, monkeypatch):
    """A cache folder nothing can be made in (/proc/self): the error names the cache and its
    variable, not the (valid) archive."""
    _compile_decode(D.DecodeConfig(warps=4, k_split=2, m_max=8), [])
    kernel_cache.export_archive(tmp_path / "a.tgz")
    monkeypatch.setenv("AUTOFP4_KERNEL_CACHE", "/proc/self")
    with pytest.raises(kernel_cache.KernelArchiveError) as info:
        kernel_cache.import_archive(tmp_path / "a.tgz")
    assert "cannot write to the kernel cache /proc/self ($AUTOFP4_KERNEL_CACHE)" in str(info.value)
    assert "not a readable autofp4 kernel archive" not in str(info.value)


def test_an_import_leaves_out_kernels_this_machine_would_build_otherwise(cache, tmp_path, monkeypatch):
    import json

    _compile_decode(D.DecodeConfig(warps=4, k_split=2, m_max=8), [])
    kernel_cache.export_archive(tmp_path / "a.tgz")
    manifest, files = _read_archive(tmp_path / "a.tgz")
    (entry,) = manifest["kernels"]
    data = files[entry["file"]]
    entries, out = [], {}
    # what another machine's archive holds: records consistent with their file names
    for change in ({}, {"cutlass_dsl": "0.0.1"}, {"source": "f" * 64}, {"module": "os.path", "params": "(1,)"},
                   {"module": "autofp4.kernels.not_here", "params": "(2,)"}, {"arch": "gfx942"}, {"arch": "sm_100a"}):
        e = {**entry, **change}
        e["file"] = f"{e['name']}-{kernel_cache._digest(e)}.o"
        entries.append(e)
        out[e["file"]] = data
    _tar(tmp_path / "b.tgz", {"manifest.json": json.dumps({**manifest, "kernels": entries}).encode(), **out})
    report = kernel_cache.import_archive(tmp_path / "b.tgz")
    # the same kernel, already cached; and sm_100a's (a kernel for another GPU of this autofp4)
    assert (report.present, report.kernels) == (1, 1)
    whys = [w for _, w in report.skipped]
    assert len(whys) == 5
    assert "CuTeDSL 0.0.1" in whys[0] and "another version of autofp4.kernels.w4a16_decode" in whys[1]
    assert "'os.path' is not an autofp4 kernel module" in whys[2] and "not available here" in whys[3]
    assert "unknown architecture 'gfx942'" in whys[4]
    assert len(list(cache.glob("*.o"))) == 2 and len(list(cache.glob("*.json"))) == 2


def test_a_hostile_archive_is_refused_naming_it_and_writes_nothing(cache, tmp_path, monkeypatch, capsys):
    import gzip
    import json

    from autofp4.cli import main

    _compile_decode(D.DecodeConfig(warps=4, k_split=2, m_max=8), [])
    good = tmp_path / "good.tgz"
    kernel_cache.export_archive(good)
    manifest, files = _read_archive(good)
    (entry,) = manifest["kernels"]
    name, data = entry["file"], files[entry["file"]]

    def with_manifest(m, extra=None):
        return {"manifest.json": json.dumps(m).encode(), name: data, **(extra or {})}

    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0xFF
    cases = {
        "not-gzip": os.urandom(4096),
        "gzip-not-tar": gzip.compress(os.urandom(4096)),
        "no-manifest": {name: data},
        "manifest-not-json": {"manifest.json": b"{'kernels': [", name: data},
        "other-format": with_manifest({**manifest, "format": "something-else"}),
        "newer-version": with_manifest({**manifest, "version": 2}),
        "kernels-not-a-list": with_manifest({**manifest, "kernels": {"a": 1}}),
        "entry-not-object": with_manifest({**manifest, "kernels": ["x"]}),
        "path-in-name": with_manifest({**manifest, "kernels": [{**entry, "file": "../" + name}]}),
        "name-not-its-record": with_manifest({**manifest, "kernels": [{**entry, "params": "(1, 2)"}]}),
        "negative-size": with_manifest({**manifest, "kernels": [{**entry, "size": -1}]}),
        "listed-twice": with_manifest({**manifest, "kernels": [entry, entry]}),
        "file-not-listed": with_manifest(manifest, {"w4a16_decode-" + "1" * 32 + ".o": data}),
        "damaged-kernel": {"manifest.json": json.dumps(manifest).encode(), name: bytes(flipped)},
        "missing-kernel": {"manifest.json": json.dumps(manifest).encode()},
    }
    other = _other_cache(monkeypatch, tmp_path / "elsewhere")
    for case, content in cases.items():
        path = tmp_path / f"{case}.tgz"
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            _tar(path, content)
        with pytest.raises(kernel_cache.KernelArchiveError) as ei:
            kernel_cache.import_archive(path)
        assert str(path) in str(ei.value), (case, str(ei.value))
        assert not any(other.glob("*.o")), case  # nothing written before the refusal
        assert main(["cache", "--import", str(path)]) == 2, case
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and str(path) in err[0], (case, err)
    # a symlink member, and a directory named like the archive
    import tarfile

    link = tmp_path / "link.tgz"
    with tarfile.open(link, "w:gz") as tar:
        info = tarfile.TarInfo("manifest.json")
        info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(info)
    for path in (link, tmp_path, tmp_path / "absent.tgz"):
        with pytest.raises(kernel_cache.KernelArchiveError, match=str(path).replace(".", r"\.")):
            kernel_cache.import_archive(path)
    # exports that make no sense
    with pytest.raises(kernel_cache.KernelArchiveError, match="is a directory"):
        kernel_cache.export_archive(tmp_path)
    _other_cache(monkeypatch, tmp_path / "empty")
    with pytest.raises(kernel_cache.KernelArchiveError, match="holds no kernels"):
        kernel_cache.export_archive(tmp_path / "x.tgz")


def test_an_export_replaces_only_an_earlier_archive(cache, tmp_path, monkeypatch):
    """``cache --export`` writes a new file or replaces an earlier kernel archive; a device or
    FIFO, any other file (a tuning DB) and '-' are refused and left as they were. A FIFO named
    like a kernel in the cache is not read (it would block)."""
    import sqlite3

    from autofp4.cli import main

    _compile_decode(D.DecodeConfig(warps=4, k_split=2, m_max=8), [])
    first = tmp_path / "a.tgz"
    kernel_cache.export_archive(first)
    assert kernel_cache.export_archive(first).kernels == 1  # an earlier archive: replaced
    db = tmp_path / "u.db"
    with sqlite3.connect(db) as c:
        c.execute("create table t (v)")
        c.execute("insert into t values (42)")
    before = db.read_bytes()
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    for dest, said in ((db, "is not a kernel archive"), (notes, "is not a kernel archive"),
                       (fifo, "is not a regular file"), ("-", "not standard output")):
        with pytest.raises(kernel_cache.KernelArchiveError, match=said):
            kernel_cache.export_archive(dest)
        assert main(["cache", "--export", str(dest)]) == 2
    assert db.read_bytes() == before and notes.read_text() == "mine" and fifo.is_fifo()
    assert not (tmp_path / "-").exists() and not os.path.exists("-")
    os.mkfifo(cache / f"w4a16_decode-{'1' * 32}.o")  # named like a kernel: skipped, not read
    assert kernel_cache.export_archive(tmp_path / "b.tgz").kernels == 1


def test_info_says_a_kernel_cache_that_is_a_file_is_unusable(tmp_path, monkeypatch, capsys):
    from autofp4.cli import main

    f = tmp_path / "kc"
    f.write_text("x")
    monkeypatch.setenv("AUTOFP4_KERNEL_CACHE", str(f))
    monkeypatch.setenv("AUTOFP4_DB", str(tmp_path / "t.db"))
    assert main(["info", "--device", "cpu"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("kernel cache"))
    assert "unusable" in line and "is not a directory" in line and "0 compiled kernels" not in line
