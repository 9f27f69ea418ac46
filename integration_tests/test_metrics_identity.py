"""The atom_* counters against vLLM's own, on a served model of one KV-cache group (Llama-like)
and one of two (gpt-oss-like: window layers and full layers with sinks, one group each): a
burst of concurrent requests with prefix hits, then the identity docs/metrics.md states

    atom_tokens_total = prompt tokens - cached prompt tokens + generated tokens - requests

exactly, per phase too, and the routing series labelled by the layer kinds the model has."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import post_json, scrape, serve

pytestmark = [pytest.mark.integration, pytest.mark.slow]

BLOCK = 32  # CPU_SERVE_ARGS' --block-size: prefix hits come in whole blocks


def _sum(series: dict[str, float], name: str, **labels) -> float:
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(v for k, v in series.items() if k.split("{")[0] == name and all(w in k for w in want))


def _label_values(series: dict[str, float], name: str, label: str) -> set[str]:
    """Values of `label` on the series of `name` that counted something."""
    out = set()
    for k, v in series.items():
        if k.split("{")[0] == name and v > 0 and f'{label}="' in k:
            out.add(k.split(f'{label}="', 1)[1].split('"', 1)[0])
    return out


def _requests() -> tuple[list[dict], list[dict]]:
    """(warm-ups, burst) completions of token-id prompts: two shared prefixes of whole blocks
    (2 and 3 blocks) with suffixes of 3..21 tokens, and a few prompts sharing nothing. The
    warm-ups put each prefix in the cache before the burst. No prompt leaves a single token to
    compute after its hit (that one-token prefill would be planned as a decode)."""
    prefixes = [[(7 * i) % 250 for i in range(2 * BLOCK)], [(11 * i + 3) % 250 for i in range(3 * BLOCK)]]

    def req(prompt, n):
        return {"model": "tiny", "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True}

    warm = [req(p + [1, 2, 3], 4) for p in prefixes]
    burst = [req(prefixes[i % 2] + [(13 * i + j) % 250 for j in range(3 + i)], 4 + i % 5) for i in range(14)]
    burst += [req([(17 * i + 5 * j + 1) % 250 for j in range(20 + 9 * i)], 5 + i) for i in range(4)]
    return warm, burst


def _settled(base: str, generated: int, deadline_s: float = 20.0) -> dict[str, float]:
    """/metrics once vLLM's front end has counted every generated token (its stats trail the
    responses by an iteration)."""
    end = time.monotonic() + deadline_s
    while True:
        series = scrape(base)
        if _sum(series, "vllm:generation_tokens_total") >= generated or time.monotonic() > end:
            return series
        time.sleep(0.5)


def _serve_burst(model_dir, log) -> tuple[dict[str, float], list[dict]]:
    warm, burst = _requests()
    with serve(model_dir, log) as base:
        done = [post_json(base, "/v1/completions", r) for r in warm]
        with ThreadPoolExecutor(len(burst)) as pool:
            done += list(pool.map(lambda r: post_json(base, "/v1/completions", r), burst))
        series = _settled(base, sum(r["usage"]["completion_tokens"] for r in done))
    for r, want in zip(done, warm + burst):
        assert r["usage"]["completion_tokens"] == want["max_tokens"], r
        assert r["usage"]["prompt_tokens"] == len(want["prompt"]), r
    return series, done


def _check_identity(series: dict[str, float], done: list[dict]) -> dict:
    prompt = _sum(series, "vllm:prompt_tokens_total")
    cached = _sum(series, "vllm:prompt_tokens_cached_total")
    generated = _sum(series, "vllm:generation_tokens_total")
    requests = len(done)
    prefill = _sum(series, "atom_tokens_total", phase="prefill")
    decode = _sum(series, "atom_tokens_total", phase="decode")
    got = dict(prompt=prompt, cached=cached, generated=generated, requests=requests, prefill=prefill, decode=decode)
    assert prompt == sum(r["usage"]["prompt_tokens"] for r in done), got
    assert generated == sum(r["usage"]["completion_tokens"] for r in done), got
    assert cached > 0 and _sum(series, "vllm:prefix_cache_hits_total") > 0, got  # the burst hit the prefixes
    assert prefill + decode == prompt - cached + generated - requests, got
    assert prefill == prompt - cached, got
    assert decode == generated - requests, got
    # The routing series split the same tokens by path, once per layer kind.
    for kind in _label_values(series, "atom_batches_total", "layer_kind"):
        assert _sum(series, "atom_routed_tokens_total", phase="prefill", layer_kind=kind) == prefill, (kind, got)
        assert _sum(series, "atom_routed_tokens_total", phase="decode", layer_kind=kind) == decode, (kind, got)
    return got


def test_llama_counts_every_token_once(tiny_models, tmp_path):
    series, done = _serve_burst(tiny_models["llama"], tmp_path / "server.log")
    got = _check_identity(series, done)
    assert _label_values(series, "atom_batches_total", "layer_kind") == {"full"}, got
    assert _label_values(series, "atom_routed_requests_total", "layer_kind") == {"full"}, got


def test_gptoss_counts_every_token_once_and_labels_its_layer_kinds(tiny_models, tmp_path):
    series, done = _serve_burst(tiny_models["gptoss"], tmp_path / "server.log")
    got = _check_identity(series, done)
    # vLLM's hybrid allocator gives the window layers and the full (sink) layers a group each.
    assert _label_values(series, "atom_batches_total", "layer_kind") == {"window", "sinks"}, got
    assert _label_values(series, "atom_routed_requests_total", "layer_kind") == {"window", "sinks"}, got
    assert _label_values(series, "atom_gathered_bytes_total", "layer_kind") <= {"window", "sinks"}, got
