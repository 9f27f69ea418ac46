"""The prefill cost model and the planner's decisions from a given calibration table (CPU)."""

from __future__ import annotations

import logging
from dataclasses import replace

import numpy as np
import pytest

from atom_backend.catalog import registry
from atom_backend.planning.cost import CostModel, visible_pairs
from atom_backend.planning import ModelFacts, PlannerConfig, Reason, batch_routes, plan

GRID = {"new": [16, 256, 4096], "cached": [0, 4096, 32768]}
FACTS = ModelFacts(64, 8, 64, has_sinks=True)


def table(varlen_rate=100.0, unified_rate=50.0, unified_cached_rate=None, gbps=1000.0, window=0, extra=(),
          launch_us=None, latency_us=None):
    """A synthetic table: kernel times = work / rate (work per us); the unified rate can grow
    with the cached length (it reads pages in place). latency_us: (varlen, unified) functions of
    (n, c) grids giving each request's time alone."""
    shapes = []
    for hq, hk, d, w in ((64, 8, 64, window),) + tuple(extra):
        n, c = np.meshgrid(GRID["new"], GRID["cached"], indexing="ij")
        work = visible_pairs(n, c, w) * hq * d
        ur = unified_rate if unified_cached_rate is None else np.where(c > 0, unified_cached_rate, unified_rate)
        shapes.append({"num_q_heads": hq, "num_kv_heads": hk, "head_dim": d, "window": w,
                       "varlen_us": (work / varlen_rate).tolist(), "unified_us": (work / ur).tolist()})
        if latency_us is not None:
            shapes[-1]["varlen_latency_us"] = np.asarray(latency_us[0](n, c), dtype=float).tolist()
            shapes[-1]["unified_latency_us"] = np.asarray(latency_us[1](n, c), dtype=float).tolist()
    t = {"schema": 1, "arch": "test", "gather": {"16bit": {"gbps": gbps}, "fp8": {"gbps": gbps}},
         "grid": GRID, "shapes": shapes}
    if launch_us is not None:
        t["launch_us"] = {"varlen": launch_us[0], "unified": launch_us[1]}
    return t


def platform(model):
    return registry.platform_for("sm_90a", cost=model, use_tables=False)


def test_visible_pairs_match_brute_force():
    for n, c, w in [(1, 0, 0), (5, 3, 0), (7, 0, 3), (10, 20, 4), (3, 1, 8), (100, 50, 128)]:
        brute = sum(min(c + i + 1, w) if w else c + i + 1 for i in range(n))
        assert visible_pairs(n, c, w) == brute, (n, c, w)


def test_explain_is_the_documented_formula():
    m = CostModel(table(varlen_rate=100.0, unified_rate=50.0, gbps=1000.0))
    n, c = 256, 4096
    e = m.explain(FACTS, [n], [c])
    work = visible_pairs(n, c, 0) * 64 * 64
    gather = (n + c) * (FACTS.kv_bytes_per_token + FACTS.gathered_bytes_per_token) / (1000.0 * 1e3)
    assert e["gather_us"][0] == pytest.approx(gather)
    assert e["varlen_us"][0] == pytest.approx(gather + work / 100.0, rel=1e-9)
    assert e["unified_us"][0] == pytest.approx(work / 50.0, rel=1e-9)


def test_grid_predictions_are_close_to_exact():
    m = CostModel(table(unified_cached_rate=150.0))
    rng = np.random.default_rng(0)
    n = rng.integers(2, 20000, 200)
    c = rng.integers(0, 40000, 200)
    tv, tu = m.predict(FACTS, n, c)
    e = m.explain(FACTS, n, c)
    np.testing.assert_allclose(tv, e["varlen_us"], rtol=0.12)
    np.testing.assert_allclose(tu, e["unified_us"], rtol=0.12)


def test_faster_varlen_kernel_takes_fresh_prefills_and_a_huge_prefix_goes_unified():
    # varlen kernel 2x the unified rate on fresh prefills, unified 3x faster over a cached
    # prefix (and the gather to pay): fresh -> varlen, big prefix -> unified, by cost
    m = CostModel(table(varlen_rate=100.0, unified_rate=50.0, unified_cached_rate=300.0))
    p = plan([1, 4096, 64, 0], [500, 0, 30000, 3], FACTS, platform(m), PlannerConfig())
    assert p.route_of(0) == ("decode", "splitkv", "preferred")
    assert p.route_of(1) == ("prefill", "varlen", "cost")
    assert p.route_of(2) == ("prefill", "unified", "cost")
    assert p.route_of(3) == ("empty", "-", "-")
    assert p.varlen_reason == Reason.COST and p.unified_reasons == (Reason.COST,)
    tv1, tu1 = p.predicted(1)
    tv2, tu2 = p.predicted(2)
    assert tv1 < tu1 and tv2 > tu2 and p.predicted(0) is None
    assert p.gather_tokens == 4096 and p.varlen_tokens == 4096 and p.unified_tokens == 64


def test_slow_gather_sends_prefix_hits_unified():
    # H100-like kernel rates (work per us = FLOP/s / 4 / 1e6), the gather decides
    fast = CostModel(table(varlen_rate=1e7, unified_rate=0.9e7, gbps=3000.0))
    slow = CostModel(table(varlen_rate=1e7, unified_rate=0.9e7, gbps=10.0))
    new, cached = [512], [8192]
    assert len(plan(new, cached, FACTS, platform(fast), PlannerConfig()).varlen) == 1
    assert len(plan(new, cached, FACTS, platform(slow), PlannerConfig()).unified) == 1


def test_forcing_and_disabling_still_win_over_cost():
    m = CostModel(table(varlen_rate=10.0, unified_rate=100.0))  # unified always cheaper
    pl = platform(m)
    assert plan([4096], [0], FACTS, pl, PlannerConfig(force_path="varlen")).route_of(0) == ("prefill", "varlen", "preferred")
    assert plan([4096], [0], FACTS, pl, PlannerConfig(force_path="unified")).route_of(0)[2] == "forced_by_config"
    assert plan([4096], [0], FACTS, pl, PlannerConfig(disable_varlen=True)).route_of(0)[2] == "varlen_disabled"
    # no cost routing (ATOM_COST_ROUTING=0) and no table: the threshold rules
    for cfg, plat in ((PlannerConfig(cost_routing=False), pl), (PlannerConfig(), platform(None))):
        p = plan([4096, 4, 16], [0, 10, 16 * 64 + 1], FACTS, plat, cfg)
        assert [p.route_of(i)[1:] for i in range(3)] == [("varlen", "preferred"), ("unified", "small_prefill"),
                                                         ("unified", "gather_cost")]
    assert PlannerConfig.from_env({"ATOM_COST_ROUTING": "0"}).cost_routing is False


def test_batch_routes_counts_each_used_paths_launch_once():
    tv = np.array([100.0, 10.0, 12.0])
    tu = np.array([300.0, 8.0, 11.0])
    # without launch costs: each request on its cheaper path
    assert batch_routes(tv, tu, (0.0, 0.0)).tolist() == [True, False, False]
    # a second path saving 3 us but launching for 20 us: everything on varlen
    assert batch_routes(tv, tu, (20.0, 20.0)).tolist() == [True, True, True]
    # a big saving pays for the second launch
    tu2 = np.array([300.0, 8.0, 1.0])
    assert batch_routes(tv, tu2, (5.0, 5.0)).tolist() == [True, False, False]
    # all unified when varlen's launch is dear and its one win small
    tv3, tu3 = np.array([10.0, 50.0]), np.array([11.0, 20.0])
    assert batch_routes(tv3, tu3, (30.0, 5.0)).tolist() == [False, False]
    # one path cheaper for every request: that path, whatever the launch costs
    assert batch_routes(tv, tv + 1, (1e6, 0.0)).tolist() == [True, True, True]


def test_batch_routes_takes_a_paths_longest_request_alone():
    tv, tu = np.array([60.0, 88.0, 37.0]), np.array([67.0, 48.0, 39.0])
    launch = (27.0, 40.0)
    # marginal costs alone: all unified (154 + 40 < 185 + 27)
    assert batch_routes(tv, tu, launch).tolist() == [False, False, False]
    # the second request alone takes 270 us on unified (it cannot fill the GPU): all varlen
    lat = (np.array([30.0, 90.0, 20.0]), np.array([40.0, 270.0, 30.0]))
    assert batch_routes(tv, tu, launch, lat).tolist() == [True, True, True]
    # latencies under the sums change nothing
    small = (np.array([1.0, 1.0, 1.0]), np.array([1.0, 1.0, 1.0]))
    assert batch_routes(tv, tu, launch, small).tolist() == [False, False, False]
    # every request cheaper on one path, but that path's longest request alone is dearer than the other path
    assert batch_routes(tv, tv + 1, (0.0, 0.0), (np.array([500.0, 1, 1]), np.array([1.0, 1, 1]))).tolist() == [
        False, False, False]


def test_latency_grids_reach_the_planner():
    """A table with latency grids: the model predicts each request alone, and a long cached
    prefix with few new tokens stops pulling a batch onto the unified path."""
    args = dict(varlen_rate=100.0, unified_rate=50.0, unified_cached_rate=400.0)
    lat = (lambda n, c: 5.0 + 0 * n, lambda n, c: np.where(c >= 4096, 1e12, 5.0) + 0 * n)
    m = CostModel(table(**args, latency_us=lat))
    assert m.has_latency and not CostModel(table(**args)).has_latency
    assert CostModel(table(**args)).predict_with_latency(FACTS, np.array([16]), np.array([0]))[2] is None
    tv, tu, (lv, lu) = m.predict_with_latency(FACTS, np.array([16, 256]), np.array([0, 32768]))
    assert np.array_equal(np.stack([tv, tu]), np.stack(m.predict(FACTS, np.array([16, 256]), np.array([0, 32768]))))
    assert lu[1] == pytest.approx(1e12, rel=0.01) and lv[1] == pytest.approx(5.0 + m.explain(FACTS, 256, 32768)[
        "gather_us"][0], rel=0.01)
    new, cached = [256], [32768]
    assert plan(new, cached, FACTS, platform(CostModel(table(**args))), PlannerConfig()).unified.tolist() == [0]
    assert plan(new, cached, FACTS, platform(m), PlannerConfig()).varlen.tolist() == [0]


def test_planner_keeps_a_small_prefix_hit_with_a_big_prefill_when_a_second_launch_costs_more():
    # unified 3x faster over a cached prefix: a small prefix hit alone would go unified
    args = dict(varlen_rate=100.0, unified_rate=50.0, unified_cached_rate=300.0)
    new, cached = [4096, 16], [0, 64]
    e = CostModel(table(**args)).explain(FACTS, new, cached)
    saving = e["varlen_us"][1] - e["unified_us"][1]
    assert saving > 0
    cheap = plan(new, cached, FACTS, platform(CostModel(table(**args, launch_us=(0.1 * saving, 0.1 * saving)))),
                 PlannerConfig())
    dear = plan(new, cached, FACTS, platform(CostModel(table(**args, launch_us=(10 * saving, 10 * saving)))),
                PlannerConfig())
    assert cheap.varlen.tolist() == [0] and cheap.unified.tolist() == [1]
    assert dear.varlen.tolist() == [0, 1] and dear.unified.tolist() == []
    assert dear.varlen_reason == Reason.COST and dear.predicted(1) == pytest.approx(cheap.predicted(1))


def test_unsupported_model_keeps_its_reason_with_a_table():
    m = CostModel(table())
    p = plan([512], [0], ModelFacts(32, 8, 80), platform(m), PlannerConfig())
    assert p.route_of(0) == ("prefill", "unified", "unsupported_head_dim") and p.predictions is None


def test_layer_windows_average_full_and_windowed_layers():
    m = CostModel(table(extra=((64, 8, 64, 128),)))
    full = m.explain(FACTS, [4096], [4096])
    win = m.explain(replace(FACTS, window=128), [4096], [4096])
    mixed = m.explain(replace(FACTS, layer_windows=(0, 128)), [4096], [4096])
    for k in ("unified_us", "varlen_us"):
        # every layer gathers the whole sequence; the kernel part is the per-layer average
        assert mixed[k][0] == pytest.approx((full[k][0] + win[k][0]) / 2, rel=1e-6)
    assert m.shape_for(FACTS, 128).window == 128 and m.shape_for(FACTS, 0).window == 0


def test_table_validation_of_latency_grids():
    t = table(latency_us=(lambda n, c: 1.0 + 0 * n, lambda n, c: 0.0 * n))
    with pytest.raises(ValueError, match="unified_latency_us"):
        CostModel(t)


def test_table_validation():
    bad = table()
    bad["schema"] = 2
    with pytest.raises(ValueError, match="schema"):
        CostModel(bad)
    bad = table()
    bad["shapes"][0]["varlen_us"][0][0] = 0.0
    with pytest.raises(ValueError, match="positive"):
        CostModel(bad)
    with pytest.raises(ValueError, match="launch_us"):
        CostModel(table(launch_us=(-1.0, 2.0)))
    assert CostModel(table()).launch_us == (0.0, 0.0)
    bad = table()
    bad["grid"] = {"new": [16], "cached": [0, 1]}
    with pytest.raises((ValueError, KeyError)):
        CostModel(bad)


def test_debug_log_records_both_predictions(caplog):
    pytest.importorskip("vllm")
    import torch

    from tests.test_impl_cpu import Case, _builder

    case = Case([300, 1], [5000, 40], seed=2)
    b = _builder(case.facts())
    b.platform = replace(b.platform, cost=CostModel(table(varlen_rate=100.0, unified_rate=50.0,
                                                          unified_cached_rate=300.0)))
    with caplog.at_level(logging.DEBUG, logger="atom_backend"):
        md = b.build(0, case.common())
    assert md.plan.route_of(0) == ("prefill", "unified", "cost")
    msg = [r.getMessage() for r in caplog.records if "reason: cost" in r.getMessage()]
    assert msg and "request 0 (new=300, cached=5000) -> unified" in msg[0]
    assert "varlen" in msg[0] and "unified" in msg[0] and " us" in msg[0]
    del torch


@pytest.mark.parametrize("entry, allowed", [(None, True), ({"balanced": True}, True), ({"balanced": False}, False)])
def test_a_devices_decode_entry_says_whether_balanced_slices_are_used(entry, allowed):
    """bench.calibrate's "decode" entry: balanced: false (slower on the device measured) keeps the
    split kernel on fixed ranges; true or no entry leaves the kernel's own rule."""
    t = table()
    if entry is not None:
        t["decode"] = {**entry, "ratio": 1.0, "rows": []}
    p = platform(CostModel(t))
    assert p.decode_balanced is allowed
    assert registry.platform_for("sm_90a", use_tables=False).decode_balanced is True
    with pytest.raises(ValueError, match="decode.balanced"):
        CostModel({**table(), "decode": {"balanced": "sometimes"}})


def decode_entry(unified_faster_from_ctx=None, batch=(1, 8, 64), ctx=(4096, 32768, 131072), hk=8):
    """A decode grid where the Triton path takes 0.8x the split kernel's time from that context on
    (never: None), 1.2x below it."""
    ts = [[10.0 * b * c / 4096 for c in ctx] for b in batch]
    tu = [[t * (0.8 if unified_faster_from_ctx and c >= unified_faster_from_ctx else 1.2) for t, c in zip(row, ctx)]
          for row in ts]
    return {"grid": {"batch": list(batch), "ctx": list(ctx)},
            "shapes": [{"num_q_heads": 8 * hk, "num_kv_heads": hk, "head_dim": 64, "window": 0,
                        "splitkv_us": ts, "unified_us": tu}]}


@pytest.mark.parametrize("ctx, want", [(4096, "splitkv"), (32768, "splitkv"), (131072, "unified"), (500000, "unified")])
def test_decode_goes_to_the_path_measured_faster_on_the_device(ctx, want):
    """With a decode grid the planner sends a decode batch to the Triton path where it was
    measured faster (reason cost), else to the split kernel (preferred); without one, always
    the split kernel."""
    p = platform(CostModel({**table(), "decode": decode_entry(unified_faster_from_ctx=131072)}))
    plan_ = plan([1] * 4, [ctx - 1] * 4, FACTS, p, PlannerConfig())
    assert plan_.decode_path.value == want
    assert plan_.decode_reason == (Reason.COST if want == "unified" else Reason.PREFERRED)
    assert plan([1] * 4, [ctx - 1] * 4, FACTS, platform(CostModel(table())), PlannerConfig()).decode_path.value == "splitkv"
    assert plan([1] * 4, [ctx - 1] * 4, FACTS, p, PlannerConfig(cost_routing=False)).decode_path.value == "splitkv"


def test_decode_grid_is_interpolated_and_checked():
    from atom_backend.planning.decode_cost import DecodeCost

    d = DecodeCost(decode_entry())
    ts, tu = d.predict(FACTS, 8, 32768)
    assert ts == pytest.approx(10.0 * 8 * 8) and tu == pytest.approx(1.2 * ts)
    ts_mid, _ = d.predict(FACTS, 8, 65536)  # halfway in log space between 32k and 128k: the geometric mean
    assert ts_mid == pytest.approx(10.0 * 8 * 8 * 2 ** 1.0, rel=1e-6)
    assert d.predict(FACTS, 1000, 10**7)[0] == pytest.approx(10.0 * 64 * 32)  # the edge holds outside
    routed = DecodeCost(decode_entry(unified_faster_from_ctx=131072))
    for b, c in ((1, 4096), (8, 65536), (64, 131072), (3, 200000), (100, 1000)):  # the bound lookup = the prediction
        ts, tu = routed.predict(FACTS, b, c)
        assert routed.unified_faster(FACTS, b, c) == (tu < 0.95 * ts), (b, c)
    bad = decode_entry()
    bad["shapes"][0]["unified_us"][0][0] = 0.0
    with pytest.raises(ValueError, match="unified_us must be positive"):
        DecodeCost(bad)
    with pytest.raises(ValueError, match="increasing"):
        DecodeCost({**decode_entry(), "grid": {"batch": [8, 1], "ctx": [4096, 8192]}})


def test_a_measured_stream_rate_sets_the_decode_fill_target():
    """H200-like: copy 4219 GB/s, one 16-bit CTA streams 29.7 GB/s, so 138 CTAs (97% of the copy
    rate) are the fill target: 8 x 32k takes 3 splits (192 CTAs), 1 x 128k 18; FP8 at 13 GB/s a
    CTA wants 315. Without the measurement the per-SM fill holds (one 16-bit CTA per SM)."""
    from atom_backend.planning import decode_split_rule

    t = {**table(), "decode": {"copy_gbps": 4219.0, "cta_gbps": {"16bit": 29.7, "fp8": 13.0}}}
    p = platform(CostModel(t))
    assert (p.decode_fill_ctas, p.decode_fill_ctas_fp8) == (138, 315)
    llama = ModelFacts(32, 8, 128)
    assert decode_split_rule(8, llama, p, PlannerConfig()).fill == 3
    assert decode_split_rule(1, llama, p, PlannerConfig()).fill == 18
    assert decode_split_rule(8, llama, platform(CostModel(table())), PlannerConfig()).fill == 2  # (132 - 1) // 64
    with pytest.raises(ValueError, match="positive"):
        CostModel({**table(), "decode": {"copy_gbps": 4219.0, "cta_gbps": {"16bit": 0}}})
