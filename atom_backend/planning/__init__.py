"""The planning layer: pure Python (numpy, no torch, no vLLM). A batch description in, a plan
with a reason for every request out; the rules that say which kernel serves which model; the
cost model that predicts each path's time; the planner's settings and the split-KV sizing."""

from atom_backend.planning.config import PlannerConfig, env_flag
from atom_backend.planning.facts import ModelFacts, Path, PlanError, Platform, Reason, reduce_layer_windows
from atom_backend.planning.planner import (Plan, batch_routes, fp8_pack_bytes, model_fp8_compute_reason,
                                           model_splitkv_reason, model_varlen_reason, plan)
from atom_backend.planning.splits import (SplitRule, decode_split_rule, decode_splits, fills_last_wave,
                                          request_split_tokens, request_splits, split_ranges,
                                          whole_wave_splits)

__all__ = ["ModelFacts", "Path", "Plan", "PlanError", "PlannerConfig", "Platform", "Reason", "SplitRule",
           "batch_routes", "decode_split_rule", "decode_splits", "env_flag", "fills_last_wave", "fp8_pack_bytes",
           "model_fp8_compute_reason", "model_splitkv_reason", "model_varlen_reason", "plan", "reduce_layer_windows",
           "request_split_tokens", "request_splits", "split_ranges", "whole_wave_splits"]
