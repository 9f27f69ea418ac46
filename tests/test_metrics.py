"""atom_backend.metrics: values per plan, sampling, device-event reads, disabled mode, and
prometheus-client's multiprocess mode as vLLM's API server collects it."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path as FsPath

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest, multiprocess
from prometheus_client.parser import text_string_to_metric_families

from atom_backend import metrics
from atom_backend.metrics import NULL_TIMER, Metrics
from atom_backend.planning import ModelFacts, PlannerConfig, Reason, plan
from atom_backend.catalog import platform_for

ROOT = FsPath(__file__).resolve().parents[1]
FACTS = ModelFacts(num_q_heads=16, num_kv_heads=4, head_dim=64, has_sinks=True, window=0, page_size=16)


def _random_batch(seed: int, n: int = 24):
    rng = np.random.default_rng(seed)
    kind = rng.integers(0, 4, n)  # 0 empty, 1 decode, 2 short prefill, 3 long prefill
    new = np.where(kind == 0, 0, np.where(kind == 1, 1, np.where(kind == 2, rng.integers(2, 8, n), rng.integers(8, 600, n))))
    cached = rng.integers(0, 3000, n)
    cached[rng.random(n) < 0.2] = 64 * 600 + rng.integers(1, 999)  # past the gather ratio
    return new, cached


def _value(reg, name, **labels):
    v = reg.get_sample_value(name, labels)
    return 0.0 if v is None else v


def test_record_plan_counts_every_route():
    reg = CollectorRegistry()
    m = Metrics(reg, sample_rate=0.0)
    plans = [plan(*_random_batch(s), FACTS, platform_for("sm_90a", use_tables=False), PlannerConfig()) for s in range(5)]
    for p in plans:
        m.record_plan(p, 2e-5)
    assert any(len(p.unified) for p in plans) and any(len(p.varlen) for p in plans) and any(len(p.decode) for p in plans)

    assert _value(reg, "atom_planner_seconds_count") == len(plans)
    assert _value(reg, "atom_planner_seconds_sum") == pytest.approx(2e-5 * len(plans))
    full = {"layer_kind": "full"}  # a plan standing alone: one kind, one layer
    assert _value(reg, "atom_gathered_bytes_total", **full) == sum(p.gather_bytes for p in plans) > 0
    assert _value(reg, "atom_gathered_tokens_total", **full) == sum(p.gather_tokens for p in plans)
    for phase, path, idx, tok in (
        ("prefill", "varlen", "varlen", "varlen_tokens"),
        ("prefill", "unified", "unified", "unified_tokens"),
        ("decode", "splitkv", "decode", "decode_tokens"),
    ):
        assert _value(reg, "atom_batches_total", phase=phase, path=path, **full) == sum(len(getattr(p, idx)) > 0 for p in plans)
        assert _value(reg, "atom_routed_tokens_total", phase=phase, path=path, **full) == sum(getattr(p, tok) for p in plans)
    assert _value(reg, "atom_batches_total", phase="decode", path="unified", **full) == 0
    assert _value(reg, "atom_tokens_total", phase="prefill") == sum(p.varlen_tokens + p.unified_tokens for p in plans)
    assert _value(reg, "atom_tokens_total", phase="decode") == sum(p.decode_tokens for p in plans)

    want: dict = {}
    for p in plans:
        for i in range(24):
            phase, path, reason = p.route_of(i)
            if phase != "empty":
                want[phase, path, reason] = want.get((phase, path, reason), 0) + 1
    got = {
        (s.labels["phase"], s.labels["path"], s.labels["reason"]): s.value
        for fam in reg.collect() if fam.name == "atom_routed_requests"
        for s in fam.samples if s.name.endswith("_total") and s.labels["layer_kind"] == "full"
    }
    assert got == want
    assert {r for _, _, r in got} >= {"preferred", "small_prefill", "gather_cost"}
    assert _value(reg, "atom_decode_num_splits_count", **full) == sum(len(p.decode) > 0 for p in plans)
    assert _value(reg, "atom_decode_num_splits_sum", **full) == sum(p.num_splits for p in plans if len(p.decode))


def test_model_level_reasons_label_decode_and_prefill():
    reg = CollectorRegistry()
    m = Metrics(reg)
    facts = ModelFacts(num_q_heads=8, num_kv_heads=8, head_dim=96)  # no kernel takes d96
    p = plan([1, 1, 300, 5], [40, 70, 10, 3], facts, platform_for("sm_90a", use_tables=False), PlannerConfig())
    m.record_plan(p, 1e-5)
    full = {"layer_kind": "full"}
    assert _value(reg, "atom_routed_requests_total", phase="decode", path="unified", reason="unsupported_head_dim", **full) == 2
    assert _value(reg, "atom_routed_requests_total", phase="prefill", path="unified", reason="unsupported_head_dim", **full) == 2
    assert _value(reg, "atom_batches_total", phase="decode", path="unified", **full) == 1
    assert _value(reg, "atom_decode_num_splits_count", **full) == 0  # no split-KV launch happened
    assert _value(reg, "atom_gathered_bytes_total", **full) == 0


def test_fallbacks_compiles_and_logging(monkeypatch, caplog):
    reg = CollectorRegistry()
    monkeypatch.setattr(metrics, "_impl", Metrics(reg))
    monkeypatch.setattr(metrics, "_logged_fallbacks", set())
    with caplog.at_level(logging.DEBUG, logger="atom_backend"):
        for _ in range(3):
            metrics.record_fallback(Reason.NO_KERNEL.value, "unified")
        metrics.record_fallback("launch_failed", "unified")
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and "kernel_unavailable" in warnings[0].getMessage()
    assert _value(reg, "atom_fallbacks_total", reason="kernel_unavailable", path="unified") == 3
    assert _value(reg, "atom_fallbacks_total", reason="launch_failed", path="unified") == 1

    metrics.record_compile("decode", 1.5, cache_hit=False)
    metrics.record_compile("decode", 0.25, cache_hit=True)
    metrics.record_compile("decode", 0.25, cache_hit=True)
    assert _value(reg, "atom_kernel_compiles_total", kernel="decode") == 1
    assert _value(reg, "atom_kernel_cache_hits_total", kernel="decode") == 2
    assert _value(reg, "atom_kernel_compile_seconds_total", kernel="decode") == pytest.approx(2.0)


def test_unified_triton_compiles_are_counted(monkeypatch):
    """Triton's JIT compiles a unified variant at its first launch: the compile listener counts the
    unified kernels' compiles and cache loads (atom_kernel_compiles_total{kernel="unified ..."}),
    ignores other Triton kernels, and keeps calling a listener that was set before it."""
    import triton

    from atom_backend.execution import health

    reg = CollectorRegistry()
    monkeypatch.setattr(metrics, "_impl", Metrics(reg))
    before = []
    monkeypatch.setattr(triton.knobs.compilation, "listener", lambda **kw: before.append(kw["cache_hit"]))
    health._observe_triton_compiles()
    health._observe_triton_compiles()  # once per process: the second call sees its own listener

    def compiled(name, hit, us):
        fn = type("Fn", (), {"__name__": name})()
        triton.knobs.compilation.listener(src=type("Src", (), {"fn": fn})(), metadata={}, metadata_group={},
                                          times=type("T", (), {"total": us})(), cache_hit=hit)

    compiled("unified_attn_kernel", False, 2_500_000)
    compiled("unified_attn_kernel", True, 1_000)
    compiled("combine_kernel", False, 500_000)
    compiled("triton_poi_fused_add_0", False, 100)  # inductor's, not ours
    assert _value(reg, "atom_kernel_compiles_total", kernel="unified unified_attn_kernel") == 1
    assert _value(reg, "atom_kernel_cache_hits_total", kernel="unified unified_attn_kernel") == 1
    assert _value(reg, "atom_kernel_compiles_total", kernel="unified combine_kernel") == 1
    assert _value(reg, "atom_kernel_compile_seconds_total", kernel="unified unified_attn_kernel") == pytest.approx(2.501)
    assert before == [False, True, False, False]


def test_kernel_timer_sampling_on_cpu():
    reg = CollectorRegistry()
    m = Metrics(reg, sample_rate=0.0, device_timing=False)
    for _ in range(200):
        assert m.kernel_timer("varlen") is NULL_TIMER
    m.sample_rate = 1.0
    for _ in range(7):
        with m.kernel_timer("varlen"):
            sum(range(1000))
    with pytest.raises(KeyError):
        with m.kernel_timer("varlen"):
            raise KeyError("a failed launch is not timed")
    assert _value(reg, "atom_kernel_seconds_count", path="varlen") == 7
    assert _value(reg, "atom_kernel_seconds_sum", path="varlen") > 0
    m.sample_rate = 0.25
    for _ in range(4000):
        with m.kernel_timer("splitkv"):
            pass
    assert 700 < _value(reg, "atom_kernel_seconds_count", path="splitkv") < 1300
    with pytest.raises(ValueError):
        Metrics(CollectorRegistry(), sample_rate=1.5)


class _FakeEvent:
    """Stands in for torch.cuda.Event: completes when the test says so."""

    clock = 0.0

    def __init__(self):
        self.t = None
        self.done = False

    def record(self):
        _FakeEvent.clock += 1.0
        self.t = _FakeEvent.clock
        self.done = False

    def query(self):
        return self.done

    def elapsed_time(self, end):
        assert self.done and end.done, "elapsed_time read before the events completed (would synchronise)"
        return (end.t - self.t) * 0.5  # ms


def test_device_timer_reads_only_completed_events():
    reg = CollectorRegistry()
    m = Metrics(reg, sample_rate=1.0, device_timing=True)
    m._capturing = lambda: False
    made = []

    def event():
        e = m._free.pop() if m._free else _FakeEvent()
        made.append(e)
        return e

    m._event = event
    with m.kernel_timer("splitkv"):
        pass
    with m.kernel_timer("splitkv"):
        pass
    assert m.poll() == 2 and _value(reg, "atom_kernel_seconds_count", path="splitkv") == 0
    made[0].done = made[1].done = True  # the first launch finished, the second did not
    assert m.poll() == 1
    assert _value(reg, "atom_kernel_seconds_count", path="splitkv") == 1
    assert _value(reg, "atom_kernel_seconds_sum", path="splitkv") == pytest.approx(0.5e-3)
    made[2].done = made[3].done = True
    m.record_plan(plan([1], [100], FACTS, platform_for("sm_90a", use_tables=False), PlannerConfig()), 1e-5)  # drains once per batch
    assert m.poll() == 0 and _value(reg, "atom_kernel_seconds_count", path="splitkv") == 2
    assert len(m._free) == 4  # event pairs are reused, not re-created per sample

    m._capturing = lambda: True
    assert m.kernel_timer("splitkv") is NULL_TIMER

    m._capturing = lambda: False
    for _ in range(metrics.MAX_PENDING_EVENTS + 10):
        with m.kernel_timer("unified"):
            pass
    assert len(m._pending) == metrics.MAX_PENDING_EVENTS


def _python(code: str, env_extra: dict, timeout: float = 60.0) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PROMETHEUS_MULTIPROC_DIR", "prometheus_multiproc_dir")}
    env.update(env_extra)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


WORKER = """
    import json, sys
    {pre}
    from atom_backend import metrics
    from atom_backend.planning import ModelFacts, PlannerConfig, plan
    from atom_backend.catalog import platform_for
    facts = ModelFacts(num_q_heads=16, num_kv_heads=4, head_dim=64)
    p = plan({new}, {cached}, facts, platform_for("sm_90a", use_tables=False), PlannerConfig())
    metrics.record_plan(p, 3e-5)
    metrics.record_compile("gather", 0.5, cache_hit=False)
    with metrics.kernel_timer("varlen"):
        pass
    print(json.dumps(dict(varlen_tokens=p.varlen_tokens, prefill_tokens=p.varlen_tokens + p.unified_tokens,
                          gather_bytes=p.gather_bytes, decode_tokens=p.decode_tokens)))
"""


def _families(text: str) -> dict:
    return {s.name + json.dumps(s.labels, sort_keys=True): s.value for f in text_string_to_metric_families(text) for s in f.samples}


def test_multiprocess_values_reach_another_process(tmp_path):
    mp = tmp_path / "prom"  # metrics.py creates it, as vLLM would not
    env = {"PROMETHEUS_MULTIPROC_DIR": str(mp), "ATOM_METRICS_SAMPLE_RATE": "1"}
    # Worker A imports prometheus-client *before* the variable is set, as a process does
    # when vLLM's setup_multiprocess_prometheus() sets it at run time.
    a = json.loads(_python(WORKER.format(
        pre="import os, prometheus_client; os.environ['PROMETHEUS_MULTIPROC_DIR'] = os.environ['LATE_DIR']",
        new=[100, 1, 1], cached=[20, 500, 900]), {"LATE_DIR": str(mp), "ATOM_METRICS_SAMPLE_RATE": "1"}))
    b = json.loads(_python(WORKER.format(pre="", new=[40, 1], cached=[0, 30]), env))
    assert sorted(p.name.split("_")[0] for p in mp.iterdir()) == ["counter", "counter", "histogram", "histogram"]

    # The reader is another process, serving what vLLM's API server serves.
    text = _python(
        """
        from prometheus_client import generate_latest
        from atom_backend import metrics
        print(generate_latest(metrics.exposition_registry()).decode())
        """,
        {"PROMETHEUS_MULTIPROC_DIR": str(mp)},
    )
    got = _families(text)
    assert got['atom_tokens_total{"phase": "prefill"}'] == a["prefill_tokens"] + b["prefill_tokens"]
    assert got['atom_tokens_total{"phase": "decode"}'] == a["decode_tokens"] + b["decode_tokens"]
    varlen = '{"layer_kind": "full", "path": "varlen", "phase": "prefill"}'
    assert got["atom_routed_tokens_total" + varlen] == a["varlen_tokens"] + b["varlen_tokens"]
    assert got['atom_gathered_bytes_total{"layer_kind": "full"}'] == a["gather_bytes"] + b["gather_bytes"] > 0
    assert got['atom_kernel_compiles_total{"kernel": "gather"}'] == 2
    assert got["atom_planner_seconds_count{}"] == 2
    assert got['atom_kernel_seconds_count{"path": "varlen"}'] == 2

    # The same directory read in this process, without the module: plain multiprocess collector.
    reg = CollectorRegistry()
    multiprocess.MultiProcessCollector(reg, path=str(mp))
    assert b"atom_batches_total" in generate_latest(reg)


def test_vllm_metrics_endpoint_registry_includes_worker_values(tmp_path):
    """vLLM 0.32's /metrics serves get_prometheus_registry(): with PROMETHEUS_MULTIPROC_DIR
    set, a MultiProcessCollector over that directory, so a worker's atom_* series show."""
    pytest.importorskip("vllm.v1.metrics.prometheus")
    mp = tmp_path / "prom"
    env = {"PROMETHEUS_MULTIPROC_DIR": str(mp)}
    w = json.loads(_python(WORKER.format(pre="", new=[64, 1], cached=[32, 100]), env))
    text = _python(
        """
        from prometheus_client import generate_latest
        from vllm.v1.metrics.prometheus import get_prometheus_registry
        print(generate_latest(get_prometheus_registry()).decode())
        """,
        env,
        timeout=120,
    )
    got = _families(text)
    assert got['atom_tokens_total{"phase": "prefill"}'] == w["prefill_tokens"] == 64


def test_disabled_is_a_no_op():
    out = _python(
        """
        import json
        from prometheus_client import REGISTRY, generate_latest
        from atom_backend import metrics
        from atom_backend.planning import ModelFacts, PlannerConfig, plan
        from atom_backend.catalog import platform_for
        p = plan([100, 1], [0, 40], ModelFacts(num_q_heads=4, num_kv_heads=4, head_dim=64), platform_for("sm_90a", use_tables=False), PlannerConfig())
        metrics.record_plan(p, 1e-5)
        metrics.record_compile("decode", 1.0, True)
        metrics.record_fallback("kernel_unavailable", "unified")
        with metrics.kernel_timer("varlen"):
            pass
        print(json.dumps(dict(kind=type(metrics._impl).__name__,
                              atom=[l for l in generate_latest(REGISTRY).decode().splitlines() if "atom_" in l],
                              timer=metrics.kernel_timer("varlen") is metrics.NULL_TIMER)))
        """,
        {"ATOM_METRICS": "0", "ATOM_METRICS_SAMPLE_RATE": "1"},
    )
    got = json.loads(out)
    assert got == {"kind": "_Disabled", "atom": [], "timer": True}


def test_bad_sample_rate_is_a_clear_error():
    out = _python(
        """
        from atom_backend import metrics
        try:
            metrics.record_compile("x", 0.1, True)
        except ValueError as e:
            print(e)
        """,
        {"ATOM_METRICS_SAMPLE_RATE": "often"},
    )
    assert "ATOM_METRICS_SAMPLE_RATE='often'" in out


@pytest.mark.gpu
def test_device_events_time_a_kernel_without_sync():
    import torch

    reg = CollectorRegistry()
    m = Metrics(reg, sample_rate=1.0)
    a = torch.randn(2048, 2048, device="cuda")
    for _ in range(5):
        with m.kernel_timer("unified"):
            a = a @ a.T / 2048
    torch.cuda.synchronize()
    assert m.poll() == 0
    assert _value(reg, "atom_kernel_seconds_count", path="unified") == 5
    assert _value(reg, "atom_kernel_seconds_sum", path="unified") > 0


def test_varlen_compute_precision_is_counted():
    from dataclasses import replace as _replace

    reg = CollectorRegistry()
    m = Metrics(reg, sample_rate=0.0)
    fp8 = ModelFacts(32, 8, 128, kv_dtype="fp8_e4m3", kv_scale_mode="per_tensor")
    h100 = platform_for("sm_90a", use_tables=False)
    m.record_plan(plan([1024, 300], [0, 100], fp8, h100, PlannerConfig()), 1e-5)
    m.record_plan(plan([2048], [0], fp8, h100, PlannerConfig(fp8_compute=False)), 1e-5)
    m.record_plan(plan([300, 2000], [0, 100], fp8, h100, PlannerConfig(fp8_compute_max_keys=1024)), 1e-5)  # past it
    m.record_plan(plan([512], [0], _replace(fp8, kv_dtype="bf16", kv_scale_mode="none"), h100, PlannerConfig()), 1e-5)
    vc = "atom_varlen_compute_requests_total"
    assert _value(reg, vc, compute="fp8", reason="preferred", layer_kind="full") == 2
    assert _value(reg, vc, compute="16bit", reason="forced_by_config", layer_kind="full") == 1
    assert _value(reg, vc, compute="16bit", reason="fp8_long_context", layer_kind="full") == 2
    assert _value(reg, vc, compute="16bit", reason="kv_cache_16bit", layer_kind="full") == 1


# -- who records: a batch vLLM plans once per KV-cache group ---------------------------------

def _common_metadata(new, cached, page=16):
    """vLLM's per-step batch description, as much of it as the builder reads (host tensors)."""
    import torch
    from vllm.v1.attention.backend import CommonAttentionMetadata

    total = [n + c for n, c in zip(new, cached)]
    width = max(-(-t // page) for t in total)
    qsl = torch.zeros(len(new) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(new), 0)
    seq_lens = torch.tensor(total, dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=seq_lens, num_reqs=len(new),
        num_actual_tokens=int(qsl[-1]), max_query_len=max(new), max_seq_len=int(seq_lens.max()),
        block_table_tensor=torch.arange(len(new) * width, dtype=torch.int32).reshape(len(new), width),
        slot_mapping=torch.zeros(int(qsl[-1]), dtype=torch.int64), seq_lens_cpu_upper_bound=seq_lens.clone())


def _layers(*idx):
    return [f"model.layers.{i}.self_attn.attn" for i in idx]


@pytest.fixture
def recorded(monkeypatch):
    """The module functions on a private registry, and no builder of another test alive."""
    import gc

    pytest.importorskip("vllm")
    gc.collect()
    reg = CollectorRegistry()
    monkeypatch.setattr(metrics, "_impl", Metrics(reg, sample_rate=0.0))
    return reg


def test_a_batch_planned_by_several_groups_counts_its_tokens_once(recorded):
    from dataclasses import replace as _replace

    from atom_backend.vllm.metadata import AtomMetadataBuilder

    reg = recorded
    sinks = ModelFacts(num_q_heads=8, num_kv_heads=2, head_dim=32, has_sinks=True, page_size=16)
    window = _replace(sinks, window=32)
    # gpt-oss as vLLM groups it (window layers 0, 2, full ones 1, 3), plus a second window group
    # as Gemma-3 has (layers 4, 6): each plans the same step.
    builders = [AtomMetadataBuilder.for_model(f, PlannerConfig(), "cpu", layer_names=names) for f, names in (
        (sinks, _layers(1, 3)), (window, _layers(0, 2)), (window, _layers(4, 6)))]
    cm = _common_metadata(new=[1, 1, 40, 5], cached=[30, 100, 64, 0])
    plans = [b.build(0, cm).plan for b in builders]
    p = plans[1]
    assert p.decode_tokens == 2 and p.varlen_tokens == 40 and p.unified_tokens == 5 and p.gather_bytes > 0

    assert _value(reg, "atom_tokens_total", phase="prefill") == 45
    assert _value(reg, "atom_tokens_total", phase="decode") == 2
    assert _value(reg, "atom_planner_seconds_count") == 3  # one per planner call
    for kind in ("window", "sinks"):
        assert _value(reg, "atom_batches_total", phase="prefill", path="varlen", layer_kind=kind) == 1
        assert _value(reg, "atom_routed_tokens_total", phase="prefill", path="varlen", layer_kind=kind) == 40
        assert _value(reg, "atom_routed_tokens_total", phase="prefill", path="unified", layer_kind=kind) == 5
        assert _value(reg, "atom_routed_requests_total", phase="decode", path="splitkv", reason="preferred",
                      layer_kind=kind) == 2
        assert _value(reg, "atom_varlen_compute_requests_total", compute="16bit", reason="kv_cache_16bit",
                      layer_kind=kind) == 1
    assert _value(reg, "atom_batches_total", phase="prefill", path="varlen", layer_kind="full") == 0
    # the gather really runs in every layer: 4 window layers, 2 full ones
    assert _value(reg, "atom_gathered_bytes_total", layer_kind="window") == 4 * p.gather_bytes
    assert _value(reg, "atom_gathered_bytes_total", layer_kind="sinks") == 2 * plans[0].gather_bytes
    assert _value(reg, "atom_gathered_tokens_total", layer_kind="window") == 4 * p.gather_tokens

    # The step recorder gone (a model unloaded), the next lowest builder takes its role.
    del builders[1]
    builders[0].build(0, cm)
    builders[1].build(0, cm)
    assert _value(reg, "atom_tokens_total", phase="prefill") == 90
    assert _value(reg, "atom_routed_tokens_total", phase="prefill", path="varlen", layer_kind="window") == 80


def test_capture_and_draft_builds_record_nothing(recorded):
    from atom_backend.vllm.metadata import AtomMetadataBuilder

    reg = recorded
    facts = ModelFacts(num_q_heads=8, num_kv_heads=2, head_dim=32, page_size=16)
    b = AtomMetadataBuilder.for_model(facts, PlannerConfig(), "cpu", layer_names=_layers(0, 1))
    md = b.build_for_cudagraph_capture(_common_metadata(new=[1, 1, 1], cached=[0, 0, 0]))
    assert md.decode is not None and len(md.decode.reqs) == 3
    drafter = AtomMetadataBuilder.for_model(facts, PlannerConfig(), "cpu", layer_names=_layers(2))
    drafter.build_for_drafting(_common_metadata(new=[3], cached=[20]), draft_index=0)
    sample_names = {s.name for fam in reg.collect() for s in fam.samples if s.value and not s.name.endswith("_created")}
    assert not {n for n in sample_names if n.startswith("atom_")}, sample_names

    # a draft-only builder with the lowest layer index does not keep the target's step role
    drafter = AtomMetadataBuilder.for_model(facts, PlannerConfig(), "cpu", layer_names=["draft.layers.0.attn"])
    drafter.build_for_drafting(_common_metadata(new=[2], cached=[20]), draft_index=0)
    b.build(0, _common_metadata(new=[9], cached=[0]))
    assert _value(reg, "atom_tokens_total", phase="prefill") == 9


def test_only_the_first_tensor_parallel_rank_of_the_first_stage_counts_tokens(recorded, monkeypatch):
    import types

    from vllm.distributed import parallel_state as ps

    from atom_backend.vllm.metadata import AtomMetadataBuilder

    reg = recorded
    rank = {"tp": 1, "first_stage": True}
    monkeypatch.setattr(ps, "model_parallel_is_initialized", lambda: True)
    monkeypatch.setattr(ps, "get_tensor_model_parallel_rank", lambda: rank["tp"])
    monkeypatch.setattr(ps, "get_pp_group", lambda: types.SimpleNamespace(is_first_rank=rank["first_stage"]))
    facts = ModelFacts(num_q_heads=8, num_kv_heads=2, head_dim=32, page_size=16)
    cm = _common_metadata(new=[40, 1], cached=[64, 10])

    def step() -> int:
        """One step of a fresh engine in this process; its plan's gather bytes."""
        b = AtomMetadataBuilder.for_model(facts, PlannerConfig(), "cpu", layer_names=_layers(0, 1))
        return b.build(0, cm).plan.gather_bytes

    gather = step()
    assert _value(reg, "atom_tokens_total", phase="prefill") == 0
    assert _value(reg, "atom_routed_tokens_total", phase="prefill", path="varlen", layer_kind="full") == 0
    # the rank's own work still shows: its planner call and the bytes its layers gather
    assert _value(reg, "atom_planner_seconds_count") == 1
    assert _value(reg, "atom_gathered_bytes_total", layer_kind="full") == 2 * gather

    rank.update(tp=0, first_stage=False)
    step()
    assert _value(reg, "atom_tokens_total", phase="prefill") == 0

    rank.update(tp=0, first_stage=True)
    step()
    assert _value(reg, "atom_tokens_total", phase="prefill") == 40
    assert _value(reg, "atom_tokens_total", phase="decode") == 1
    assert _value(reg, "atom_routed_tokens_total", phase="prefill", path="varlen", layer_kind="full") == 40
