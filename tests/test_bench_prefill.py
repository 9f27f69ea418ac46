"""bench.prefill's rotated pass (the timing itself runs on the GPU; here a fake timer)."""

from __future__ import annotations

import pytest

from bench import common
from bench import prefill as bp


def test_rotated_rounds_time_each_kernel_once_a_round_and_rotate_the_lead():
    calls = []
    fns = {n: (lambda n=n: n) for n in ("ours", "fp8 per_page", "fp8 per_tensor", "sdpa-cudnn")}
    ms = {"ours": 2.0, "fp8 per_page": 1.0, "fp8 per_tensor": 0.5, "sdpa-cudnn": 4.0}

    def fake_ms(fn):
        calls.append(fn())
        return ms[calls[-1]]

    out = bp.rotated_tflops(fns, 8, pairs=10**6, d=128, hq=32, time_ms=fake_ms)
    assert len(calls) == 32
    rounds = [calls[4 * r: 4 * r + 4] for r in range(8)]
    assert all(sorted(r) == sorted(fns) for r in rounds)
    assert sorted(r[0] for r in rounds) == sorted(list(fns) * 2)  # each kernel leads twice in 8 rounds
    assert out["fp8 per_page"] == [pytest.approx(common.tflops(10**6, 128, 32, 1.0))] * 8
    assert out["fp8 per_page"][0] == pytest.approx(2 * out["ours"][0])


def test_rotated_shapes_are_issue_27s_bar_shapes_of_the_table():
    labels = [s[0] for s in bp.SHAPES]
    assert all(s in labels and s in bp.FP8_SHAPES for s in bp.ROTATED_SHAPES)


def test_measure_rotated_rows_hold_medians_and_rounds(monkeypatch):
    monkeypatch.setattr(bp.torch.cuda, "synchronize", lambda: None)
    seq = iter([1.0, 2.0, 4.0, 2.0, 2.0, 2.0])  # a, b, b, a, a, b: the medians' inputs per kernel
    monkeypatch.setattr(bp, "bench_ms", lambda fn, rep_ms=100: next(seq))
    rows = []
    bp.measure_rotated("x", {"a": lambda: None, "b": lambda: None}, 3, 10**6, 128, 32, rows)
    by = {r["impl"]: r for r in rows}
    assert set(by) == {"rotated a", "rotated b"} and all(r["shape"] == "x" for r in rows)
    t = lambda ms: common.tflops(10**6, 128, 32, ms)  # noqa: E731
    assert by["rotated a"]["rounds"] == [t(1.0), t(2.0), t(2.0)] and by["rotated a"]["tflops"] == t(2.0)
    assert by["rotated b"]["rounds"] == [t(2.0), t(4.0), t(2.0)] and by["rotated b"]["tflops"] == t(2.0)
