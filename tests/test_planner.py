"""The planner's routing table: every request's phase, path and reason, from shapes alone."""

from __future__ import annotations

from dataclasses import replace
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from atom_backend.planning import planner as planner_module
from atom_backend.planning import (ModelFacts, Path, Plan, PlanError, PlannerConfig, Platform, Reason,
                                   SplitRule, decode_split_rule, decode_splits, fills_last_wave,
                                   plan, request_split_tokens, request_splits, whole_wave_splits)
from atom_backend.catalog import platform_for

GPT_OSS = ModelFacts(64, 8, 64, has_sinks=True, window=128)
LLAMA = ModelFacts(32, 8, 128)
H100 = platform_for("sm_90a", use_tables=False)
DEFAULT = PlannerConfig()


def routes(p: Plan, n: int) -> list[tuple[str, str, str]]:
    return [p.route_of(i) for i in range(n)]


# (name, new tokens, cached tokens, facts, config, expected (phase, path, reason) per request)
TABLE = [
    ("decode_only", [1, 1, 1], [100, 4000, 0], GPT_OSS, DEFAULT,
     [("decode", "splitkv", "preferred")] * 3),
    ("fresh_prefill", [4096], [0], LLAMA, DEFAULT, [("prefill", "varlen", "preferred")]),
    ("prefix_hit_with_sinks", [512], [4096], GPT_OSS, DEFAULT, [("prefill", "varlen", "preferred")]),
    ("mixed", [1, 2048, 1, 300, 0], [900, 0, 50, 1200, 7], GPT_OSS, DEFAULT,
     [("decode", "splitkv", "preferred"), ("prefill", "varlen", "preferred"),
      ("decode", "splitkv", "preferred"), ("prefill", "varlen", "preferred"), ("empty", "-", "-")]),
    ("small_prefill", [4], [100], LLAMA, DEFAULT, [("prefill", "unified", "small_prefill")]),
    ("gather_cost", [16], [16 * 64 + 1], LLAMA, DEFAULT, [("prefill", "unified", "gather_cost")]),
    ("gather_ratio_edge", [16], [16 * 64], LLAMA, DEFAULT, [("prefill", "varlen", "preferred")]),
    ("head_dim_80", [1, 256], [30, 0], ModelFacts(32, 8, 80), DEFAULT,
     [("decode", "unified", "unsupported_head_dim"), ("prefill", "unified", "unsupported_head_dim")]),
    ("forced_unified", [1024], [0], LLAMA, PlannerConfig(force_path="unified"), [("prefill", "unified", "forced_by_config")]),
    ("forced_varlen_beats_cost", [4], [100000], LLAMA, PlannerConfig(force_path="varlen"), [("prefill", "varlen", "preferred")]),
    ("varlen_disabled", [1024], [0], LLAMA, PlannerConfig(disable_varlen=True), [("prefill", "unified", "varlen_disabled")]),
    ("spec_decode", [3, 9], [100, 100], LLAMA, PlannerConfig(decode_max_query_tokens=4),
     [("decode", "splitkv", "preferred"), ("prefill", "varlen", "preferred")]),
    ("fp32_queries", [64], [0], ModelFacts(8, 8, 64, dtype="fp32"), DEFAULT, [("prefill", "unified", "unsupported_dtype")]),
    ("fp8_kv_prefix_hit", [128], [1024], ModelFacts(32, 8, 128, kv_dtype="fp8_e4m3", kv_scale_mode="per_page"), DEFAULT,
     [("prefill", "varlen", "preferred")]),
    ("fp8_fnuz_decode_on_nvidia", [1], [10], ModelFacts(32, 8, 128, kv_dtype="fp8_e4m3fnuz", kv_scale_mode="per_tensor"), DEFAULT,
     [("decode", "unified", "unsupported_kv_format")]),
]


@pytest.mark.parametrize("name,new,cached,facts,config,expected", TABLE, ids=[t[0] for t in TABLE])
def test_routing_table(name, new, cached, facts, config, expected):
    p = plan(new, cached, facts, H100, config)
    assert routes(p, len(new)) == expected


def test_missing_kernels_route_with_kernel_unavailable():
    no_kernels = replace(H100, varlen_kernel=False, splitkv_kernel=False)
    p = plan([1, 500], [10, 0], LLAMA, no_kernels, DEFAULT)
    assert routes(p, 2) == [("decode", "unified", "kernel_unavailable"), ("prefill", "unified", "kernel_unavailable")]


def test_gather_bytes_are_exact():
    # varlen requests: (300 new + 1200 cached) and (2048 + 0); K and V, 8 kv heads x 64 x bf16
    p = plan([1, 2048, 300, 4], [900, 0, 1200, 100], GPT_OSS, H100, DEFAULT)
    assert p.gather_tokens == 1500 + 2048
    assert p.gather_bytes == (1500 + 2048) * 2 * 8 * 64 * 2
    assert (p.decode_tokens, p.varlen_tokens, p.unified_tokens) == (1, 2348, 4)
    fp8 = ModelFacts(64, 8, 64, kv_dtype="fp8_e4m3", kv_scale_mode="per_tensor")
    # the packed tensor holds dequantised (query dtype) values, whatever the cache stores
    assert plan([100], [0], fp8, H100, DEFAULT).gather_bytes == 100 * 2 * 8 * 64 * 2


def test_fp8_compute_gather_bytes_are_the_packs():
    """FP8 compute: e4m3 bytes, each request padded to 128 keys (the pad is written), per-page
    scales (K's and V's per key, V's largest per 128) on top: what gather_kv_fp8 allocates."""
    from hip_kernels.gather import FP8_ALIGN

    assert planner_module.FP8_PACK_ALIGN == FP8_ALIGN
    force = replace(DEFAULT, force_path="varlen")
    for mode, scale_bytes in (("per_tensor", 0), ("per_page", 4 * 8 * (2 * 384 + 3))):
        facts = ModelFacts(32, 8, 128, kv_dtype="fp8_e4m3", kv_scale_mode=mode)
        p = plan([9, 200], [0, 0], facts, H100, force)
        assert p.varlen_fp8 and p.gather_tokens == 209
        assert p.gather_bytes == (128 + 256) * 2 * 8 * 128 + scale_bytes


def test_unified_requests_are_never_gathered():
    p = plan([16, 2000], [5000, 0], LLAMA, H100, DEFAULT)
    assert p.unified.tolist() == [0] and p.varlen.tolist() == [1]
    assert p.gather_tokens == 2000


@pytest.mark.parametrize(
    "num_decodes,context,expected",
    [
        (1, 131072, 32),  # 8 CTAs a split: one per 4096 keys, 256 of the 264 resident
        (1, 1000, 15),  # at least 64 keys per split at one request
        (8, 32768, 4),  # 256 CTAs
        (64, 4096, 1),
        (0, 0, 1),
        (1, 10**7, 32),  # 256 of the 264 resident CTAs: the fewest that fill 95% of the wave
    ],
)
def test_decode_split_counts(num_decodes, context, expected):
    p = plan([1] * num_decodes, [context - 1] * num_decodes, LLAMA, H100, DEFAULT)
    assert p.num_splits == expected


def test_window_limits_split_count():
    windowed = ModelFacts(32, 8, 128, window=128, sink_tokens=4)
    # the split kernels divide the window's 128 keys (the 4 sink tokens go with split 0): 2 of 64
    assert plan([1], [100000], windowed, H100, DEFAULT).num_splits == 2
    assert plan([1], [100000], replace(windowed, window=127), H100, DEFAULT).num_splits == 1
    # a split count the device keeps for every request of the batch (eager batches of one length)
    for win, sink in ((127, 1), (128, 4), (1000, 16), (4096, 0)):
        facts = ModelFacts(32, 8, 128, window=win, sink_tokens=sink)
        for n in (1, 3, 16):
            rule = decode_split_rule(n, facts, H100, DEFAULT)
            for ctx in (win - 1, win, win + sink, 10 * win):
                s = decode_splits(n, ctx, facts, H100, DEFAULT)
                assert request_splits(min(ctx, win), s, rule) == s
    wide = ModelFacts(32, 8, 128, window=4096)
    assert plan([1], [100000], wide, H100, DEFAULT).num_splits == 16


def test_split_count_respects_cap():
    p = plan([1], [10**6], LLAMA, replace(H100, num_sms=1000), PlannerConfig(max_splits=16))
    assert p.num_splits == 16


def test_env_overrides_and_bad_values():
    c = PlannerConfig.from_env({"ATOM_FORCE_PATH": "Unified", "ATOM_DISABLE_VARLEN": "1", "ATOM_MAX_SPLITS": "8",
                                "ATOM_DECODE_MAX_QUERY_TOKENS": "4", "ATOM_VARLEN_MIN_NEW_TOKENS": "32",
                                "ATOM_MAX_GATHER_RATIO": "16", "ATOM_MIN_SPLIT_TOKENS": "512", "ATOM_LONG_SPLIT_TOKENS": "2048",
                                "ATOM_DECODE_WAVE_FILL": "90"})
    assert (c.force_path, c.disable_varlen, c.max_splits, c.decode_max_query_tokens) == ("unified", True, 8, 4)
    assert (c.varlen_min_new_tokens, c.max_gather_ratio, c.min_split_tokens, c.long_split_tokens) == (32, 16, 512, 2048)
    assert c.wave_fill == 90
    assert PlannerConfig.from_env({}) == PlannerConfig()
    assert PlannerConfig.from_env({"ATOM_DETERMINISTIC_DECODE": "1"}).deterministic_decode
    assert not PlannerConfig().deterministic_decode
    assert PlannerConfig.from_env({"ATOM_COST_ROUTING": "Off", "ATOM_DISABLE_VARLEN": "no"}) == PlannerConfig(
        cost_routing=False)
    with pytest.raises(PlanError, match="ATOM_DETERMINISTIC_DECODE"):
        PlannerConfig.from_env({"ATOM_DETERMINISTIC_DECODE": "sometimes"})
    for name in ("ATOM_LONG_SPLIT_TOKENS", "ATOM_MIN_SPLIT_TOKENS"):
        with pytest.raises(PlanError, match=name):
            PlannerConfig.from_env({name: "0"})
    with pytest.raises(PlanError, match="ATOM_MAX_SPLITS"):
        PlannerConfig.from_env({"ATOM_MAX_SPLITS": "-1"})
    with pytest.raises(PlanError, match="ATOM_FORCE_PATH"):
        PlannerConfig.from_env({"ATOM_FORCE_PATH": "fast"})
    with pytest.raises(PlanError, match="not an integer"):
        PlannerConfig.from_env({"ATOM_MAX_SPLITS": "lots"})
    with pytest.raises(PlanError, match="1..8"):
        PlannerConfig(decode_max_query_tokens=9)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"head_dim": 512}, "head dim 512"),
        ({"head_dim": 81}, "head dim 81"),
        ({"num_q_heads": 6, "num_kv_heads": 4}, "multiple"),
        ({"dtype": "fp64"}, "query dtype"),
        ({"kv_dtype": "int4"}, "kv dtype"),
        ({"kv_dtype": "fp8_e4m3"}, "needs a scale"),
        ({"page_size": 2048}, "page size"),
        ({"page_size": 0}, "page size"),
    ],
)
def test_unservable_models_fail_at_plan_time(kwargs, match):
    base = dict(num_q_heads=8, num_kv_heads=8, head_dim=64)
    base.update(kwargs)
    with pytest.raises(PlanError, match=match):
        ModelFacts(**base)


def test_bad_batches_fail_at_plan_time():
    with pytest.raises(PlanError, match=">= 0"):
        plan([5, -1], [0, 0], LLAMA, H100, DEFAULT)
    with pytest.raises(PlanError, match="alike"):
        plan([5, 1], [0], LLAMA, H100, DEFAULT)


def test_empty_batch():
    p = plan([], [], LLAMA, H100, DEFAULT)
    assert len(p.decode) == len(p.varlen) == len(p.unified) == 0 and p.gather_bytes == 0 and p.num_splits == 1


@settings(max_examples=200, deadline=None)
@given(
    reqs=st.lists(st.tuples(st.integers(0, 5000), st.integers(0, 100000)), max_size=64),
    force=st.sampled_from(["", "varlen", "unified"]),
    facts=st.sampled_from([GPT_OSS, LLAMA, ModelFacts(16, 2, 96)]),
)
def test_every_request_routed_once_and_deterministically(reqs, force, facts):
    new = [r[0] for r in reqs]
    cached = [r[1] for r in reqs]
    config = PlannerConfig(force_path=force)
    p = plan(new, cached, facts, H100, config)
    parts = np.concatenate([p.decode, p.varlen, p.unified, p.empty])
    assert sorted(parts.tolist()) == list(range(len(reqs)))
    assert len(p.unified_reasons) == len(p.unified)
    q = plan(np.array(new, dtype=np.int64), np.array(cached, dtype=np.int64), facts, H100, config)
    assert routes(p, len(reqs)) == routes(q, len(reqs))
    assert p.gather_bytes == sum(new[i] + cached[i] for i in p.varlen.tolist()) * facts.gathered_bytes_per_token
    assert all(r != Reason.PREFERRED for r in p.unified_reasons)
    if force == "unified":
        assert len(p.varlen) == 0
    assert p.decode_path in (Path.SPLITKV, Path.UNIFIED)


# H100 (132 SMs, 8 kv heads), times from `bench.decode_profile split_grid` (docs/perf/decode.md,
# 2026-11-24, "split counts from a sweep").
@pytest.mark.parametrize("batch, ctx, kv, want", [
    (64, 4096, "bf16", 1),        # 512 CTAs: more than one per SM already
    (8, 32768, "bf16", 4),        # fill 2 (128 CTAs) would hold 16k keys each: one wave of 256, 369.5 us
    (24, 20000, "bf16", 4),       # 192 CTAs at one split: 768 (2.9 waves) 659.9 us vs 708.7
    (12, 60000, "bf16", 8),       # 975.4 us vs 1051.1 at 2
    (96, 7000, "fp8_e4m3", 2),    # 768 CTAs are 1.45 waves of 528: 511.8 us at 2 vs 596.6 at 1
    (1, 131072, "bf16", 32),      # 196.6 us at 32 (256 CTAs) vs 197.8 at 16
    (1, 8192, "bf16", 16),        # one CTA per SM: 27.9 us vs 29.9 at 32 splits
    (16, 512, "bf16", 1),         # 128 CTAs, one split: 25.1 us vs 27.8 at 2
    (1, 512, "bf16", 8),          # >= 64 keys per split at one request: 12.7 us vs 16.4 at 2
    (1, 100, "bf16", 1),          # too short to split
    (64, 4096, "fp8_e4m3", 1),    # 2-warp FP8 CTAs, 4 per SM: 512 CTAs on 528 slots
    (8, 32768, "fp8_e4m3", 8),    # 205.5 us at 8 splits
    (1, 131072, "fp8_e4m3", 64),  # 512 of 528 slots: 115.1 us vs 117.3 at 63
    (1, 2048, "fp8_e4m3", 32),    # 16.3 us vs 20.9 at 8
])
def test_decode_splits_fill_the_sms(batch, ctx, kv, want):
    fp8 = kv.startswith("fp8")
    facts = ModelFacts(num_q_heads=32, num_kv_heads=8, head_dim=128, kv_dtype=kv,
                       kv_scale_mode="per_tensor" if fp8 else "none")
    platform = Platform(num_sms=132)
    s = decode_splits(batch, ctx, facts, platform, PlannerConfig())
    assert s == want
    resident = platform.decode_ctas_per_sm_fp8 if fp8 else platform.decode_ctas_per_sm
    waves = batch * 8 * s / (132 * resident)
    assert waves <= 1 or waves / math.ceil(waves) >= 0.95  # one wave, or whole ones


@pytest.mark.parametrize("hk, kv, want", [
    (8, "bf16", 32),       # whole-model Llama: as above
    (1, "bf16", 131),      # 8 / 1 (TP 8): the fill target, one CTA per SM, past the 64 of 8 kv heads
    (2, "bf16", 126),      # 16 / 2 (TP 4): 65 fill-target splits of 2k keys grow to a whole wave (252 of 264)
    (1, "fp8_e4m3", 512),  # FP8: four CTAs per SM, up to 512 CTAs a request
])
def test_one_kv_head_takes_more_splits(hk, kv, want):
    """A rank with few kv heads has few CTAs per split: the split bound is 512 CTAs a request, not
    64 splits, so one long request still fills the SMs (1 x 128k)."""
    fp8 = kv.startswith("fp8")
    facts = ModelFacts(num_q_heads=8 * hk, num_kv_heads=hk, head_dim=128, kv_dtype=kv,
                       kv_scale_mode="per_tensor" if fp8 else "none")
    assert decode_splits(1, 131072, facts, Platform(num_sms=132), PlannerConfig()) == want
    assert decode_splits(1, 131072, facts, Platform(num_sms=132), PlannerConfig(max_splits=16)) == 16


def test_request_split_tokens_grow_with_the_batch_up_to_min_split_tokens():
    got = [request_split_tokens(n, PlannerConfig()) for n in (0, 1, 3, 4, 15, 16, 512)]
    assert got == [64, 64, 64, 128, 192, 256, 256]
    assert request_split_tokens(1, PlannerConfig(min_split_tokens=32)) == 32  # the setting caps it


def test_request_splits_matches_its_definition():
    """The docstring's steps, written out plainly, over every small rule."""
    def plain(keys, S, m, fill, long_, ctas, slots, wf):
        cap = max(1, min(S, keys // m) if m else S)
        if not fill:
            return cap
        f = min(fill, cap)
        if not (long_ and ctas and slots):
            return f
        if (keys <= f * long_ and ctas * f <= slots) or fills_last_wave(ctas * f, slots, wf):
            return f
        for s in range(1, min(cap, max(f, keys // long_)) + 1):
            if fills_last_wave(ctas * s, slots, wf):
                return s
        return f
    for keys in (0, 1, 63, 64, 100, 1000, 4095, 4096, 20000, 131072):
        for S in (1, 7, 32):
            for m in (0, 64):
                for fill in (0, 1, 3, 16):
                    for long_ in (0, 1024):
                        for ctas, slots in ((0, 0), (8, 264), (96, 264), (768, 528), (3, 8)):
                            for wf in (50, 95):
                                rule = SplitRule(m, fill, long_, ctas, slots, wf)
                                assert request_splits(keys, S, rule) == plain(keys, S, *rule), (keys, S, rule)
    assert request_splits(131072, 64, SplitRule()) == 64 and request_splits(10, 64, SplitRule(64)) == 1
    bf16_1 = SplitRule(64, 16, 1024, 8, 264, 95)  # one bf16 request on H100
    assert [request_splits(k, 64, bf16_1) for k in (512, 8192, 20000, 32768, 131072)] == [8, 16, 16, 32, 32]


def test_a_graphs_requests_get_the_eager_planners_splits():
    """Eager batches of one length: every request uses all of the planner's S (the rule never
    takes splits the planner chose away). A graph's grid sized for 128k: each request uses what
    the eager planner gives a batch of its length."""
    for kv in ("bf16", "fp8_e4m3"):
        facts = ModelFacts(num_q_heads=32, num_kv_heads=8, head_dim=128, kv_dtype=kv,
                           kv_scale_mode="per_tensor" if kv != "bf16" else "none")
        for n in (1, 2, 3, 5, 8, 12, 16, 48, 64, 96):
            rule = decode_split_rule(n, facts, H100, PlannerConfig())
            grid = decode_splits(n, 131072, facts, H100, PlannerConfig())
            for ctx in (1, 300, 512, 2048, 8192, 20000, 32768, 131072):
                eager = decode_splits(n, ctx, facts, H100, PlannerConfig())
                assert request_splits(ctx, eager, rule) == eager, (kv, n, ctx)
                assert request_splits(ctx, grid, rule) == eager, (kv, n, ctx)


def test_decode_splits_count_fp8_ctas_per_sm():
    """The same batch gets more splits with FP8 KV: its CTAs are half as wide, and one alone does
    not stream at the GPU's speed, so they fill every resident slot."""
    bf16 = ModelFacts(num_q_heads=32, num_kv_heads=8, head_dim=128)
    fp8 = replace(bf16, kv_dtype="fp8_e4m3", kv_scale_mode="per_page")
    platform = Platform(num_sms=132)
    assert (platform.decode_ctas_per_sm, platform.decode_ctas_per_sm_fp8) == (2, 4)
    assert (platform.decode_fill_per_sm, platform.decode_fill_per_sm_fp8) == (1, 4)
    assert decode_splits(2, 65536, fp8, platform, PlannerConfig()) == 32  # 512 CTAs (528 slots)
    assert decode_splits(2, 65536, bf16, platform, PlannerConfig()) == 16  # 256


def test_whole_wave_splits_matches_the_definition():
    """The closed form against a plain search over s = 1..cap (0: none fills its last wave)."""
    def search(ctas, slots, cap, fill):
        for s in range(1, cap + 1):
            if fills_last_wave(ctas * s, slots, fill):
                return s
        return 0
    for ctas in range(1, 600, 5):
        for slots in (132, 264, 304):
            for cap in (1, 7, 32):
                for fill in (50, 95, 100):
                    assert whole_wave_splits(ctas, slots, cap, fill) == search(ctas, slots, cap, fill)


def test_removed_target_waves_setting_is_an_error():
    with pytest.raises(PlanError, match="ATOM_DECODE_WAVE_FILL"):
        PlannerConfig.from_env({"ATOM_TARGET_WAVES": "2"})


# -- FP8 compute (docs/fp8.md) ------------------------------------------------------------------

FP8_LLAMA = ModelFacts(32, 8, 128, kv_dtype="fp8_e4m3", kv_scale_mode="per_tensor")


@pytest.mark.parametrize("facts, platform, config, fp8, reason", [
    (FP8_LLAMA, H100, DEFAULT, True, "preferred"),
    (replace(FP8_LLAMA, kv_scale_mode="per_page"), H100, DEFAULT, True, "preferred"),
    (replace(FP8_LLAMA, kv_scale_mode="per_page", page_size=1024, softcap=30.0), H100, DEFAULT, True, "preferred"),
    # a scale per key (pages of no multiple of 16 keys): slower than dequantize + 16-bit
    (replace(FP8_LLAMA, kv_scale_mode="per_page", page_size=1), H100, DEFAULT, False, "cost"),
    (replace(FP8_LLAMA, kv_scale_mode="per_page", page_size=24), H100, DEFAULT, False, "cost"),
    (FP8_LLAMA, H100, PlannerConfig(fp8_compute=False), False, "forced_by_config"),
    (replace(FP8_LLAMA, head_dim=64), H100, DEFAULT, False, "unsupported_head_dim"),
    # gfx950 / gfx942: the portable body's e4m3 MFMAs, d = 64 too; gfx942's cache is e4m3 FNUZ
    (FP8_LLAMA, platform_for("gfx950", use_tables=False), DEFAULT, True, "preferred"),
    (replace(FP8_LLAMA, head_dim=64, kv_scale_mode="per_page"), platform_for("gfx950", use_tables=False), DEFAULT,
     True, "preferred"),
    (replace(FP8_LLAMA, kv_dtype="fp8_e4m3fnuz"), platform_for("gfx942", use_tables=False), DEFAULT, True, "preferred"),
    (replace(FP8_LLAMA, head_dim=256), platform_for("gfx950", use_tables=False), DEFAULT, False,
     "unsupported_head_dim"),
    (FP8_LLAMA, platform_for("gfx1250", use_tables=False), DEFAULT, False, "kernel_unavailable"),
    (LLAMA, H100, DEFAULT, False, "kv_cache_16bit"),
], ids=["per_tensor", "per_page16", "page1024_softcap", "per_key_page1", "per_key_page24", "disabled", "d64",
        "gfx950", "gfx950_d64_per_page", "gfx942_fnuz", "gfx950_d256", "gfx1250", "bf16_cache"])
def test_fp8_compute_routing(facts, platform, config, fp8, reason):
    config = replace(config, fp8_compute_max_keys=0)  # the model's routing; the key limit has its own test
    p = plan([4096, 1, 300], [0, 900, 1200], facts, platform, config)
    assert list(p.varlen) == [0, 2]
    assert p.varlen_fp8 is fp8 and p.varlen_compute_reason.value == reason
    # FP8 compute copies the cache's bytes (requests from multiples of 128 rows, per-page scales);
    # the 16-bit compute writes dequantized query-dtype K/V
    if fp8:
        rows = 4096 + 1536
        scales = 4 * facts.num_kv_heads * (2 * rows + rows // 128) if facts.kv_scale_mode == "per_page" else 0
        assert p.gather_bytes == rows * facts.kv_bytes_per_token + scales
    else:
        assert p.gather_bytes == (4096 + 300 + 1200) * facts.gathered_bytes_per_token


def test_fp8_compute_env_flag():
    assert PlannerConfig.from_env({}).fp8_compute
    assert not PlannerConfig.from_env({"ATOM_FP8_COMPUTE": "0"}).fp8_compute
    with pytest.raises(PlanError, match="ATOM_FP8_COMPUTE"):
        PlannerConfig.from_env({"ATOM_FP8_COMPUTE": "maybe"})


def test_fp8_compute_long_requests_compute_in_16_bits():
    """Past ATOM_FP8_COMPUTE_MAX_KEYS keys (new + cached) in any varlen request, the batch's pack is
    16-bit. Unset, the limit is the platform's: none where every FP8 tile moves O out of the MMAs'
    accumulator every 1024 keys (sm_90a, gfx942 / gfx950), 1024 on a platform whose tiles would keep
    O in it (docs/fp8.md, accuracy on long requests)."""
    assert DEFAULT.fp8_compute_max_keys is None is PlannerConfig.from_env({}).fp8_compute_max_keys
    assert H100.fp8_max_keys == 0 and plan([65536], [0], FP8_LLAMA, H100, DEFAULT).varlen_fp8
    mi355 = platform_for("gfx950", use_tables=False)
    assert mi355.fp8_max_keys == 0 and plan([65536], [0], FP8_LLAMA, mi355, DEFAULT).varlen_fp8
    unpromoted = replace(mi355, fp8_max_keys=1024)
    assert plan([1024], [0], FP8_LLAMA, unpromoted, DEFAULT).varlen_fp8
    p = plan([1000], [25], FP8_LLAMA, unpromoted, DEFAULT)
    assert not p.varlen_fp8 and p.varlen_compute_reason.value == "fp8_long_context"
    assert plan([4096], [0], FP8_LLAMA, unpromoted, PlannerConfig.from_env({"ATOM_FP8_COMPUTE_MAX_KEYS": "0"})).varlen_fp8
    limit = 1024
    config = PlannerConfig.from_env({"ATOM_FP8_COMPUTE_MAX_KEYS": str(limit)})
    at = plan([limit, 300], [0, 0], FP8_LLAMA, H100, config)
    assert at.varlen_fp8 and at.varlen_compute_reason.value == "preferred"
    for new, cached in (([limit + 1, 300], [0, 0]), ([300, 200], [0, limit])):  # cached keys count too
        p = plan(new, cached, FP8_LLAMA, H100, config)
        assert not p.varlen_fp8 and p.varlen_compute_reason.value == "fp8_long_context"
        assert p.gather_bytes == p.gather_tokens * FP8_LLAMA.gathered_bytes_per_token  # the dequantizing gather
    unlimited = PlannerConfig.from_env({"ATOM_FP8_COMPUTE_MAX_KEYS": "0"})
    assert plan([limit + 1], [0], FP8_LLAMA, H100, unlimited).varlen_fp8
    at_2048 = PlannerConfig.from_env({"ATOM_FP8_COMPUTE_MAX_KEYS": "2048"})
    assert not plan([2049], [0], FP8_LLAMA, H100, at_2048).varlen_fp8
    with pytest.raises(PlanError, match="ATOM_FP8_COMPUTE_MAX_KEYS"):
        PlannerConfig(fp8_compute_max_keys=-1)
    # the disabled switch names its own reason first
    p = plan([limit + 1], [0], FP8_LLAMA, H100, replace(config, fp8_compute=False))
    assert p.varlen_compute_reason.value == "forced_by_config"


def test_fp8_compute_registry_selection():
    """The registry's build selection of an FP8 model includes the FP8 prefill of the scale mode
    the gather packs for its page size and the FP8-layout gather (the kernel quantizes Q)."""
    from atom_backend.catalog import registry
    from hip_kernels import prefill

    for scale, page, mode in (("per_tensor", 16, 1), ("per_page", 16, 3), ("per_page", 1024, 3)):
        sel = registry.select(replace(FP8_LLAMA, kv_scale_mode=scale, page_size=page), "sm_90a")
        names = [v.name for v in sel.variants["varlen"]]
        assert any(n.startswith("varlen_prefill_hopper") and f"KV_FP8={mode}" in n for n in names), names
        assert any(n.startswith("atom_gather_kv_fp8") for n in names)
        assert any(n.startswith("atom_fp8_v_ref") for n in names) == (scale == "per_page")  # per page's pre-pass
        assert not any(n.startswith("atom_quantize_rows") for n in names)  # the kernel quantizes Q itself
    sel = registry.select(replace(FP8_LLAMA, kv_scale_mode="per_page", page_size=1), "sm_90a")
    assert any("KV_FP8=2" in v.name for v in sel.variants["varlen"])  # declared, though routed 16-bit
    # gfx942 keeps e4m3 FNUZ in its cache: an OCP e4m3 model has no FP8 kernels there
    assert not any("KV_FP8" in v.name for v in registry.select(FP8_LLAMA, "gfx942").variants["varlen"])
    assert prefill.fp8_compute_available(128, "sm_90a")
    # gfx942 / gfx950: the portable body (varlen_prefill with KV_FP8), never the Hopper kernel's
    for arch, kv in (("gfx942", "fp8_e4m3fnuz"), ("gfx950", "fp8_e4m3")):
        for hd in (64, 128):
            names = [v.name for v in registry.select(replace(FP8_LLAMA, kv_dtype=kv, head_dim=hd, kv_scale_mode="per_page",
                                                             page_size=16), arch).variants["varlen"]]
            assert any(n.startswith("varlen_prefill[") and "KV_FP8=3" in n and f"HEAD_DIM={hd}" in n for n in names), names
            assert not any(n.startswith("varlen_prefill_hopper") for n in names)
            assert any(n.startswith("atom_gather_kv_fp8") for n in names)
