"""bench.unit_profile: the per-unit summary of the kernel's rows, and the UNIT_PROFILE builds compile."""

from __future__ import annotations

import dataclasses

import pytest

from bench import unit_profile as up


def _row(take, q, k0, turn, s0, tiles, epi, units, iters, written=1, parts=(0, 0, 0, 0, 0, 0), start=(0, 0, 0)):
    r = [0] * up.WORDS
    r[:7] = [take, q, k0, turn, s0, tiles, epi]
    for name, v in zip(("setup", "qwait", "quant"), start):
        r[up.SPLIT[name]] = v
    r[up.UNITS], r[up.ITERS], r[up.ROW] = units, iters, written
    for name, v in zip(("kv", "rturn", "issue", "swait", "soft", "pvwait"), parts):
        r[up.ROUND[name]] = v
    return r


def test_summary_is_per_unit_and_per_tile():
    # a round's parts (K / V waits, turn, issue, S's wait, softmax, P V's wait) and its rest add up to its tiles
    rows = [_row(100, 2000, 300, 40, 280, 20000, 2200, 2, 16, parts=(1000, 2000, 3000, 4000, 6000, 4000),
                 start=(800, 400, 2000)),
            _row(300, 2000, 300, 40, 280, 30000, 1800, 2, 24, parts=(2000, 3000, 5000, 6000, 9000, 5000),
                 start=(1200, 800, 3000)),
            _row(9, 9, 9, 9, 9, 9, 9, 9, 9, written=0), [0] * up.WORDS]
    r = up.summarize(rows)
    assert r["soft"] == pytest.approx(15000 / 40) and r["rest"] == pytest.approx(50000 / 40)
    assert r["swait"] == pytest.approx(10000 / 40) and r["rturn"] == pytest.approx(5000 / 40)
    assert r["take"] == pytest.approx(100) and r["epi"] == pytest.approx(1000) and r["tiles"] == pytest.approx(25000)
    assert r["tile"] == pytest.approx(100000 / 40) and r["tiles_per_unit"] == 10 and r["units_per_wg"] == 2
    # a unit's start: setup, Q's wait, the quantization, then the rest of Q's part
    assert r["setup"] == pytest.approx(500) and r["qwait"] == pytest.approx(300) and r["quant"] == pytest.approx(1250)
    assert r["boundary"] == pytest.approx(100 + 500 + 300 + 1250 + 1000 + 150 + 20 + 140 + 1000)
    assert r["share"] == pytest.approx(r["boundary"] / (r["boundary"] + 25000))


def test_summary_needs_a_written_row():
    with pytest.raises(ValueError, match="UNIT_PROFILE"):
        up.summarize([[0] * up.WORDS])


@pytest.mark.parametrize("fp8,define", [(False, ("UNIT_PROFILE", 1)), (True, ("UNIT_PROFILE", 1)),
                                         (True, ("UNIT_PROFILE", 2)), (True, ("DIAG_ENERGY", 1)),
                                         (True, ("DIAG_ENERGY", 2)), (True, ("EXP_SHIFT", 0)),
                                         (True, ("DIRECT_P", 0)), (True, ("P_LAZY", 8))])
def test_bench_builds_compile_for_sm90a(fp8, define, tmp_path, monkeypatch):
    """The benches' build switches compile with NVRTC sm_90a: the unit profile (segments; UNIT_PROFILE=2 a
    round's parts too) in a 16-bit and an FP8 per-page build, DIAG_ENERGY's FP8 builds (no softmax; no MMAs),
    the FP8 softmax's exp2 on the MUFU (EXP_SHIFT=0, the A/B base of the bit-shift form), P through an f16
    (DIRECT_P=0) and the 16-bit tiles' reference threshold (P_LAZY=8), the A/B bases of stop 50."""
    from hip_kernels import prefill, runtime

    try:
        runtime.toolchain_for("sm_90a")
    except runtime.ToolchainMissingError:
        pytest.skip("NVRTC not installed")
    monkeypatch.setenv("ATOM_KERNEL_CACHE", str(tmp_path))
    monkeypatch.delenv("ATOM_NO_COMPILE", raising=False)
    cfg = prefill.FP8_CONFIGS[128] if fp8 else prefill.WGMMA_CONFIGS[128]
    cfg = dataclasses.replace(cfg, extra=cfg.extra + (define,))
    v = (prefill._variant(128, 0, False, cfg, prefill.KV_FP8_MODES["per_page16"]) if fp8
         else prefill._variant(128, 0, False, cfg))
    assert dict(v.defines).get(define[0]) == str(define[1])
    assert runtime.compile_variant(v, "sm_90a").binary[:4] == b"\x7fELF"


def test_summary_without_round_parts():
    """UNIT_PROFILE=1 rows hold the tiles whole in `rest`: a tile is their cycles over the tiles."""
    r = up.summarize([_row(100, 2000, 300, 40, 280, 40000, 2200, 2, 16)])
    assert r["tile"] == pytest.approx(2500) and r["rest"] == pytest.approx(2500) and r["soft"] == 0
    assert r["tiles"] == pytest.approx(20000)
