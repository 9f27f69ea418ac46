"""GPU smoke runs of the tuner, the calibration and the trace replay, and the real impl's first
forward after an ahead-of-time build compiling nothing. Run: pytest -m gpu tests/test_kernels_gpu.py"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[1]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")


def _env(**kw):
    env = dict(os.environ, PYTHONPATH=str(ROOT), **{k: str(v) for k, v in kw.items()})
    return env


@needs_cuda
def test_tune_quick_writes_a_loadable_table(tmp_path):
    from atom_backend.catalog import tables
    from bench import tune

    body = tune.main(["--quick", "--out", str(tmp_path)])
    rows = body["kernels"]["varlen_prefill"]
    assert rows and all("config" in r for r in rows)
    data = json.loads(next(tmp_path.glob("tuning_*.json")).read_text())
    assert data["schema"] == tables.SCHEMAS["tuning"] and data["produced_by"]["device"]


@needs_cuda
def test_calibrate_quick_writes_a_usable_cost_model(tmp_path):
    from atom_backend.planning.cost import CostModel
    from atom_backend.planning import ModelFacts
    from bench import calibrate

    calibrate.main(["--quick", "--out", str(tmp_path)])
    p = next(tmp_path.glob("cost_*.json"))
    m = CostModel(json.loads(p.read_text()), str(p))
    tv, tu = m.predict(ModelFacts(64, 8, 64, has_sinks=True), [512, 4096], [0, 32768])
    assert (tv > 0).all() and (tu > 0).all()


@needs_cuda
def test_trace_quick_runs_every_routing():
    from bench import trace

    data = trace.main(["--quick"])
    assert {s["class"] for s in data["summary"]} == set(trace.CLASSES)
    assert all(s["cost_ms"] > 0 and s["varlen_ms"] > 0 and s["unified_ms"] > 0 for s in data["summary"])


FIRST_FORWARD = textwrap.dedent("""
    import json, os, torch
    from bench import _vllm
    _vllm.install()
    from atom_backend.execution import routes as executors
    from atom_backend import metrics
    from atom_backend.execution.health import detect_platform
    from atom_backend.vllm.metadata import AtomMetadataBuilder
    from atom_backend.planning import ModelFacts, PlannerConfig
    from bench.calibrate import cu, paged
    from hip_kernels import runtime
    from vllm.v1.attention.backend import CommonAttentionMetadata

    dev = torch.device("cuda")
    platform = detect_platform(dev)
    reqs = [(1, 3000), (1, 700), (2048, 0), (300, 5000)]
    new = [n for n, _ in reqs]; total = [n + c for n, c in reqs]
    counts = {}
    for kv in ("bf16", "fp8"):
        fp8 = runtime.native_fp8_dtype(runtime.device_arch()) if kv == "fp8" else torch.bfloat16
        facts = ModelFacts(64, 8, 64, kv_dtype="fp8_e4m3" if kv == "fp8" else "bf16",
                           kv_scale_mode="per_tensor" if kv == "fp8" else "none", has_sinks=True,
                           layer_windows=(0, 128))
        kc, vc, bt, seq_lens = paged(total, 8, 64, dtype=fp8)
        qsl = cu(new)
        cm = CommonAttentionMetadata(query_start_loc=qsl, query_start_loc_cpu=qsl.cpu(), seq_lens=seq_lens,
            num_reqs=len(reqs), num_actual_tokens=sum(new), max_query_len=max(new), max_seq_len=max(total),
            block_table_tensor=bt, slot_mapping=torch.zeros(sum(new), dtype=torch.int64, device=dev),
            seq_lens_cpu_upper_bound=seq_lens.cpu())
        q = torch.randn(sum(new), 64, 64, dtype=torch.bfloat16, device=dev)
        out = torch.empty_like(q)
        sinks = torch.randn(64, device=dev)
        for force in ("varlen", ""):  # every kernel of both paths is loaded at least once
            md = AtomMetadataBuilder.for_model(facts, PlannerConfig(force_path=force), dev, platform).build(0, cm)
            for w in (0, 128):
                p = executors.LayerParams(0.125, w, 0.0, sinks, 0.5 if kv == "fp8" else None,
                                          0.5 if kv == "fp8" else None, torch.bfloat16)
                executors.run(md, q, out, kc, vc, p)
        torch.cuda.synchronize()
        assert not out.isnan().any()
    from atom_backend.execution import health
    m = metrics._impl
    total = lambda c: sum(s.value for f in c.collect() for s in f.samples if s.name.endswith("_total"))
    print(json.dumps({"compiles": total(m.compiles), "hits": total(m.cache_hits),
                      "failed": {k: v for k, v in health.STATE.items() if v}}))
""")


@needs_cuda
def test_first_forward_after_build_compiles_nothing(tmp_path):
    from hip_kernels import runtime

    arch = runtime.device_arch()
    env = _env(ATOM_KERNEL_CACHE=tmp_path / "cache", ATOM_TABLES_DIR=tmp_path / "no-tables")
    env.pop("ATOM_NO_COMPILE", None)
    r = subprocess.run([sys.executable, "-m", "atom_backend.catalog", "build", "--arch", arch, "--heads", "64",
                        "--kv-heads", "8", "--head-dim", "64", "--sinks", "--layer-windows", "0,128",
                        "--kv-dtype", "auto,fp8", "--quiet"], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    env.update(ATOM_NO_COMPILE="1", ATOM_METRICS="1", ATOM_COST_ROUTING="0")
    r = subprocess.run([sys.executable, "-c", FIRST_FORWARD], env=env, capture_output=True, text=True,
                       timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["failed"] == {}, got  # no kernel fell back (a CompileForbiddenError would show here)
    assert got["compiles"] == 0 and got["hits"] > 0, got
