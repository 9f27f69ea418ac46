"""bench.unit_profile: the per-unit summary of the kernel's rows, and the UNIT_PROFILE builds compile."""

from __future__ import annotations

import dataclasses

import pytest

from bench import unit_profile as up


def _row(take, q, k0, turn, s0, tiles, epi, units, iters, written=1):
    r = [0] * up.WORDS
    r[:7] = [take, q, k0, turn, s0, tiles, epi]
    r[up.UNITS], r[up.ITERS], r[up.ROW] = units, iters, written
    return r


def test_summary_is_per_unit_and_per_tile():
    rows = [_row(100, 2000, 300, 40, 280, 40000, 2200, 2, 16), _row(300, 2000, 300, 40, 280, 60000, 1800, 2, 24),
            _row(9, 9, 9, 9, 9, 9, 9, 9, 9, written=0), [0] * up.WORDS]
    r = up.summarize(rows)
    assert r["take"] == pytest.approx(100) and r["epi"] == pytest.approx(1000) and r["tiles"] == pytest.approx(25000)
    assert r["tile"] == pytest.approx(100000 / 40) and r["tiles_per_unit"] == 10 and r["units_per_wg"] == 2
    assert r["boundary"] == pytest.approx(100 + 1000 + 150 + 20 + 140 + 1000)
    assert r["share"] == pytest.approx(r["boundary"] / (r["boundary"] + 25000))


def test_summary_needs_a_written_row():
    with pytest.raises(ValueError, match="UNIT_PROFILE"):
        up.summarize([[0] * up.WORDS])


def test_profile_builds_compile_for_sm90a(tmp_path, monkeypatch):
    """The segments' marks and lse's rows compile in a 16-bit and an FP8 (per page) build."""
    from hip_kernels import prefill, runtime

    try:
        runtime.toolchain_for("sm_90a")
    except runtime.ToolchainMissingError:
        pytest.skip("NVRTC not installed")
    monkeypatch.setenv("ATOM_KERNEL_CACHE", str(tmp_path))
    monkeypatch.delenv("ATOM_NO_COMPILE", raising=False)
    for cfg, mode in ((prefill.WGMMA_CONFIGS[128], 0), (prefill.FP8_CONFIGS[128], prefill.KV_FP8_MODES["per_page16"])):
        prof = dataclasses.replace(cfg, extra=cfg.extra + (("UNIT_PROFILE", 1),))
        v = prefill._variant(128, 0, False, prof, mode) if mode else prefill._variant(128, 0, False, prof)
        assert dict(v.defines).get("UNIT_PROFILE") == "1"
        assert runtime.compile_variant(v, "sm_90a").binary[:4] == b"\x7fELF"
