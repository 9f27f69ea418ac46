"""bench.ab's host logic: the rotated timing order and the summary (the timing itself runs on the GPU)."""

from __future__ import annotations

import pytest

from bench import ab
from bench import common
from bench.common import parse_defines


def test_every_variant_leads_once_per_cycle_of_rounds():
    names = ["base", "base'", "work"]
    orders = [common.rotated(names, r) for r in range(6)]
    assert all(sorted(o) == sorted(names) for o in orders)
    for pos in range(3):
        assert sorted(o[pos] for o in orders[:3]) == sorted(names)  # each position, each variant once
    assert orders[3] == orders[0]


def test_summary_is_medians_and_ratios_to_the_first():
    tf = {("s", "base"): [100.0, 90.0, 110.0], ("s", "base'"): [99.0, 101.0, 95.0], ("s", "work"): [120.0, 80.0, 121.0]}
    row = ab.summary(tf, ["base", "base'", "work"])["s"]
    assert row["base"] == (100.0, 1.0)
    assert row["base'"][0] == 99.0 and row["base'"][1] == pytest.approx(0.99)
    assert row["work"][0] == 120.0 and row["work"][1] == pytest.approx(1.2)


def test_summary_leaves_out_a_shape_a_variant_could_not_build():
    tf = {("s", "base"): [100.0], ("s", "work"): [110.0], ("t", "work"): [50.0]}
    assert list(ab.summary(tf, ["base", "work"])) == ["s"]


def test_defines_need_name_and_value():
    assert parse_defines(["CTAS=3", "MAX=4"]) == (("CTAS", "3"), ("MAX", "4"))
    for bad in (["CTAS"], ["=1"], ["X="]):
        with pytest.raises(SystemExit):
            parse_defines(bad)


def test_fp8_config_fields_are_integers():
    assert ab._config_fields("num_warps=12,block_n=64") == {"num_warps": 12, "block_n": 64}
    assert ab._config_fields(None) == {}
    for bad in ("num_warps=x", "num_warps", "=4"):
        with pytest.raises(SystemExit):
            ab._config_fields(bad)


def test_parameters_compare_the_kernels_signatures(tmp_path):
    src = (ab.SRC_DIR / ab.KERNEL).read_text()
    assert ab.parameters(src).startswith("const ATOM_GRID_CONSTANT tma_desc tm_q")
    f = tmp_path / "k.hip"
    f.write_text(src.replace("u16* __restrict__ o,", "u16* __restrict__ o, int extra,"))
    assert ab.base_source(str(f)) == f.read_text()
    assert ab.parameters(ab.base_source(str(f))) != ab.parameters(src)


def test_a_revision_base_brings_its_own_headers():
    """A base kernel at a git revision builds with that revision's hip_kernels/src headers (a kernel split
    into headers later, or earlier, still finds its own); a file base with the working tree's."""
    import subprocess

    try:
        h = ab.base_headers("HEAD")
    except (subprocess.CalledProcessError, FileNotFoundError) as e:
        pytest.skip(f"no git history here: {e}")
    assert "prefill_tiles.h" in h and all(name.endswith(".h") for name in h)
    assert h["prefill_tiles.h"] == ab._git("show", "HEAD:hip_kernels/src/prefill_tiles.h")
    assert ab.base_headers(str(ab.SRC_DIR / ab.KERNEL)) == {}
