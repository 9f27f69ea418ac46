"""The planner's routing table: every request's phase, path and reason, from shapes alone."""

from __future__ import annotations

from dataclasses import replace
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from atom_backend.planner import (ModelFacts, Path, Plan, PlanError, Platform, PlannerConfig, Reason, decode_splits, plan,
                                   request_split_tokens, whole_wave_splits)
from atom_backend.kernels import platform_for

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


def test_unified_requests_are_never_gathered():
    p = plan([16, 2000], [5000, 0], LLAMA, H100, DEFAULT)
    assert p.unified.tolist() == [0] and p.varlen.tolist() == [1]
    assert p.gather_tokens == 2000


@pytest.mark.parametrize(
    "num_decodes,context,expected",
    [
        (1, 131072, 32),  # 8 CTAs a split: 32 fill 97% of 264 slots (2 per SM)
        (1, 1000, 3),  # at least 256 keys per split
        (8, 32768, 4),  # 256 CTAs: 97% of one wave
        (64, 4096, 1),
        (0, 0, 1),
        (1, 10**7, 32),  # the cap
    ],
)
def test_decode_split_counts(num_decodes, context, expected):
    p = plan([1] * num_decodes, [context - 1] * num_decodes, LLAMA, H100, DEFAULT)
    assert p.num_splits == expected


def test_window_limits_split_count():
    windowed = ModelFacts(32, 8, 128, window=128, sink_tokens=4)
    assert plan([1], [100000], windowed, H100, DEFAULT).num_splits == 1  # 132 visible keys
    wide = ModelFacts(32, 8, 128, window=4096)
    assert plan([1], [100000], wide, H100, DEFAULT).num_splits == 16


def test_split_count_respects_cap():
    p = plan([1], [10**6], LLAMA, replace(H100, num_sms=1000), PlannerConfig(max_splits=16))
    assert p.num_splits == 16


def test_env_overrides_and_bad_values():
    c = PlannerConfig.from_env({"ATOM_FORCE_PATH": "Unified", "ATOM_DISABLE_VARLEN": "1", "ATOM_MAX_SPLITS": "8",
                                "ATOM_DECODE_MAX_QUERY_TOKENS": "4", "ATOM_VARLEN_MIN_NEW_TOKENS": "32",
                                "ATOM_MAX_GATHER_RATIO": "16", "ATOM_MIN_SPLIT_TOKENS": "512", "ATOM_DECODE_WAVE_FILL": "90"})
    assert (c.force_path, c.disable_varlen, c.max_splits, c.decode_max_query_tokens) == ("unified", True, 8, 4)
    assert (c.varlen_min_new_tokens, c.max_gather_ratio, c.min_split_tokens, c.wave_fill) == (32, 16, 512, 90)
    assert PlannerConfig.from_env({}) == PlannerConfig()
    assert PlannerConfig.from_env({"ATOM_DETERMINISTIC_DECODE": "1"}).deterministic_decode
    assert not PlannerConfig().deterministic_decode
    assert PlannerConfig.from_env({"ATOM_COST_ROUTING": "Off", "ATOM_DISABLE_VARLEN": "no"}) == PlannerConfig(
        cost_routing=False)
    with pytest.raises(PlanError, match="ATOM_DETERMINISTIC_DECODE"):
        PlannerConfig.from_env({"ATOM_DETERMINISTIC_DECODE": "sometimes"})
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


@pytest.mark.parametrize("batch, ctx, kv, per_sm, want", [
    (64, 4096, "bf16", 2, 1),       # 512 CTAs on 264 slots: 1.94 waves, already >= 95% full
    (8, 32768, "bf16", 2, 4),       # docs/perf/decode.md: 4 splits (381 us) beat the old rule's 5 (450 us)
    (1, 131072, "bf16", 2, 32),     # 256 CTAs on 264 slots
    (64, 4096, "bf16", 3, 3),       # CUDA-core kernel, 3 CTAs per SM: 3 splits (398 us) vs 1 (515 us)
    (1, 100, "bf16", 2, 1),         # too short to split
    (64, 4096, "fp8_e4m3", 4, 1),   # 2-warp FP8 CTAs, 4 per SM: 512 CTAs on 528 slots
    (8, 32768, "fp8_e4m3", 4, 8),   # docs/perf/decode.md: 219.5 us at 8 splits
    (1, 131072, "fp8_e4m3", 4, 63), # 504 of 528 slots; at 32 splits half idle (152.9 vs 126.0 us at 64)
])
def test_decode_splits_fill_whole_waves(batch, ctx, kv, per_sm, want):
    fp8 = kv.startswith("fp8")
    facts = ModelFacts(num_q_heads=32, num_kv_heads=8, head_dim=128, kv_dtype=kv,
                       kv_scale_mode="per_tensor" if fp8 else "none")
    platform = Platform(num_sms=132, **{"decode_ctas_per_sm_fp8" if fp8 else "decode_ctas_per_sm": per_sm})
    s = decode_splits(batch, ctx, facts, platform, PlannerConfig())
    assert s == want
    waves = batch * 8 * s / (132 * per_sm)
    assert s == min(64, max(1, ctx // 256)) or waves / math.ceil(waves) >= 0.95


def test_request_split_tokens_grow_with_the_batch_up_to_min_split_tokens():
    got = [request_split_tokens(n, PlannerConfig()) for n in (0, 1, 3, 4, 15, 16, 512)]
    assert got == [64, 64, 64, 128, 192, 256, 256]
    assert request_split_tokens(1, PlannerConfig(min_split_tokens=32)) == 32  # the setting caps it
    # eager batches of one length keep the planner's splits: S <= ctx // min_split_tokens
    facts = ModelFacts(num_q_heads=32, num_kv_heads=8, head_dim=128)
    for n, ctx in ((1, 300), (4, 8192), (16, 600), (64, 4096)):
        assert decode_splits(n, ctx, facts, Platform(num_sms=132), PlannerConfig()) <= max(
            1, ctx // request_split_tokens(n, PlannerConfig()))


def test_decode_splits_count_fp8_ctas_per_sm():
    """The same batch gets more splits with FP8 KV: its CTAs are half as wide, twice as many fit."""
    bf16 = ModelFacts(num_q_heads=32, num_kv_heads=8, head_dim=128)
    fp8 = replace(bf16, kv_dtype="fp8_e4m3", kv_scale_mode="per_page")
    platform = Platform(num_sms=132)
    assert (platform.decode_ctas_per_sm, platform.decode_ctas_per_sm_fp8) == (2, 4)
    assert decode_splits(2, 65536, fp8, platform, PlannerConfig()) == 2 * decode_splits(2, 65536, bf16, platform, PlannerConfig())


def test_whole_wave_splits_matches_the_definition():
    """The closed form against a plain search over s = 1..cap."""
    def search(ctas, slots, cap, fill):
        for s in range(1, cap + 1):
            w = ctas * s / slots
            if 100 * w >= fill * math.ceil(w):
                return s
        return cap
    for ctas in range(1, 600, 5):
        for slots in (132, 264, 304):
            for cap in (1, 7, 32):
                for fill in (50, 95, 100):
                    assert whole_wave_splits(ctas, slots, cap, fill) == search(ctas, slots, cap, fill)


def test_removed_target_waves_setting_is_an_error():
    with pytest.raises(PlanError, match="ATOM_DECODE_WAVE_FILL"):
        PlannerConfig.from_env({"ATOM_TARGET_WAVES": "2"})
