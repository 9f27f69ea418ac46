"""The planner's settings: every routing threshold with its ATOM_* environment override."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

from atom_backend.planning.facts import PlanError


def _env_int(env: Mapping[str, str], name: str, default: int | None) -> int | None:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise PlanError(f"{name}={raw!r} is not an integer") from None


def env_flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name, "").strip().lower()
    if raw == "":
        return default
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise PlanError(f"{name}={raw!r} is not a flag (1/0, true/false, yes/no, on/off)")


@dataclass(frozen=True)
class PlannerConfig:
    """Every routing threshold, with its environment override (documented in the README)."""

    force_path: str = ""  # ATOM_FORCE_PATH: "" | varlen | unified (prefill routing)
    disable_varlen: bool = False  # ATOM_DISABLE_VARLEN=1
    decode_max_query_tokens: int = 1  # ATOM_DECODE_MAX_QUERY_TOKENS (<= 8: speculative decode)
    varlen_min_new_tokens: int = 8  # ATOM_VARLEN_MIN_NEW_TOKENS: shorter prefills go unified
    max_gather_ratio: int = 64  # ATOM_MAX_GATHER_RATIO: cached/new above this goes unified
    # ATOM_MAX_SPLITS: cap; 0 (default): 512 CTAs per request, 64 splits at 8 kv heads, 512 at one
    # (splits.split_bound)
    max_splits: int = 0
    # ATOM_MIN_SPLIT_TOKENS: cap of m, the fewest keys per split (request_split_tokens: 64 x
    # isqrt(decode requests), at most this); a request of L keys takes at most L // m splits
    min_split_tokens: int = 256
    # ATOM_LONG_SPLIT_TOKENS: a request whose fill-target splits would hold more keys than this
    # takes more splits (whole waves of CTAs), one per this many keys at most
    long_split_tokens: int = 1024
    wave_fill: int = 95  # ATOM_DECODE_WAVE_FILL: % the last wave of decode CTAs must be filled
    cost_routing: bool = True  # ATOM_COST_ROUTING=0: thresholds even where a cost table exists
    # ATOM_DETERMINISTIC_DECODE=1: split-KV decode on fixed key ranges (bitwise repeatable runs);
    # by default a request's splits share its keys at run time (balanced across SMs, 1-2% faster)
    deterministic_decode: bool = False
    # ATOM_FP8_COMPUTE=0: varlen prefill over an FP8 cache dequantizes to the query dtype and
    # computes in 16 bits (accuracy-sensitive models); by default it computes in FP8 where the
    # kernel exists (docs/fp8.md)
    fp8_compute: bool = True
    # ATOM_FP8_COMPUTE_MAX_KEYS: a varlen batch with a request of more keys computes in 16 bits (0:
    # no limit). Unset: the platform's fp8_max_keys (none where the FP8 kernels move O to fp32 every
    # 1024 keys, as on sm_90a, gfx942, gfx950; 1024 where O would stay in the accumulator:
    # docs/fp8.md "Long requests").
    fp8_compute_max_keys: int | None = None

    def __post_init__(self) -> None:
        if self.force_path not in ("", "varlen", "unified"):
            raise PlanError(f"ATOM_FORCE_PATH={self.force_path!r}: use varlen, unified or leave unset")
        if not 1 <= self.decode_max_query_tokens <= 8:
            raise PlanError("ATOM_DECODE_MAX_QUERY_TOKENS must be in 1..8")
        if self.max_splits < 0 or self.min_split_tokens < 1 or self.long_split_tokens < 1:
            raise PlanError("ATOM_MIN_SPLIT_TOKENS and ATOM_LONG_SPLIT_TOKENS must be >= 1, ATOM_MAX_SPLITS >= 0")
        if not 1 <= self.wave_fill <= 100:
            raise PlanError("ATOM_DECODE_WAVE_FILL must be in 1..100 (percent)")
        if self.fp8_compute_max_keys is not None and self.fp8_compute_max_keys < 0:
            raise PlanError("ATOM_FP8_COMPUTE_MAX_KEYS must be >= 0 (0: no limit)")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "PlannerConfig":
        env = os.environ if env is None else env
        if "ATOM_TARGET_WAVES" in env:  # a setting that would now do nothing must not pass silently
            raise PlanError("ATOM_TARGET_WAVES is gone: decode splits fill whole waves of CTAs "
                            "(ATOM_DECODE_WAVE_FILL, percent, default 95)")
        return cls(
            force_path=env.get("ATOM_FORCE_PATH", "").strip().lower(),
            disable_varlen=env_flag(env, "ATOM_DISABLE_VARLEN", False),
            decode_max_query_tokens=_env_int(env, "ATOM_DECODE_MAX_QUERY_TOKENS", 1),
            varlen_min_new_tokens=_env_int(env, "ATOM_VARLEN_MIN_NEW_TOKENS", 8),
            max_gather_ratio=_env_int(env, "ATOM_MAX_GATHER_RATIO", 64),
            max_splits=_env_int(env, "ATOM_MAX_SPLITS", 0),
            min_split_tokens=_env_int(env, "ATOM_MIN_SPLIT_TOKENS", 256),
            long_split_tokens=_env_int(env, "ATOM_LONG_SPLIT_TOKENS", 1024),
            wave_fill=_env_int(env, "ATOM_DECODE_WAVE_FILL", 95),
            cost_routing=env_flag(env, "ATOM_COST_ROUTING", True),
            deterministic_decode=env_flag(env, "ATOM_DETERMINISTIC_DECODE", False),
            fp8_compute=env_flag(env, "ATOM_FP8_COMPUTE", True),
            fp8_compute_max_keys=_env_int(env, "ATOM_FP8_COMPUTE_MAX_KEYS", None),
        )
