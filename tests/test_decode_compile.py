"""CPU tests of the small-M decode kernel: packed layout, config rules, sm_90a compilation."""
import math
import os

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import autofp4  # noqa: E402
from autofp4.kernels import w4a16_decode as D  # noqa: E402
from autofp4.backends import sm90_heuristics as H  # noqa: E402
from autofp4.kernels import _fp4_bits as fp4_bits  # noqa: E402
from autofp4.weights import FP4Weight  # noqa: E402

# compiles CuTeDSL kernels on the CPU (minutes on 2 cores): not in the quick subset
pytestmark = pytest.mark.compile

LLAMA = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (57344, 8192), (8192, 28672)]


def _weight(n, k, fmt, gen, scale=0.05):
    return autofp4.quantize(torch.randn(n, k, generator=gen) * scale, fmt)


# ------------------------------------------------------------------------------ layout
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("n,k", [(16, 512), (40, 1088), (129, 2048), (7, 64)])
def test_packed_decode_matches_dequantize(fmt, dtype, n, k, gen):
    """Emulating the kernel's bit decode, scale encoding, bf16/fp16 multiply and epilogue on
    the packed bytes reproduces FP4Weight.dequantize exactly (edges in N and K included)."""
    w = _weight(n, k, fmt, gen)
    p = D.pack_weight(w)
    got = D.unpack_reference(p, dtype).double()
    ref = w.dequantize(torch.float64)
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, rtol=0, atol=0)


def _lane_position(n, k, tiles_groups):
    """Byte offset of the 16-byte lane record and word index that hold element (n, k), from
    the documented layout (independent of pack_weight's tensor permutes)."""
    groups = tiles_groups
    tile, rr = divmod(n, 16)
    h, g = divmod(rr, 8)
    grp, kr = divmod(k, 512)
    c, kr = divmod(kr, 64)
    t, kr = divmod(kr, 16)
    j, kk = divmod(kr, 4)
    lane = g * 4 + t
    off = (((tile * groups + grp) * 8 + c) * 32 + lane) * 16 + 4 * j
    reg = h + 2 * (kk // 2)
    return off, reg, kk % 2


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_single_value_lands_in_documented_word(fmt, gen):
    """A weight with one non-zero code: exactly the bits of word_bit in the documented word."""
    n, k = 40, 1536
    for _ in range(20):
        i = int(torch.randint(n, (1,), generator=gen))
        kk = int(torch.randint(k, (1,), generator=gen))
        code = int(torch.randint(1, 16, (1,), generator=gen))
        codes = torch.zeros(n, k, dtype=torch.uint8)
        codes[i, kk] = code
        data = codes[:, 0::2] | (codes[:, 1::2] << 4)
        if fmt == "nvfp4":
            scale = torch.ones(n, k // 16).to(torch.float8_e4m3fn)
            w = FP4Weight(fmt, data, scale, torch.tensor(1.0))
        else:
            w = FP4Weight(fmt, data, torch.full((n, k // 32), 127, dtype=torch.uint8))
        p = D.pack_weight(w)
        words = p.data.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        off, reg, e = _lane_position(i, kk, D._groups(k))
        expect = sum(((code >> b) & 1) << fp4_bits.word_bit(reg, e, b) for b in range(4))
        assert int(words[off // 4]) == expect
        nz = torch.nonzero(words).flatten().tolist()
        assert nz == [off // 4]


def test_scale_layout_nvfp4(gen):
    """The scale code for (row, 16-block) sits at [tile, group, lane(g, t), 2 * chunk + h]."""
    n, k = 32, 1024
    w = _weight(n, k, "nvfp4", gen)
    p = D.pack_weight(w)
    raw = w.scale.view(torch.uint8)
    groups = D._groups(k)
    for _ in range(50):
        r = int(torch.randint(n, (1,), generator=gen))
        b = int(torch.randint(k // 16, (1,), generator=gen))
        tile, rr = divmod(r, 16)
        h, g = divmod(rr, 8)
        grp, br = divmod(b, 32)
        c, t = divmod(br, 4)
        off = ((tile * groups + grp) * 32 + g * 4 + t) * 16 + 2 * c + h
        assert int(p.scales[off]) == _nv_code(int(raw[r, b]))


def _nv_code(byte: int) -> int:
    """The documented scale code of a positive E4M3 byte: 8 * (binade + 9) + 3-bit mantissa."""
    v = float(torch.tensor([byte], dtype=torch.uint8).view(torch.float8_e4m3fn).float())
    binade = math.floor(math.log2(v))
    mant = v / 2.0 ** binade - 1
    assert mant * 8 == int(mant * 8)
    return 8 * (binade + 9) + int(mant * 8)


def test_nvfp4_every_scale_exact(gen):
    """Every E4M3 scale FP4Weight accepts (0x00 .. 0x7E: zero, subnormals, normals up to 448) on
    random nibbles: the kernel's decode (emulated) equals FP4Weight.dequantize exactly in bf16
    and fp16."""
    n, k = 32, 64 * 16
    scale = torch.tensor((list(range(0x7F)) * 17)[: n * k // 16], dtype=torch.uint8)
    scale = scale[torch.randperm(scale.numel(), generator=gen)].view(n, k // 16)
    data = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
    w = FP4Weight("nvfp4", data, scale.view(torch.float8_e4m3fn), torch.tensor(0.37))
    p = D.pack_weight(w)
    ref = w.dequantize(torch.float64)
    assert bool((ref == 0).any()) and bool((ref < 0).any())
    for dtype in ("bfloat16", "float16"):
        torch.testing.assert_close(D.unpack_reference(p, dtype).double(), ref, rtol=0, atol=0)
    lut = D._nv_scale_code_lut()
    assert [lut[b] for b in range(1, 127)] == [_nv_code(b) for b in range(1, 127)]
    assert lut[0x38] == 8 * 9 and lut[0x7E] == 142  # 1.0, 448
    assert lut[0] == lut[0x80] == lut[0x7F] == -1


def test_mxfp4_fp16_range_is_rejected(gen):
    """Block exponents spanning more than fp16 can hold: packed marks fp16 unsupported, bf16 ok."""
    n, k = 16, 512
    w = _weight(n, k, "mxfp4", gen)
    scale = w.scale.clone()
    scale[0, 0] = 90
    scale[1, 1] = 140
    w2 = FP4Weight("mxfp4", w.data, scale)
    p = D.pack_weight(w2)
    assert p.unsupported[0] is None
    assert "float16" in p.unsupported[1] and "bfloat16" in p.unsupported[1]
    got = D.unpack_reference(p, "bfloat16").double()
    torch.testing.assert_close(got, w2.dequantize(torch.float64), rtol=0, atol=0)


def test_pack_rejects_stacked_experts(gen):
    w = autofp4.quantize(torch.randn(2, 16, 64, generator=gen), "nvfp4")
    with pytest.raises(ValueError, match="2-D"):
        D.pack_weight(w)


# ------------------------------------------------------------------------------ configs
@pytest.mark.parametrize(
    "cfg,n,k,fmt,dtype,needle",
    [
        (D.DecodeConfig(m_max=12), 64, 512, "nvfp4", "bfloat16", "m_max"),
        (D.DecodeConfig(warps=3), 64, 512, "nvfp4", "bfloat16", "warps"),
        (D.DecodeConfig(k_split=3), 64, 1024, "nvfp4", "bfloat16", "exceeds"),
        (D.DecodeConfig(k_split=4), 64, 512 * 6, "nvfp4", "bfloat16", "empty split"),
        (D.DecodeConfig(k_split=0), 64, 512, "nvfp4", "bfloat16", "k_split"),
        (D.DecodeConfig(), 64, 520, "nvfp4", "bfloat16", "block size"),
        (D.DecodeConfig(), 64, 528, "mxfp4", "bfloat16", "block size"),
        (D.DecodeConfig(), 64, 512, "fp8", "bfloat16", "fmt"),
        (D.DecodeConfig(), 64, 512, "nvfp4", "float32", "dtype"),
        (D.DecodeConfig(), 0, 512, "nvfp4", "bfloat16", "n must"),
        (D.DecodeConfig(m_max=64, warps=4), 64, 512, "nvfp4", "bfloat16", None),
        (D.DecodeConfig(m_max=64, warps=16), 64, 512, "nvfp4", "bfloat16", "register"),
        (D.DecodeConfig(m_max=64, prefetch=True, tiles_per_warp=2), 64, 512, "nvfp4", "bfloat16", "255"),
        (D.DecodeConfig(tiles_per_warp=3), 64, 512, "nvfp4", "bfloat16", "tiles_per_warp"),
        (D.DecodeConfig(prefetch=1), 64, 512, "nvfp4", "bfloat16", "prefetch"),
        (D.DecodeConfig(split_reduce="atomic", k_split=2), 64, 1024, "nvfp4", "bfloat16", "split_reduce"),
        (D.DecodeConfig(split_reduce="last_warp"), 64, 1024, "nvfp4", "bfloat16", "k_split > 1"),
        (D.DecodeConfig(split_reduce="cluster"), 64, 1024, "nvfp4", "bfloat16", "k_split > 1"),
        (D.DecodeConfig(k_split=12, split_reduce="cluster"), 64, 6144, "nvfp4", "bfloat16", "at most 8"),
        (D.DecodeConfig(prefetch=True, x_smem=True), 64, 1024, "nvfp4", "bfloat16", "prefetch=False"),
        (D.DecodeConfig(x_smem=1), 64, 1024, "nvfp4", "bfloat16", "x_smem must be a bool"),
        (D.DecodeConfig(16, 2, 64, split_reduce="cluster", tiles_per_warp=2), 64, 8192, "nvfp4", "bfloat16",
         "shared memory"),
        (D.DecodeConfig(4, 1, 16, ctas_per_sm=6), 64, 512, "nvfp4", "bfloat16", None),
        (D.DecodeConfig(4, 1, 16, ctas_per_sm=-1), 64, 512, "nvfp4", "bfloat16", "ctas_per_sm must"),
        (D.DecodeConfig(16, 1, 16, ctas_per_sm=5), 64, 512, "nvfp4", "bfloat16", "2048"),
        (D.DecodeConfig(8, 1, 16, ctas_per_sm=6), 64, 512, "nvfp4", "bfloat16", "caps registers at 40"),
        (D.DecodeConfig(4, 1, 16, x_smem=True, smem_stages=3), 64, 512, "nvfp4", "bfloat16", None),
        (D.DecodeConfig(pdl_early=True), 64, 512, "nvfp4", "bfloat16", "needs pdl=True"),
        (D.DecodeConfig(pdl=True, pdl_early=1), 64, 512, "nvfp4", "bfloat16", "pdl_early must be a bool"),
        (D.DecodeConfig(pdl=True, pdl_early=True), 64, 512, "nvfp4", "bfloat16", None),
        (D.DecodeConfig(4, 1, 16, smem_stages=3), 64, 512, "nvfp4", "bfloat16", "x_smem=True"),
        (D.DecodeConfig(4, 1, 16, x_smem=True, smem_stages=1), 64, 512, "nvfp4", "bfloat16", "smem_stages must"),
        (D.DecodeConfig(16, 1, 16, x_smem=True, smem_stages=4), 64, 512, "nvfp4", "bfloat16", "bytes of shared"),
        (D.DecodeConfig(4, 1, 64, x_smem=True, smem_stages=4), 64, 512, "nvfp4", "bfloat16", "bytes of shared"),
    ],
)
def test_validate_rules(cfg, n, k, fmt, dtype, needle):
    reason = D.validate(cfg, n, k, fmt, dtype)
    if needle is None:
        assert reason is None
    else:
        assert reason is not None and needle in reason


def test_invalid_config_rejected_before_compiling(monkeypatch):
    # a compile attempt would fail loudly: validation must stop it first
    monkeypatch.setattr(D, "_compile", lambda *a, **k: pytest.fail("compiled an invalid config"))
    with pytest.raises(ValueError, match="m_max"):
        D.compile_only(D.DecodeConfig(m_max=24), 64, 512, "nvfp4", "bfloat16")
    with pytest.raises(ValueError, match="block size"):
        D.compile_kernel(D.DecodeConfig(), 64, 520, "nvfp4", "bfloat16")


@pytest.mark.parametrize("n,k", LLAMA)
def test_default_config_valid(n, k):
    for fmt in ("nvfp4", "mxfp4"):
        for m in (None, 1, 3, 8, 9, 16, 17, 33, 64):
            cfg = H.decode_default(n, k, fmt, "bfloat16", m)
            assert D.validate(cfg, n, k, fmt, "bfloat16") is None
            assert cfg.m_max >= (m or 16)


def test_config_space_values_are_checked():
    space = H.decode_config_space(4096, 4096, "nvfp4", "bfloat16")
    valid = invalid = 0
    for ks in space["k_split"]:
        for w in space["warps"]:
            for mm in space["m_max"]:
                cfg = D.DecodeConfig(warps=w, k_split=ks, m_max=mm)
                if D.validate(cfg, 4096, 4096, "nvfp4", "bfloat16") is None:
                    valid += 1
                else:
                    invalid += 1
    assert valid > 10 and invalid > 0


# ------------------------------------------------------------------------------ compile
try:
    import cutlass  # noqa: F401

    HAVE_CUTE = True
except ImportError:  # pragma: no cover
    HAVE_CUTE = False
needs_cute = pytest.mark.skipif(not HAVE_CUTE, reason="needs nvidia-cutlass-dsl")


@needs_cute
@pytest.mark.parametrize(
    "cfg,n,k,fmt,dtype",
    [
        (D.DecodeConfig(4, 1, 8), 4096, 4096, "nvfp4", "bfloat16"),
        (D.DecodeConfig(4, 3, 16, split_reduce="kernel"), 200, 1536, "mxfp4", "bfloat16"),
        (D.DecodeConfig(2, 2, 32, prefetch=True, split_reduce="last_warp"), 40, 1040, "nvfp4", "float16"),
        (D.DecodeConfig(8, 1, 16, prefetch=True), 64, 512, "mxfp4", "float16"),
        (D.DecodeConfig(4, 4, 64), 300, 4096, "nvfp4", "bfloat16"),
        (D.DecodeConfig(4, 3, 16, split_reduce="last_warp", tiles_per_warp=2), 200, 1536, "mxfp4", "bfloat16"),
        (D.DecodeConfig(4, 8, 8, split_reduce="cluster"), 4096, 4096, "nvfp4", "bfloat16"),
        (D.DecodeConfig(4, 1, 16, x_smem=True), 4096, 4096, "nvfp4", "bfloat16"),
        (D.DecodeConfig(8, 4, 16, split_reduce="cluster", tiles_per_warp=2, x_smem=True), 1000, 2048, "mxfp4", "float16"),
        (D.DecodeConfig(2, 3, 32, split_reduce="cluster", tiles_per_warp=2), 520, 3072, "mxfp4", "float16"),
        (D.DecodeConfig(2, 1, 8, tiles_per_warp=2), 24, 512, "nvfp4", "float16"),
        (D.DecodeConfig(4, 2, 16, x_smem=True, smem_stages=3), 4096, 4096, "nvfp4", "bfloat16"),
        (D.DecodeConfig(8, 4, 16, split_reduce="cluster", tiles_per_warp=2, x_smem=True, smem_stages=2),
         1000, 2048, "mxfp4", "float16"),
        (D.DecodeConfig(4, 3, 8, split_reduce="last_warp", x_smem=True, smem_stages=4), 200, 1056, "mxfp4",
         "bfloat16"),
        (D.DecodeConfig(4, 8, 8, split_reduce="cluster", x_smem=True, pdl=True, pdl_early=True), 4096, 4096,
         "nvfp4", "bfloat16"),
        (D.DecodeConfig(8, 2, 16, x_smem=True, smem_stages=2, pdl=True, pdl_early=True), 1000, 2048, "mxfp4",
         "float16"),
    ],
)
def test_compiles_for_sm90a(cfg, n, k, fmt, dtype):
    assert D.validate(cfg, n, k, fmt, dtype) is None
    D.compile_only(cfg, n, k, fmt, dtype)


def test_decode_terms_cover_every_bit():
    for dtype in ("bfloat16", "float16"):
        seen = 0
        for terms in fp4_bits.decode_terms(dtype):
            reg_mask = 0
            for _, mask in terms:
                assert reg_mask & mask == 0
                reg_mask |= mask
            assert bin(reg_mask).count("1") == 8
            seen += 1
        assert seen == 4


@needs_cute
def test_ctas_per_sm_reaches_the_compiler(tmp_path, monkeypatch):
    """ctas_per_sm=6 becomes ``.minnctapersm 6`` on the main kernel; with ptxas at hand, the
    cubin of the m_max = 16 kernel fits 6 CTAs of 128 threads (<= 85 registers) without spills."""
    import re

    text, main = _compiled_ptx(D.DecodeConfig(4, 4, 16, x_smem=True, ctas_per_sm=6), tmp_path, monkeypatch)
    assert re.search(r"\.reqntid 128, 1, 1\s+\.minnctapersm 6", main)
    info = _ptxas_info(text, tmp_path)
    if info is None:
        return
    regs, spill = _regs_spill(info)
    assert regs <= 65536 // (6 * 128) and spill == 0, info[:400]


@needs_cute
@pytest.mark.parametrize("early", [False, True])
def test_pdl_trigger_placement_in_ptx(early, tmp_path, monkeypatch):
    """The main kernel lets the next one launch once: after its main loop (its last MMA), or
    with ``pdl_early`` right after its own dependent wait (before its first MMA)."""
    cfg = D.DecodeConfig(4, 8, 8, split_reduce="cluster", x_smem=True, pdl=True, pdl_early=early)
    _, main = _compiled_ptx(cfg, tmp_path, monkeypatch)
    assert main.count("griddepcontrol.launch_dependents") == 1 and main.count("griddepcontrol.wait") == 1
    trigger, wait = main.index("griddepcontrol.launch_dependents"), main.index("griddepcontrol.wait")
    first_mma, last_mma = main.index("mma.sync"), main.rindex("mma.sync")
    if early:
        assert wait < trigger < first_mma
    else:
        assert wait < last_mma < trigger


def _compiled_ptx(cfg, tmp_path, monkeypatch) -> tuple[str, str]:
    """The PTX of ``cfg`` for a 6144 x 4096 NVFP4 bf16 problem (compiled for sm_90a, bypassing
    the kernel cache), and its text from the main kernel on."""
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    monkeypatch.setenv("AUTOFP4_CUTE_DSL_OPTIONS", f"--keep-ptx --dump-dir={tmp_path}")
    D._compile(cfg, 6144, 4096, "nvfp4", "bfloat16", False)
    (ptx,) = tmp_path.glob("*.ptx")
    text = ptx.read_text()
    return text, text[text.index("main_kernel"):]


def _ptxas_info(text: str, tmp_path) -> str | None:
    """``ptxas -v`` output for the main kernel of ``text``, or None without a usable ptxas (the
    local one may be older than the PTX the DSL emits; the directives used are not)."""
    import re
    import shutil
    import subprocess

    ptxas = shutil.which("ptxas")
    if ptxas is None:
        return None
    src = tmp_path / "k.ptx"
    src.write_text(re.sub(r"^\.version \d+\.\d+", ".version 8.0", text, flags=re.M))
    res = subprocess.run([ptxas, "-arch=sm_90a", "-v", str(src), "-o", str(tmp_path / "k.cubin")],
                         capture_output=True, text=True)
    if res.returncode != 0:
        return None
    return res.stderr[res.stderr.index("main_kernel"):]


def _regs_spill(info: str) -> tuple[int, int]:
    import re

    return (int(re.search(r"Used (\d+) registers", info).group(1)),
            int(re.search(r"(\d+) bytes spill stores", info).group(1)))


@needs_cute
def test_smem_stages_pipeline_in_ptx(tmp_path, monkeypatch):
    """smem_stages=3 copies with cp.async, waits until one group (the newest) is in flight, and
    holds no weight buffer in registers: with ptxas at hand, the m_max = 16 kernel needs far
    fewer than the 107 registers of the register-buffered one, without spills."""
    text, main = _compiled_ptx(D.DecodeConfig(4, 2, 16, x_smem=True, smem_stages=3), tmp_path, monkeypatch)
    assert main.count("cp.async.cg.shared.global") >= 9  # 8 weight chunks + scales per group
    assert "cp.async.wait_group 1;" in main and "cp.async.commit_group;" in main
    info = _ptxas_info(text, tmp_path)
    if info is not None:
        regs, spill = _regs_spill(info)
        assert regs <= 72 and spill == 0, info[:400]



def test_fp4_word_layout_and_term_ops(gen):
    """The shared word layout: every bit used once; bf16 pairs decode in 5 terms (in place, one
    shift, one rotate, two shifts); each term's cheap op equals the rotate-and-mask on random
    words."""
    bits = sorted(fp4_bits.word_bit(j, h, b) for j in range(4) for h in range(2) for b in range(4))
    assert bits == list(range(32))
    terms = fp4_bits.decode_terms("bfloat16")
    assert [len(t) for t in terms] == [1, 1, 1, 2]
    ops = [fp4_bits.term_op(rot, mask)[0] for t in terms for rot, mask in t]
    assert ops == ["and", "shl", "rot", "shl", "shr"]
    assert sum(len(t) for t in fp4_bits.decode_terms("float16")) == 9
    words = torch.randint(0, 2**32, (4096,), generator=gen, dtype=torch.int64).tolist()
    for dtype in ("bfloat16", "float16"):
        for t in fp4_bits.decode_terms(dtype):
            for rot, mask in t:
                op, amount = fp4_bits.term_op(rot, mask)
                for w in words:
                    want = fp4_bits.rotl(w, rot) & mask
                    got = {"and": w, "shl": (w << amount) & 0xFFFFFFFF, "shr": w >> amount,
                           "rot": fp4_bits.rotl(w, amount)}[op] & mask
                    assert got == want, (dtype, rot, hex(mask), op)
