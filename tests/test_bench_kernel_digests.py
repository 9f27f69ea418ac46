"""bench.kernel_digests: variants matched by (kernel, remaining defines), and two builds of one AMD source
digest alike (clang's __hip_cuid_ symbol is named from the runtime's temporary source path)."""

from __future__ import annotations

import pytest

from bench import kernel_digests as kd
from hip_kernels import runtime


def test_compare_matches_by_kernel_and_remaining_defines(capsys):
    old = {"sm_90a": {"k[A=1,EXP_POLY=0]": "x", "k[A=2,EXP_POLY=0]": "y"}}
    new = {"sm_90a": {"k[A=1]": "x", "k[A=2]": "z"}}
    assert kd.compare(old, new, {"EXP_POLY"}) == 1
    out = capsys.readouterr().out
    assert "identical    1  differing   1" in out and "differs: k[A=2]" in out
    assert kd.compare(old, new, set()) == 4  # without the ignored define nothing matches


def test_two_amd_builds_digest_alike(tmp_path, monkeypatch):
    try:
        runtime.toolchain_for("gfx942")
    except runtime.ToolchainMissingError:
        pytest.skip("clang-22 not installed")
    from hip_kernels import combine

    v = combine.variants()[0]
    bins = []
    for i in range(3):  # a fresh cache each time: compiled anew from a new temporary directory
        monkeypatch.setenv("ATOM_KERNEL_CACHE", str(tmp_path / str(i)))
        bins.append(runtime.compile_variant(v, "gfx942").binary)
    assert len({kd.amd_code_digest(b) for b in bins}) == 1
    assert len({kd.text_section(b) for b in bins}) == 1
    assert b"__hip_cuid_" in bins[0]
