"""vLLM's tensor parallelism on the CPU build, two ranks: each rank serves its share of the heads
(a Llama-like model with 4 query / 2 KV heads gives each rank 2 / 1: the single KV head per rank of
Llama-3-70B or gpt-oss-120b at TP 8), or, with fewer KV heads than ranks, a replica of the one KV
head (4 / 1: vLLM copies it to both ranks). Greedy tokens and logprobs must match vLLM's own CPU
attention at the same TP, and the atom_* series of both ranks, gathered through Prometheus'
multiprocess directory as an API server gathers them, must count each step once (docs/metrics.md:
only TP rank 0 records)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import HERE, RUN_TIMEOUT_S, assert_same_greedy, engine_env, runner_requests

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TP = 2


@pytest.fixture(scope="session")
def tp_models(tiny_models, work_dir):
    import models

    return {"gqa": tiny_models["llama"], "replicated_kv": models.build_llama(work_dir / "llama_mqa", heads=(4, 1))}


@pytest.fixture(scope="session")
def tp_run(tp_models, work_dir):
    cache: dict = {}

    def run(model: str, backend: str) -> dict:
        if (model, backend) not in cache:
            metrics_dir = work_dir / f"prom_tp_{model}_{backend}"
            metrics_dir.mkdir(exist_ok=True)
            # one core per rank: vLLM's CPU workers bind their OpenMP threads to the cores named here
            env = engine_env(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_OMP_THREADS_BIND="0|1",
                             PROMETHEUS_MULTIPROC_DIR=str(metrics_dir))
            p = subprocess.run([sys.executable, str(HERE / "runner.py"), str(tp_models[model]), "--backend", backend,
                                "--tp", str(TP)], env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
                               cwd=str(work_dir))
            lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
            assert p.returncode == 0 and lines, f"{model}/{backend} at TP {TP} failed (rc={p.returncode}):\n" \
                                                f"{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
            cache[(model, backend)] = json.loads(lines[-1][len("RESULT "):])
        return cache[(model, backend)]

    return run


def _sum(series: dict[str, float], name: str, **labels) -> float:
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(v for k, v in series.items() if k.split("{")[0] == name and all(w in k for w in want))


@pytest.mark.parametrize("model", ["gqa", "replicated_kv"])
def test_tp2_greedy_tokens_and_logprobs_match_vllm_cpu_backend(tp_run, model):
    assert (os.cpu_count() or 1) >= TP, "one core per rank"
    ours, ref = tp_run(model, "CUSTOM"), tp_run(model, "default")
    assert _sum(ours["metrics"], "atom_tokens_total") > 0, "our backend did not run on the ranks"
    assert _sum(ref["metrics"], "atom_tokens_total") == 0, "the reference run used our backend"
    assert_same_greedy(ours, ref, f"{model} TP {TP}")


@pytest.mark.parametrize("model", ["gqa", "replicated_kv"])
def test_tp2_ranks_count_each_step_once(tp_run, model):
    """docs/metrics.md's identity over both ranks' series: atom_tokens_total = prompt tokens -
    cached prompt tokens + generated tokens - requests (each request's first token comes from its
    prefill step). Both ranks recording would double it."""
    r = tp_run(model, "CUSTOM")
    reqs = runner_requests(r)
    prefill = sum(q["prompt_tokens"] - q["num_cached_tokens"] for q in reqs)
    decode = sum(len(q["tokens"]) - 1 for q in reqs)
    assert r["second"]["num_cached_tokens"] == 96, "the prefix hit this test counts on"
    assert _sum(r["metrics"], "atom_tokens_total", phase="prefill") == prefill
    assert _sum(r["metrics"], "atom_tokens_total", phase="decode") == decode
    routed = _sum(r["metrics"], "atom_routed_tokens_total")
    assert routed == prefill + decode, (routed, prefill, decode)
