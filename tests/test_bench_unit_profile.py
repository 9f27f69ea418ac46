"""bench.unit_profile: the per-unit summary of the kernel's rows, and its stamped builds compile."""

from __future__ import annotations

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
    with pytest.raises(ValueError, match="profile_source"):
        up.summarize([[0] * up.WORDS])


@pytest.mark.parametrize("fp8,level", [(False, 1), (True, 1), (True, 2)])
def test_profile_builds_compile_for_sm90a(fp8, level, sm90_cache):
    """The unit profile's build (the stamps of bench.unit_profile.profile_source, an overlay of the shipped
    kernel; level 2: a round's parts too) compiles with NVRTC sm_90a in a 16-bit and an FP8 per-16-keys build."""
    from hip_kernels import prefill, runtime
    mode = "per_page16" if fp8 else None
    build = prefill.Build(prefill.config_for(128, 0, "sm_90a", mode), source=up.profile_source(level))
    v = build.variant(128, 0, False, prefill.KV_FP8_MODES[mode] if fp8 else 0)
    assert v.source == build.source and "prof.rmark(R_SWAIT)" in open(v.source).read()
    assert runtime.compile_variant(v, "sm_90a").binary[:4] == b"\x7fELF"


def test_summary_without_round_parts():
    """Level-1 rows hold the tiles whole in `rest`: a tile is their cycles over the tiles."""
    r = up.summarize([_row(100, 2000, 300, 40, 280, 40000, 2200, 2, 16)])
    assert r["tile"] == pytest.approx(2500) and r["rest"] == pytest.approx(2500) and r["soft"] == 0
    assert r["tiles"] == pytest.approx(20000)
