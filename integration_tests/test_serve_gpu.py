"""vLLM's engine on a GPU with ``CUSTOM`` against vLLM's own GPU backends (``TRITON_ATTN``,
``FLASH_ATTN``) on the same requests: CUDA graphs and torch.compile as vLLM defaults them, tiny
random-weight models with the GPU head sizes of Llama (d 128), gpt-oss (d 64, sinks, window 128)
and Gemma-2 (d 256, soft-cap), prefix caching, chunked prefill, a 32k-token request, 256
concurrent requests, FP8 KV, ngram speculative decoding, and the OpenAI server with /metrics.

    python -m pytest -m gpu integration_tests/test_serve_gpu.py   # on a GPU machine with vLLM

How close is close enough. Every backend here computes attention with fp32 accumulation over bf16
(or FP8) inputs and rounds its output to bf16; they differ in the order of the sums and where P is
rounded, so a model's logprobs differ by a few bf16 rounding errors amplified through the layers,
an amount no formula gives for random weights. vLLM's own two backends measure it: their largest
logprob difference over the steps where they agree is S. Ours is a third implementation with the
same rounding points, so it may sit as far from either peer as they sit from each other, in either
direction: |ours - peer| <= 2 S + 2^-6 (the floor: one bf16 rounding, 2^-8 relative, of logprobs
up to 4 in magnitude, for when the peers happen to agree exactly). Greedy tokens agree until a
near tie: the first token that differs must be among the peer's top 5 with a logprob within
2 (2 S + 2^-6) of the peer's choice; after it the texts differ and are not compared.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.integration]

HERE = Path(__file__).resolve().parent
PEERS = ("TRITON_ATTN", "FLASH_ATTN")
MODELS = ("llama", "gptoss", "gemma2")
RUN_TIMEOUT_S = 900
FLOOR = 2.0 ** -6
ENGINES = int(os.environ.get("ATOM_GPU_ENGINES", "4"))  # engines side by side (tiny models: the GPU has room)
KV_CACHE_GIB = 2.0  # per engine: the burst's 256 requests and the 33k-token request fit many times over
EACH = pytest.mark.engines(*[(None, b) for b in ("CUSTOM", *PEERS)])  # the test's model under all three


@pytest.fixture(scope="session")
def gpu_models(tmp_path_factory):
    pytest.importorskip("vllm")
    import torch

    assert torch.cuda.is_available(), "the GPU suite needs a GPU"
    sys.path.insert(0, str(HERE))
    import models

    root = tmp_path_factory.mktemp("gpu_models")
    return {name: build(root / name) for name, build in models.GPU_BUILDERS.items()}


def _engine_keys(item) -> list[tuple]:
    """The (model, backend, runner args) engines a collected test asks for (its ``engines`` marker;
    model None: the test's ``model`` parameter)."""
    m = item.get_closest_marker("engines")
    params = item.callspec.params if hasattr(item, "callspec") else {}
    return [(model or params["model"], backend, tuple(args)) for model, backend, *args in (m.args if m else ())]


def _run_engine(models: dict, logs: Path, caches: Path, key: tuple) -> dict | str:
    """One gpu_runner.py engine: its RESULT JSON, or the reason it failed."""
    model, backend, args = key
    name = "_".join([model, backend, *[a.strip("-") for a in args]])
    env = {k: v for k, v in os.environ.items() if k.lower() != "prometheus_multiproc_dir"}
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process engine core: our counters come back
    env["VLLM_CACHE_ROOT"] = str(caches / name)  # engines side by side do not share compile caches
    kv = ("--kv-cache-gib", str(KV_CACHE_GIB)) if ENGINES > 1 else ()
    cmd = [sys.executable, str(HERE / "gpu_runner.py"), str(models[model]), "--backend", backend, *args, *kv]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    (logs / f"{name}.log").write_text(p.stdout + "\n--- stderr ---\n" + p.stderr[-200000:])
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode == 0 and lines:
        return json.loads(lines[-1][len("RESULT "):])
    return f"{name} failed (rc={p.returncode}):\n{p.stderr[-6000:]}"


@pytest.fixture(scope="session")
def gpu_run(request, gpu_models, tmp_path_factory):
    """gpu_run(model, backend, *runner args) -> gpu_runner.py's JSON. Every engine the selected tests
    declare starts at once, ENGINES at a time side by side on the GPU (each with a fixed KV cache,
    so that vLLM's memory profiling does not see the others); a failed engine is remembered, so
    every test that needs it fails at once."""
    logs = Path(os.environ.get("ATOM_GPU_LOGS") or tmp_path_factory.mktemp("gpu_logs"))
    logs.mkdir(parents=True, exist_ok=True)
    caches = tmp_path_factory.mktemp("vllm_caches")
    pool = ThreadPoolExecutor(ENGINES)
    runs: dict[tuple, Future] = {}

    def submit(key: tuple) -> Future:
        if key not in runs:
            runs[key] = pool.submit(_run_engine, gpu_models, logs, caches, key)
        return runs[key]

    for item in request.session.items:
        for key in _engine_keys(item):
            submit(key)

    def run(model: str, backend: str, *args: str) -> dict:
        res = submit((model, backend, args)).result()
        assert not isinstance(res, str), res
        return res

    yield run
    pool.shutdown(cancel_futures=True)


def _requests(r: dict) -> list[dict]:
    return [req for phase in r["phases"].values() for req in phase]


def spread(a: dict, b: dict) -> float:
    """Largest |logprob difference| of two runs over the steps where their greedy tokens agree."""
    worst = 0.0
    for x, y in zip(_requests(a), _requests(b), strict=True):
        for tx, ty, lx, ly in zip(x["tokens"], y["tokens"], x["logprobs"], y["logprobs"]):
            if tx != ty:
                break
            worst = max(worst, abs(lx[str(tx)] - ly[str(ty)]))
    return worst


def first_disagreement(ours: dict, peer: dict, tol: float) -> str | None:
    """None when greedy tokens are equal up to a near tie and logprobs within tol where they agree
    (module doc); else where and how they first part."""
    for i, (x, y) in enumerate(zip(_requests(ours), _requests(peer), strict=True)):
        if len(x["tokens"]) != len(y["tokens"]):
            return f"request {i}: lengths differ"
        for step, (tx, ty, lx, ly) in enumerate(zip(x["tokens"], y["tokens"], x["logprobs"], y["logprobs"])):
            where = f"request {i} step {step}: ours {tx} ({lx[str(tx)]:.4f}), peer's {ty} ({ly[str(ty)]:.4f})"
            if tx != ty:
                if str(tx) not in ly:
                    return f"{where}: ours not in the peer's top 5 {ly}; our top 5 {lx}"
                gap = ly[str(ty)] - ly[str(tx)]
                return None if gap <= 2 * tol else f"{where}: the peer's gap {gap:.4f} > {2 * tol:.4f}"
            d = abs(lx[str(tx)] - ly[str(ty)])
            if d > tol:
                return f"{where}: logprob differs by {d:.4f} > {tol:.4f}"
    return None


def assert_agree(ours: dict, peers: dict[str, dict], tol: float, what: str) -> None:
    """first_disagreement against every peer, all of them reported when one fails."""
    parts = {name: first_disagreement(ours, peer, tol) for name, peer in peers.items()}
    bad = {name: why for name, why in parts.items() if why}
    assert not bad, f"{what} (tolerance {tol:.4f}): " + "; ".join(f"vs {n}: {why}" for n, why in bad.items())


def _tolerance(gpu_run, model: str, *args: str) -> float:
    return 2 * spread(gpu_run(model, PEERS[0], *args), gpu_run(model, PEERS[1], *args)) + FLOOR


@EACH
@pytest.mark.parametrize("model", MODELS)
def test_greedy_tokens_and_logprobs_agree_with_vllm_backends(gpu_run, model):
    ours = gpu_run(model, "CUSTOM")
    assert ours["atom"]["long"]["counters"]["batches"] > 0, "our backend did not run"
    assert_agree(ours, {p: gpu_run(model, p) for p in PEERS}, _tolerance(gpu_run, model), f"{model} CUSTOM")


@pytest.mark.engines((None, "CUSTOM"))
@pytest.mark.parametrize("model", MODELS)
def test_cuda_graphs_and_every_request_complete(gpu_run, model):
    r = gpu_run(model, "CUSTOM")
    assert "FULL" in r["cudagraph_mode"], r["cudagraph_mode"]
    assert len(r["phases"]["burst"]) == 256
    assert all(len(q["tokens"]) == 16 for q in _requests(r))


@pytest.mark.engines((None, "CUSTOM"))
@pytest.mark.parametrize("model", MODELS)
def test_prefix_cache_hit_is_served_by_varlen(gpu_run, model):
    """The second prefix request shares 1024 tokens (64 blocks of 16) with the first: vLLM reports
    the hit and our plan sends its prefill (60 new tokens over 1024 cached) to the varlen path."""
    r = gpu_run(model, "CUSTOM")
    assert r["phases"]["prefix_second"][0]["num_cached_tokens"] == 1024
    prefills = [tuple(p) for p in r["atom"]["prefix_second"]["prefills"]]
    assert any(new == 60 and cached == 1024 and path == "varlen" for new, cached, path, _ in prefills), prefills


@pytest.mark.engines((None, "CUSTOM"))
@pytest.mark.parametrize("model", MODELS)
def test_chunked_long_request_attends_to_its_earlier_chunks(gpu_run, model):
    """32000 tokens under a 2048-token budget: 16 chunks, each after the first a prefill over cached
    keys (sq < sk); all of them planned, none refused."""
    r = gpu_run(model, "CUSTOM")
    chunks = [p for p in r["atom"]["long"]["prefills"] if p[0] + p[1] > 2048]
    assert len(chunks) >= 15, chunks
    assert all(p[2] in ("varlen", "unified") for p in chunks)
    assert len(r["phases"]["long"][0]["tokens"]) == 16


@pytest.mark.engines((None, "CUSTOM"))
@pytest.mark.parametrize("model", MODELS)
def test_no_compile_or_fallback_after_warmup(gpu_run, model):
    a = gpu_run(model, "CUSTOM")["atom"]
    assert a["warmup"]["fallbacks"] == a["long"]["fallbacks"] == 0, a["long"]
    assert a["long"]["compiles"] == a["warmup"]["compiles"], (a["warmup"]["compiles"], a["long"]["compiles"])
    assert not a["long"]["failed_paths"]


FP8 = ("--kv-cache-dtype", "fp8")
FP8_16BIT = (*FP8, "--setting", "ATOM_FP8_COMPUTE=0")


@pytest.mark.engines(("llama", "CUSTOM", *FP8_16BIT), *[("llama", b, *FP8) for b in PEERS])
def test_fp8_kv_cache_agrees_with_vllm_backends(gpu_run):
    """FP8 storage with 16-bit compute (our FP8 prefill compute off): the cache's e4m3 values
    dequantized and attended in bf16 with fp32 sums, the rounding points of vLLM's backends over
    the same cache, so the module's tolerance holds as it does for bf16."""
    ours = gpu_run("llama", "CUSTOM", *FP8_16BIT)
    assert ours["atom"]["long"]["counters"]["batches"] > 0
    assert_agree(ours, {p: gpu_run("llama", p, *FP8) for p in PEERS}, _tolerance(gpu_run, "llama", *FP8), "fp8 KV")


@pytest.mark.engines(("llama", "CUSTOM", *FP8), *[("llama", b, *FP8) for b in PEERS])
def test_fp8_compute_agrees_with_vllm_backends(gpu_run):
    """FP8 compute on (the default): varlen prefill rounds Q and P to e4m3 too, an error of ~3-4%
    of the attention output (docs/fp8.md) where vLLM's backends differ from each other less; the
    same tolerance then says whether a model's tokens still agree."""
    ours = gpu_run("llama", "CUSTOM", *FP8)
    assert ours["atom"]["long"]["counters"]["batches"] > 0
    assert_agree(ours, {p: gpu_run("llama", p, *FP8) for p in PEERS}, _tolerance(gpu_run, "llama", *FP8),
                 "fp8 compute")


@pytest.mark.engines(("llama", "CUSTOM", "--ngram", "3"), *[("llama", b) for b in ("CUSTOM", *PEERS)])
def test_ngram_speculative_decoding_under_full_cuda_graphs(gpu_run):
    """Three ngram tokens per step (UNIFORM_BATCH graphs of 4 query tokens): proposals are
    accepted, and greedy output agrees with the same backend without speculation."""
    spec = gpu_run("llama", "CUSTOM", "--ngram", "3")
    assert "FULL" in spec["cudagraph_mode"], spec["cudagraph_mode"]
    accepted = sum(v for k, v in spec["spec"].items() if "accepted" in k)
    assert accepted > 0, spec["spec"]
    assert_agree(spec, {"CUSTOM": gpu_run("llama", "CUSTOM")}, _tolerance(gpu_run, "llama"), "CUSTOM ngram")


def _total(series: dict[str, float], name: str, *labels: str) -> float:
    return sum(v for k, v in series.items() if k.split("{")[0] == name and all(lb in k for lb in labels))


def test_openai_server_and_metrics_on_the_gpu(gpu_models, tmp_path):
    """`vllm serve` as docs/vllm.md gives it for a GPU (the one flag, nothing else arranged), then
    a prompt and a second one sharing its first 1024 tokens through the OpenAI API: between the two
    scrapes /metrics shows vLLM's prefix-cache hit, one prefill routed to varlen and the cached keys
    gathered for it."""
    from conftest import post_json, scrape, serve

    shared = " ".join(f"w{i % 256}" for i in range(1024))
    varlen = ('phase="prefill"', 'path="varlen"')
    with serve(gpu_models["llama"], tmp_path / "server.log", base_args=("--max-model-len", "4096"),
               ready_timeout=600) as base:
        def ask(own: str) -> dict[str, float]:
            resp = post_json(base, "/v1/completions", {"model": "tiny", "prompt": shared + " " + own,
                                                       "max_tokens": 8, "temperature": 0})
            assert resp["usage"]["completion_tokens"] == 8, resp
            return scrape(base)

        first, second = ask("w1 w2 w3"), ask("w7 w8 w9 w10 w11")
    text = (tmp_path / "server.log").read_text()
    # vLLM's own selection line on a GPU platform, then our kernels' warm-up line
    assert "Using AttentionBackendEnum.CUSTOM backend" in text, text[-3000:]
    assert re.search(r"atom-backend: \d+ kernel variants ready for sm_", text), text[-3000:]
    assert _total(second, "vllm:prefix_cache_hits_total") - _total(first, "vllm:prefix_cache_hits_total") >= 1024
    routed = _total(second, "atom_routed_requests_total", *varlen) - _total(first, "atom_routed_requests_total", *varlen)
    assert routed >= 1, sorted(k for k in second if k.startswith("atom_routed"))
    gathered = _total(second, "atom_gathered_tokens_total") - _total(first, "atom_gathered_tokens_total")
    assert gathered >= 1024, gathered
