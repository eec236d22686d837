"""The sm90_w4a16 backend on the CPU: its config model, rules and that what it would run compiles.

Compiles for sm_90a without a GPU (CUTE_DSL_ARCH), as CI does for every change.
"""
import json
import os
import random

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

pytest.importorskip("cutlass")

import dataclasses  # noqa: E402

from autofp4.backends import get_backend
from autofp4.problem import ProblemKey  # noqa: E402
from autofp4.backends.sm90_heuristics import DECODE_MAX_M  # noqa: E402
from autofp4.kernels.sm90_w4a16_gemm import Sm90GemmConfig  # noqa: E402
from autofp4.kernels.w4a16_decode import DecodeConfig  # noqa: E402

# compiles CuTeDSL kernels on the CPU (minutes on 2 cores): not in the quick subset
pytestmark = pytest.mark.compile

LLAMA_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


@pytest.fixture(scope="module")
def backend():
    return get_backend("sm90_w4a16")


def test_stored_configs_parse_to_the_kernels_dataclasses(backend):
    """A stored config is ``kernel`` plus the fields of that kernel's frozen dataclass: fields of
    the other kernel, values of the wrong type and unknown kernels are refused, naming them;
    a field left out takes the dataclass's default; out-of-range values parse and are refused
    by the kernel's validity rules before anything compiles."""
    ok = backend.parse_config({"kernel": "gemm", "tile_n": 128, "tile_m": 64, "tile_k": 128, "stages": 4,
                               "split_k": 1, "cluster_n": 1, "raster": "n"})
    assert ok == Sm90GemmConfig(128, 64, 128, 4) and ok.kernel == "gemm" and "warps" not in backend.config_dict(ok)
    with pytest.raises(ValueError, match="takes no tile_n"):
        backend.parse_config({"kernel": "decode", "warps": 4, "k_split": 1, "m_max": 16, "prefetch": False,
                              "split_reduce": "kernel", "tiles_per_warp": 1, "tile_n": 64})
    assert backend.parse_config({"kernel": "decode", "warps": 8}) == DecodeConfig(warps=8)
    with pytest.raises(ValueError, match="warps must be int"):
        backend.parse_config({"kernel": "decode", "warps": True})
    with pytest.raises(ValueError, match="raster must be str"):
        backend.parse_config({"kernel": "gemm", "raster": 1})
    huge = backend.parse_config({"kernel": "gemm", "tile_n": 10**9, "tile_m": 64, "tile_k": 128, "stages": 4,
                                 "split_k": 1, "cluster_n": 1, "raster": "n"})
    assert "tile_n" in backend.is_valid(huge, ProblemKey("linear", "nvfp4", "bfloat16", 4096, 4096))
    with pytest.raises(ValueError, match="'kernel' in"):
        backend.parse_config({"kernel": "evil"})
    with pytest.raises(ValueError, match="'kernel' in"):
        backend.parse_config({"tile_n": 128})
    for cfg in (ok, DecodeConfig(warps=8, x_smem=True)):
        assert backend.parse_config(backend.config_dict(cfg)) == cfg
        assert backend.config_dict(cfg) == {"kernel": cfg.kernel, **dataclasses.asdict(cfg)}


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_default_picks_decode_for_small_m_and_gemm_above(backend, fmt):
    for n, k in LLAMA_8B:
        key = ProblemKey("linear", fmt, "bfloat16", n, k)
        for m in (1, 8, 16, DECODE_MAX_M):
            cfg = backend.default(key, m)
            assert cfg.kernel == "decode" and cfg.m_max >= m
            assert backend.is_valid(cfg, key) is None
        for m in (DECODE_MAX_M + 1, 128, 8192, None):
            cfg = backend.default(key, m)
            assert cfg.kernel == "gemm" and backend.is_valid(cfg, key) is None


def test_candidates_respect_m_and_validity(backend):
    key = ProblemKey("linear", "nvfp4", "bfloat16", 4096, 4096)
    cands = backend.candidates(key, 16)
    assert cands[0] == backend.default(key, 16)
    assert len(set(cands)) == len(cands)
    assert all(backend.is_valid(c, key) is None for c in cands)
    assert all(c.m_max >= 16 for c in cands if c.kernel == "decode")
    assert {c.kernel for c in cands} == {"decode", "gemm"}


def test_the_backend_offers_cluster_configs_where_the_kernel_takes_them(backend):
    """x multicast over a cluster of two is a tuning dimension: candidates at M >= 64 include it,
    an explicit one is valid, and an odd number of N tiles per cluster is refused."""
    from autofp4.kernels import sm90_w4a16_gemm as g

    key = ProblemKey("linear", "nvfp4", "bfloat16", 8192, 8192)
    cl2 = Sm90GemmConfig(tile_n=128, tile_m=64, tile_k=128, stages=4, split_k=2, cluster_n=2, raster="n")
    assert backend.is_valid(cl2, key) is None
    kcfg = g.Sm90GemmConfig(tile_n=128, tile_m=64, tile_k=128, stages=4, split_k=2, cluster_n=2)
    assert g.validate(kcfg, key.n, key.k, key.fmt, key.dtype) is None
    assert any((c.cluster_n or 1) == 2 for c in backend.candidates(key, 512) if c.kernel == "gemm")
    odd = ProblemKey("linear", "nvfp4", "bfloat16", 256 * 3, 8192)  # three 256-row weight tiles
    assert "must divide the number of weight tiles" in backend.is_valid(dataclasses.replace(cl2, tile_n=256), odd)


def test_invalid_configs_are_rejected_before_compiling(backend):
    key = ProblemKey("linear", "nvfp4", "bfloat16", 4096, 4096)
    bad = Sm90GemmConfig(tile_n=96, tile_m=64, tile_k=128, stages=4, split_k=1, cluster_n=1, raster="n")
    assert "tile_n" in backend.is_valid(bad, key)
    with pytest.raises(ValueError, match="tile_n"):
        backend.compile(bad, key)
    moe = ProblemKey("moe", "nvfp4", "bfloat16", 512, 256, 8, 2)
    assert "cannot run a moe problem" in backend.is_valid(backend.default(ProblemKey("linear", "nvfp4", "bfloat16", 512, 256)), moe)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_default_configs_of_llama_shapes_compile_for_sm90a(backend, fmt):
    """What the dispatcher runs untuned for Llama-3.1-8B (every M class) compiles for sm_90a."""
    seen = set()
    for n, k in LLAMA_8B:
        key = ProblemKey("linear", fmt, "bfloat16", n, k)
        for m in (1, 16, 2048):
            cfg = backend.default(key, m)
            if (cfg, n, k) not in seen:
                seen.add((cfg, n, k))
                backend.compile_only(cfg, key)


@pytest.mark.slow
def test_a_random_sample_of_the_space_compiles_for_sm90a(backend):
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    key = ProblemKey("linear", rng.choice(["nvfp4", "mxfp4"]), rng.choice(["bfloat16", "float16"]), 6144, 4096)
    cands = backend.candidates(key)
    for cfg in rng.sample(cands, 4):
        print(cfg)
        backend.compile_only(cfg, key)


def test_configs_stored_before_later_fields_existed_still_parse():
    """Decode and GEMM configs stored before x_smem, ctas_per_sm, smem_stages, pdl_early,
    swizzle, scale_select or producer existed parse as those fields' defaults (off), which is
    what they ran with; a stored config names every field of its kernel."""
    b = get_backend("sm90_w4a16")
    old = {"kernel": "decode", "warps": 4, "k_split": 8, "m_max": 16, "prefetch": False,
           "split_reduce": "kernel", "tiles_per_warp": 1}
    assert b.parse_config(old) == DecodeConfig(4, 8, 16)
    assert b.parse_config({**old, "x_smem": True, "ctas_per_sm": 6}) == DecodeConfig(4, 8, 16, x_smem=True, ctas_per_sm=6)
    assert b.parse_config({**old, "x_smem": True, "smem_stages": 3}) == DecodeConfig(4, 8, 16, x_smem=True, smem_stages=3)
    full = b.config_dict(DecodeConfig(4, 8, 16))
    assert {k: v for k, v in full.items() if k in old} == old
    assert {k: full[k] for k in full if k not in old} == {"x_smem": False, "ctas_per_sm": 0, "smem_stages": 0,
                                                         "pdl": False, "pdl_early": False}
    gold = {"kernel": "gemm", "tile_n": 128, "tile_m": 64, "tile_k": 128, "stages": 4, "split_k": 1,
            "cluster_n": 1, "raster": "n"}
    g = b.parse_config(gold)
    assert g == Sm90GemmConfig(128, 64, 128, 4)
    assert (g.swizzle, g.scale_select, g.producer, g.ctas_per_sm, g.pdl) == (1, False, False, 0, False)
    for extra in ({"ctas_per_sm": 2}, {"swizzle": 8}, {"scale_select": True}, {"producer": True}):
        assert b.parse_config({**gold, **extra}) == Sm90GemmConfig(128, 64, 128, 4, **extra)
    for stray, kernel in (("scale_select", "decode"), ("swizzle", "decode"), ("x_smem", "gemm")):
        base = old if kernel == "decode" else gold
        with pytest.raises(ValueError, match=f"takes no {stray}"):
            b.parse_config({**base, stray: True})


def test_seeds_follow_the_default_and_are_valid():
    """The tuner's first trials after the default: valid configs for the bucket, the measured
    winners among them (two CTAs per SM at M = 64 and 128, 16-token GEMM tiles at M = 16)."""
    b = get_backend("sm90_w4a16")
    for n, k in [(6144, 4096), (4096, 14336), (57344, 8192)]:
        for fmt in ("nvfp4", "mxfp4"):
            key = ProblemKey("linear", fmt, "bfloat16", n, k)
            for m in (1, 16, 64, 128, 512, 8192):
                seeds = b.seeds(key, m)
                assert seeds and len(set(seeds)) == len(seeds)
                default = b.default(key, m)
                assert default not in seeds
                for cfg in seeds:
                    assert b.is_valid(cfg, key) is None, (m, cfg)
                    assert cfg.kernel == "gemm" or cfg.m_max >= m
                cands = b.candidates(key, m)
                assert cands[0] == default and cands[1:1 + len(seeds)] == seeds
                if m in (64, 128):
                    # after the default with PDL, scale_select and the producer warp flipped
                    assert any(c.kernel == "gemm" and c.ctas_per_sm == 2 for c in seeds[:4])
                    if default.producer:
                        assert not seeds[2].producer and seeds[2].tile_m == default.tile_m
                if m == 16:
                    # after the decode default with the late trigger and without PDL
                    assert [(c.pdl, c.pdl_early) for c in seeds[:2]] == [(True, False), (False, False)]
                    assert default.pdl and default.pdl_early
                    assert any(c.kernel == "gemm" and c.tile_m == 16 for c in seeds[2:4])


def test_a_stale_gemm_winner_is_retried_with_scale_select_flipped(backend):
    """A re-tune tries each stored GEMM winner as it is, then with ``scale_select``, with
    ``producer`` and with x multicast over a cluster of two the other way (winners stored before
    the settings existed have them off), where valid; a decode winner is retried with
    dependent launch on, with the early and the late trigger."""
    from autofp4.tuning.candidates import _first_candidates

    key = ProblemKey("linear", "nvfp4", "bfloat16", 6144, 4096)
    old = Sm90GemmConfig(tile_n=128, tile_m=64, tile_k=256, stages=4, split_k=2, cluster_n=1,
                         raster="n", pdl=True)
    flipped, prod, cl2 = backend.variants(old, key, 64)
    assert flipped.scale_select is True and prod.producer is True
    assert dataclasses.replace(cl2, cluster_n=1) == old and cl2.cluster_n == 2
    assert backend.is_valid(cl2, key) is None
    assert backend.variants(cl2, key, 64)[2] == old
    banded = dataclasses.replace(old, raster="m", swizzle=4)
    assert backend.variants(banded, key, 64)[2] == cl2  # a cluster's CTAs share one token tile
    assert dataclasses.replace(flipped, scale_select=False) == old
    assert dataclasses.replace(prod, producer=False) == old
    back = backend.variants(flipped, key, 64)[0]
    assert back == old and back.scale_select is False
    # two warpgroups at two CTAs per SM leave no registers for a producer warp: the tuner does
    # not try that variant, only the scale_select one
    two = Sm90GemmConfig(tile_n=128, tile_m=64, tile_k=128, stages=4, split_k=1, cluster_n=1,
                     raster="n", ctas_per_sm=2)
    tried = [c.config for c in _first_candidates(key, 64, [backend], [(backend, two)])][1:3]
    assert tried[0] == two and [c.scale_select for c in tried[1:]] == [True]
    assert not any(c.producer and c.ctas_per_sm == 2 for c in
                   (c.config for c in _first_candidates(key, 64, [backend], [(backend, two)])))
    dec = backend.default(key, 1)
    assert dec.kernel == "decode" and dec.pdl and dec.pdl_early
    late = dataclasses.replace(dec, pdl_early=False)
    assert backend.variants(dec, key, 1) == [late]
    off = dataclasses.replace(dec, pdl=False, pdl_early=False)  # stored before PDL: off
    assert backend.variants(off, key, 1) == [dec, late]
    assert all(backend.is_valid(c, key) is None for c in backend.variants(off, key, 1))
    firsts = [c.config for c in _first_candidates(key, 64, [backend], [(backend, old)])]
    assert firsts[:4] == [backend.default(key, 64), old, flipped, prod]


def test_each_kernel_has_its_own_source_hash(backend, monkeypatch):
    """A row's provenance covers the kernel its config runs (its module and helpers): a change
    to the decode kernel retires the decode rows and keeps the GEMM rows (and the other way
    round)."""
    from autofp4 import dispatch, kernel_cache
    from autofp4.env import current_environment
    from autofp4.schema import TuningRecord

    key = ProblemKey("linear", "nvfp4", "bfloat16", 4096, 4096)
    dec, gemm = backend.default(key, 1), backend.default(key, 512)
    assert (dec.kernel, gemm.kernel) == ("decode", "gemm")
    h_dec, h_gemm = backend.source_hash(dec), backend.source_hash(gemm)
    assert len({h_dec, h_gemm, backend.source_hash()}) == 3
    moe_key = ProblemKey("moe", "nvfp4", "bfloat16", 1024, 512, 8, 2)
    moe, moe_gemm = backend.default(moe_key, 1), backend.default(moe_key, 4096)
    assert (moe.kernel, moe_gemm.kernel) == ("moe_decode", "moe_gemm")
    assert dispatch.backend_source_hashes(backend) == {h_dec, h_gemm, backend.source_hash(moe),
                                                       backend.source_hash(moe_gemm)}
    assert backend.source_hash(backend.config_dict(dec)) == h_dec  # a stored config dict

    def row(cfg, source):
        return TuningRecord(op="linear", fmt="nvfp4", dtype="bfloat16", backend=backend.name, m_bucket=1,
                            n=4096, k=4096, config=backend.config_dict(cfg), median_us=5.0,
                            spread_us=0.1, samples=10, backend_source=source, env=current_environment("cpu"))

    rows = [row(dec, h_dec), row(gemm, h_gemm)]
    real = kernel_cache.kernel_source
    for changed, stale in (("autofp4.kernels.w4a16_decode", [True, False]),
                           ("autofp4.kernels.sm90_w4a16_gemm", [False, True])):
        monkeypatch.setattr(kernel_cache, "kernel_source",
                            lambda name, changed=changed: real(name) + ("\nx = 1" if name == changed else ""))
        monkeypatch.setattr(dispatch, "_SOURCE_HASHES", {})
        assert [dispatch.is_stale(r, backend) for r in rows] == stale
        assert [backend.source_hash(dec) != h_dec, backend.source_hash(gemm) != h_gemm] == stale


def test_the_backend_module_is_plumbing_outside_the_source_hash(backend):
    """A row's provenance is its kernel's module only: a stored config is the fields of that
    kernel's config dataclass (in the hashed kernel module, defaults included), so this backend
    module cannot change what a stored row means."""
    from autofp4.backends import sm90_w4a16 as S
    from autofp4.kernels import sm90_w4a16_gemm as G
    from autofp4.kernels import w4a16_decode as D

    assert S.__name__ not in {m.__name__ for p in (None, *backend.source_parts) for m in backend.source_modules(p)}
    from autofp4.kernels import sm90_moe_gemm as MG
    from autofp4.kernels import w4a16_moe as MO

    assert backend.config_types == {"decode": D.DecodeConfig, "gemm": G.Sm90GemmConfig,
                                    "moe_decode": MO.MoEDecodeConfig, "moe_gemm": MG.MoEGemmConfig}
    assert {m.__name__ for m in backend.source_modules("decode")} == {D.__name__}
    assert {m.__name__ for m in backend.source_modules("gemm")} == {G.__name__}
    key = ProblemKey("linear", "nvfp4", "bfloat16", 4096, 4096)
    for kernel, cls in (("decode", D.DecodeConfig), ("gemm", G.Sm90GemmConfig)):
        for cfg in backend.candidates(key, 1 if kernel == "decode" else 512)[:200]:
            if cfg.kernel == kernel:
                stored = backend.config_dict(cfg)
                assert type(cfg) is cls and backend.parse_config(stored) == cfg
                assert backend.source_part(stored) == kernel


def test_heuristics_are_outside_the_source_hash():
    """Defaults, search space and seeds decide what is tried, not what a config measures: they
    are not part of the provenance hash, so improving them keeps the tuned rows."""
    from autofp4.backends import sm90_heuristics

    b = get_backend("sm90_w4a16")
    names = {m.__name__ for m in b.source_modules()}
    assert sm90_heuristics.__name__ not in names
    assert {"autofp4.kernels.w4a16_decode", "autofp4.kernels.sm90_w4a16_gemm"} <= names
    # the kernels never import the heuristics (the heuristics import the kernels)
    import inspect

    from autofp4.kernels import sm90_w4a16_gemm as G
    from autofp4.kernels import w4a16_decode as D

    for mod in (G, D):
        assert "heuristics" not in inspect.getsource(mod)
    key = ProblemKey("linear", "nvfp4", "bfloat16", 4096, 4096)
    assert b.default(key, 512) == sm90_heuristics.with_pdl(sm90_heuristics.gemm_default(4096, 4096, "nvfp4", "bfloat16", 512))
    assert b.default(key, 1) == sm90_heuristics.with_pdl(sm90_heuristics.decode_default(4096, 4096, "nvfp4", "bfloat16", 1))
    assert b.default(key, 1).kernel == "decode" and b.default(key, 512).kernel == "gemm"


def test_the_search_space_of_a_job_is_its_candidates_field_by_field(backend):
    """TPE's field space: one row per candidate, each field's value as JSON text ("-" where the
    candidate's kernel lacks the field), built the same on a second job (remembered texts)."""
    from autofp4.tuning.candidates import _candidates
    from autofp4.tuning.search import _FieldSpace

    key = ProblemKey("linear", "nvfp4", "bfloat16", 6144, 4096)
    for m in (64, 128):
        cands = _candidates(key, m, [backend])
        space = _FieldSpace(cands)
        assert space.names[0] == "backend" and len(space.rows) == len(cands) > 1000
        for i in random.Random(m).sample(range(len(cands)), 300):
            d = backend.config_dict(cands[i].config)
            assert space.rows[i] == ('"sm90_w4a16"', *(json.dumps(d[n]) if n in d else "-" for n in space.names[1:]))
            assert space.index[space.rows[i]] <= i
        assert {"kernel", "tile_n", "stages"} <= set(space.names)
    from autofp4.schema import config_json
    from autofp4.tuning.candidates import _cfg_json

    for k in (key, ProblemKey("moe", "mxfp4", "bfloat16", 1536, 2048, 128, 8)):
        for m in (1, 4096):
            for c in _candidates(k, m, [backend]):  # the stored (canonical) text, composed from cached parts
                assert c.config_json == _cfg_json(backend, c.config) == config_json(backend.config_dict(c.config))


def test_lazy_candidates_are_the_candidates_in_order(backend):
    """``iter_candidates`` checks grid points as they come (a just-in-time job needs only its
    first few): the same configs, in the same order, as the list built from the cached valid grid,
    at M buckets where decode configs drop out and where they all do."""
    for key, ms in ((ProblemKey("linear", "mxfp4", "bfloat16", 6144, 4096), (1, 16, 512)),
                    (ProblemKey("moe", "nvfp4", "bfloat16", 1536, 2048, 128, 8), (4, 1024))):
        for m in ms:
            assert list(backend.iter_candidates(key, m)) == backend.candidates(key, m)


def test_a_firsts_only_job_lists_what_its_search_would_queue_first(backend):
    """A job that tries only its ranked first candidates (just in time) gets exactly the
    candidates the sampled search queues before sampling (the first ``budget // 2`` of the full
    list's firsts, in order), without the grid being built; a small grid stays whole."""
    from autofp4.backends import get_backend
    from autofp4.tuning.candidates import _candidates, _job_candidates

    key = ProblemKey("linear", "nvfp4", "bfloat16", 4096, 14336)
    rng = random.Random(7)
    full_16 = _candidates(key, 16, [backend])
    siblings = [(backend, c.config) for c in rng.sample(full_16[40:], 5)]
    stored = [(backend, full_16[200].config)]
    for m in (1, 16, 256):
        full = _candidates(key, m, [backend], stored, siblings)
        for budget in (8, 32):
            got, narrowed = _job_candidates(key, m, [backend], stored, siblings, budget)
            assert narrowed and len(full) > budget
            assert [c.ident for c in got] == [c.ident for c in full if c.first][: budget // 2]
            assert got[0].ident == full[0].ident and any(c.prior for c in got)
        assert _job_candidates(key, m, [backend], stored, siblings)[0] == full
    ref = get_backend("reference")
    small, narrowed = _job_candidates(key, 16, [ref], firsts_within=32)
    assert not narrowed and small == _candidates(key, 16, [ref]) and 0 < len(small) <= 32
