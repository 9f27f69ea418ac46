"""bench/overlay.py: the benches' builds of the shipped kernels (edits that must each fit once), and every
overlay a bench writes compiles (its kernels run on the GPU)."""

from __future__ import annotations

import pytest

from bench import overlay
from hip_kernels import runtime


def test_an_edit_must_fit_exactly_once():
    assert overlay.apply("a b c", [overlay.replace("b", "B"), overlay.after("c", "!"), overlay.before("a", ">")]) == ">a B c!"
    with pytest.raises(overlay.OverlayError, match="0 occurrences"):
        overlay.apply("a b c", [overlay.replace("x", "y")])
    with pytest.raises(overlay.OverlayError, match="2 occurrences"):
        overlay.apply("a a", [overlay.replace("a", "b")])


def test_overlay_directory_holds_the_kernel_headers(tmp_path):
    path = overlay.write("combine.hip", [], "same")
    d = overlay.directory()
    assert {p.name for p in overlay.SRC_DIR.glob("*.h")} <= {p.name for p in d.iterdir()}
    assert open(path).read() == (overlay.SRC_DIR / "combine.hip").read_text()
    # a header edit gets a directory of its own: the other overlays keep the shipped header
    p2 = overlay.write("varlen_prefill.hip", [], "hdr", {"prefill_tiles.h": [overlay.after("#pragma once\n", "// x\n")]})
    assert "// x" in open(p2.rsplit("/", 1)[0] + "/prefill_tiles.h").read()
    assert "// x" not in (d / "prefill_tiles.h").read_text()


@pytest.mark.parametrize("dry,timeline", [(True, False), (False, True), (True, True)])
def test_decode_overlays_compile(dry, timeline, sm90_cache):
    """bench.decode_profile's builds of the tensor-core split kernel: its copies without the math (dry,
    bench.stream_probe too) and its per-CTA timeline stamps."""
    from bench import decode_profile
    from hip_kernels import decode

    src = decode_profile.mma_source(dry=dry, timeline=timeline)
    text = open(src).read()
    assert ("(void)c;  // dry" in text) == dry and ("tl[3] = now_ns()" in text) == timeline
    v = decode._mma_variant(128, 0, 0)
    c = runtime.compile_variant(runtime.Variant(src, v.kernel, v.defines), "sm_90a")
    assert c.binary[:4] == b"\x7fELF"


def test_fp8_long_rowsum_overlay_compiles(sm90_cache):
    """bench.fp8_long's per-tensor two-warpgroup fp32-score tile with P's row sums by the tensor cores."""
    import dataclasses

    from bench import fp8_long
    from hip_kernels import prefill

    cfg = dataclasses.replace(prefill.config_for(128, 0, "sm_90a", "per_tensor"), num_warps=8, f16_scores=False)
    v = prefill.Build(cfg, source=fp8_long.rowsum_source()).variant(128, 0, False, prefill.KV_FP8_MODES["per_tensor"])
    assert runtime.compile_variant(v, "sm_90a").binary[:4] == b"\x7fELF"


@pytest.mark.parametrize("kv_code,tune", [(0, {"UNROLL": 3, "STAGES": 3}), (2, {"UNROLL": 2, "STAGES": 6})])
def test_fma_tune_overlay_compiles(kv_code, tune, sm90_cache):
    """bench.decode --tune's builds of the FMA split kernel with other keys per chunk and ring depths."""
    from bench import decode as bench_decode

    src = bench_decode.fma_tuned(tune)
    text = open(src).read()
    assert f"constexpr int U = {tune['UNROLL']};" in text and f"constexpr int NST = {tune['STAGES']};" in text
    from hip_kernels import decode

    v = decode._variant(128, 1, 0, kv_code)
    c = runtime.compile_variant(runtime.Variant(src, v.kernel, v.defines), "sm_90a")
    assert c.binary[:4] == b"\x7fELF"
