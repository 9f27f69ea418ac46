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
from atom_backend.planner import ModelFacts, PlannerConfig, Reason, plan
from atom_backend.kernels import platform_for

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
    assert _value(reg, "atom_gathered_bytes_total") == sum(p.gather_bytes for p in plans) > 0
    assert _value(reg, "atom_gathered_tokens_total") == sum(p.gather_tokens for p in plans)
    for phase, path, idx, tok in (
        ("prefill", "varlen", "varlen", "varlen_tokens"),
        ("prefill", "unified", "unified", "unified_tokens"),
        ("decode", "splitkv", "decode", "decode_tokens"),
    ):
        assert _value(reg, "atom_batches_total", phase=phase, path=path) == sum(len(getattr(p, idx)) > 0 for p in plans)
        assert _value(reg, "atom_tokens_total", phase=phase, path=path) == sum(getattr(p, tok) for p in plans)
    assert _value(reg, "atom_batches_total", phase="decode", path="unified") == 0

    want: dict = {}
    for p in plans:
        for i in range(24):
            phase, path, reason = p.route_of(i)
            if phase != "empty":
                want[phase, path, reason] = want.get((phase, path, reason), 0) + 1
    got = {
        (s.labels["phase"], s.labels["path"], s.labels["reason"]): s.value
        for fam in reg.collect() if fam.name == "atom_routed_requests"
        for s in fam.samples if s.name.endswith("_total")
    }
    assert got == want
    assert {r for _, _, r in got} >= {"preferred", "small_prefill", "gather_cost"}
    assert _value(reg, "atom_decode_num_splits_count") == sum(len(p.decode) > 0 for p in plans)
    assert _value(reg, "atom_decode_num_splits_sum") == sum(p.num_splits for p in plans if len(p.decode))


def test_model_level_reasons_label_decode_and_prefill():
    reg = CollectorRegistry()
    m = Metrics(reg)
    facts = ModelFacts(num_q_heads=8, num_kv_heads=8, head_dim=96)  # no kernel takes d96
    p = plan([1, 1, 300, 5], [40, 70, 10, 3], facts, platform_for("sm_90a", use_tables=False), PlannerConfig())
    m.record_plan(p, 1e-5)
    assert _value(reg, "atom_routed_requests_total", phase="decode", path="unified", reason="unsupported_head_dim") == 2
    assert _value(reg, "atom_routed_requests_total", phase="prefill", path="unified", reason="unsupported_head_dim") == 2
    assert _value(reg, "atom_batches_total", phase="decode", path="unified") == 1
    assert _value(reg, "atom_decode_num_splits_count") == 0  # no split-KV launch happened
    assert _value(reg, "atom_gathered_bytes_total") == 0


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
    from atom_backend.planner import ModelFacts, PlannerConfig, plan
    from atom_backend.kernels import platform_for
    facts = ModelFacts(num_q_heads=16, num_kv_heads=4, head_dim=64)
    p = plan({new}, {cached}, facts, platform_for("sm_90a", use_tables=False), PlannerConfig())
    metrics.record_plan(p, 3e-5)
    metrics.record_compile("gather", 0.5, cache_hit=False)
    with metrics.kernel_timer("varlen"):
        pass
    print(json.dumps(dict(varlen_tokens=p.varlen_tokens, gather_bytes=p.gather_bytes, decode_tokens=p.decode_tokens)))
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
    assert got['atom_tokens_total{"path": "varlen", "phase": "prefill"}'] == a["varlen_tokens"] + b["varlen_tokens"]
    assert got['atom_tokens_total{"path": "splitkv", "phase": "decode"}'] == a["decode_tokens"] + b["decode_tokens"]
    assert got["atom_gathered_bytes_total{}"] == a["gather_bytes"] + b["gather_bytes"] > 0
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
    assert got['atom_tokens_total{"path": "varlen", "phase": "prefill"}'] == w["varlen_tokens"] == 64


def test_disabled_is_a_no_op():
    out = _python(
        """
        import json
        from prometheus_client import REGISTRY, generate_latest
        from atom_backend import metrics
        from atom_backend.planner import ModelFacts, PlannerConfig, plan
        from atom_backend.kernels import platform_for
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
    assert _value(reg, "atom_varlen_compute_requests_total", compute="fp8", reason="preferred") == 2
    assert _value(reg, "atom_varlen_compute_requests_total", compute="16bit", reason="forced_by_config") == 1
    assert _value(reg, "atom_varlen_compute_requests_total", compute="16bit", reason="fp8_long_context") == 2
    assert _value(reg, "atom_varlen_compute_requests_total", compute="16bit", reason="kv_cache_16bit") == 1
