"""Split-KV decode sizing: how many splits a launch has and how many each request uses.

``request_splits`` is the one definition of a request's split count: every split kernel (HIP,
Triton) and the reference apply it on the device or per request, from a ``SplitRule`` the
planner makes per batch.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

from atom_backend.planning.config import PlannerConfig
from atom_backend.planning.facts import ModelFacts, Platform


class SplitRule(NamedTuple):
    """How many of a launch's S splits a decode request uses: the count ``decode_splits`` would
    give a batch of requests of its length, decided per request on the device (every split
    kernel and the reference apply ``request_splits``), so a CUDA graph sized for max_model_len
    gives each request what an eager batch of its length gets. A tuple of six ints, in the
    kernels' argument order; zeros (``SplitRule()``) use all S splits.

    min_tokens: at most keys // min_tokens splits. fill: the fill target (0: no bound but
    min_tokens). long_tokens: fill-target splits of more keys than this grow. ctas, slots,
    wave_fill: CTAs per split, CTAs resident at once, and the % of its last wave a grown
    count's CTAs must fill."""

    min_tokens: int = 0
    fill: int = 0
    long_tokens: int = 0
    ctas: int = 0
    slots: int = 0
    wave_fill: int = 0


def fills_last_wave(ctas: int, slots: int, fill: int) -> bool:
    """`ctas` CTAs fill their last wave of `slots` to at least fill %."""
    waves = -(-ctas // slots)
    return 100 * ctas >= fill * waves * slots


def whole_wave_splits(ctas_per_split: int, slots: int, cap: int, fill: int = 95) -> int:
    """Fewest splits s <= cap whose ctas_per_split * s CTAs fill their last wave of `slots` to at
    least fill % (a partly filled wave costs about a full one); 0 when none does. Closed form per
    wave count k: the smallest s reaching k waves at fill % is ceil(fill * k * slots / (100 * ctas))."""
    k = -(-ctas_per_split // slots)  # waves of a single split
    while True:
        s = max(1, -(-fill * k * slots // (100 * ctas_per_split)))
        if s > cap:
            return 0
        if ctas_per_split * s <= k * slots:
            return s
        k += 1


def request_splits(keys: int, num_splits: int, rule: Sequence[int] = ()) -> int:
    """The split count of a request of `keys` visible keys (the one definition; the kernels
    mirror it), at most num_splits:
    - at most keys // min_tokens;
    - the fill target when its splits hold at most long_tokens keys each and its CTAs run in one
      wave, or when its CTAs fill their last wave anyway;
    - else the fewest splits, at most max(fill, keys // long_tokens), whose CTAs fill their last
      wave to wave_fill % (whole_wave_splits); none does: the fill target."""
    m, fill, long_tokens, ctas, slots, wave_fill = tuple(rule) + (0,) * (6 - len(rule))
    cap = num_splits if m <= 0 else min(num_splits, keys // m)
    cap = max(1, cap)
    if fill <= 0:
        return cap
    fill = min(fill, cap)
    if long_tokens <= 0 or ctas <= 0 or slots <= 0:
        return fill
    if (keys <= fill * long_tokens and ctas * fill <= slots) or fills_last_wave(ctas * fill, slots, wave_fill):
        return fill
    return whole_wave_splits(ctas, slots, min(cap, max(fill, keys // long_tokens)), wave_fill) or fill


def request_split_tokens(num_decodes: int, config: PlannerConfig) -> int:
    """Fewest keys per split. Few requests leave the GPU idle, so short splits still cut their
    latency; more requests fill it and want longer ones. On H100, 8 kv heads, the best bound
    measured is 64 keys at 1-2 requests, 128 at 4-8, 256 from 16 (docs/perf/decode.md,
    2026-11-24, "splits per request on the device" and "split counts from a sweep"):
    64 * isqrt(n), at most min_split_tokens."""
    return max(1, min(config.min_split_tokens, 64 * math.isqrt(max(1, num_decodes))))


def decode_split_rule(num_decodes: int, facts: ModelFacts, platform: Platform, config: PlannerConfig) -> SplitRule:
    """The batch's SplitRule. Its fill target: where the device's table measured one CTA's stream
    rate, the CTAs that together stream the copy rate (``decode_fill_ctas``); else the platform's
    fill CTAs on every SM (``decode_fill_per_sm``: one 16-bit CTA, four FP8 ones on H100), short
    of the last slot: a grid that needs every slot at once waits for the slowest to free (H100,
    FP8 2 x 4k keys: 33 splits, 528 CTAs on 528 slots, 23.7 us; 32 splits 21.2 us). Grown counts
    fill whole waves of the CTAs resident at once (``decode_ctas_per_sm`` per SM)."""
    fp8 = facts.kv_dtype.startswith("fp8")
    ctas = max(1, num_decodes * facts.num_kv_heads)
    fill_per_sm = platform.decode_fill_per_sm_fp8 if fp8 else platform.decode_fill_per_sm
    resident = platform.decode_ctas_per_sm_fp8 if fp8 else platform.decode_ctas_per_sm
    measured = platform.decode_fill_ctas_fp8 if fp8 else platform.decode_fill_ctas
    # measured on the device: at least that many CTAs; else the per-SM fill, short of the last slot
    fill = -(-measured // ctas) if measured else (platform.num_sms * fill_per_sm - 1) // ctas
    return SplitRule(min_tokens=request_split_tokens(num_decodes, config),
                     fill=max(1, fill),
                     long_tokens=config.long_split_tokens, ctas=ctas, slots=platform.num_sms * resident,
                     wave_fill=config.wave_fill)


def decode_splits(
    num_decodes: int, max_context: int, facts: ModelFacts, platform: Platform, config: PlannerConfig,
    rule: SplitRule | None = None,
) -> int:
    """The launch's splits S: request_splits of the batch's longest request under the batch's
    SplitRule, at most `split_bound`. H100, 110 shapes of 1-96 requests x 512-128k keys
    (docs/perf/decode.md, 2026-11-24, "split counts from a sweep"): +0.54% (bf16) and +0.99%
    (FP8) over the best measured split count, geomean; +5.8% and +13.9% at worst. One count for
    the whole batch keeps the grid and the workspace shape fixed (CUDA graphs); each request then
    uses the count its own length is worth, on the device. `rule`: decode_split_rule of the batch
    when the caller has it."""
    if num_decodes == 0:
        return 1
    if facts.window > 0:  # the split kernels divide the window's keys; sink tokens are not split
        max_context = min(max_context, facts.window + config.decode_max_query_tokens - 1)
    rule = rule or decode_split_rule(num_decodes, facts, platform, config)
    return request_splits(max_context, split_bound(facts, config), rule)


# The default bound on one request's CTAs: 64 splits over 8 kv heads, where one FP8 request of 128k
# fills its four CTAs per SM (H100).
MAX_REQUEST_CTAS = 512


def split_bound(facts: ModelFacts, config: PlannerConfig) -> int:
    """The most splits a launch may have: ``max_splits`` when set; else as many as keep one
    request within MAX_REQUEST_CTAS CTAs (64 at 8 kv heads). The bound is on CTAs, not splits: a
    tensor-parallel rank with one kv head (8 / 1 at TP 8) has an eighth of the CTAs per split, and
    only more splits keep every SM busy on a long request (its query rows, one kv head's group,
    already share a CTA)."""
    return config.max_splits or max(1, MAX_REQUEST_CTAS // facts.num_kv_heads)


def split_ranges(sk: int, num_splits: int, split_rule=()) -> list[tuple[int, int]]:
    """Contiguous key ranges of ceil(sk / n) keys, n = num_splits; trailing splits may be short or
    empty. With a split rule (SplitRule) n = request_splits(sk, num_splits,
    split_rule): num_splits is then an upper bound (a CUDA graph's grid), splits n.. are empty."""
    n = request_splits(sk, num_splits, split_rule)
    per = -(-sk // n) if sk else 0
    return [(min(s * per, sk), min((s + 1) * per, sk)) for s in range(num_splits)]
