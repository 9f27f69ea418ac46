"""vLLM's real engine (scheduler, KV-cache manager, prefix caching, chunked prefill) on the CPU,
with our backend selected by ``attention_config={"backend": "CUSTOM"}``, against vLLM's own
CPU backend on the same machine and release, on tiny random-weight models built at test time.
Each test runs under every vLLM interpreter (``conftest.vllm_pythons``: vLLM 0.32 and 0.27 in
CI); the three tests of one interpreter and model share its engine runs."""

from __future__ import annotations

import sys

import pytest

from conftest import assert_same_greedy


pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODELS = ["llama", "gptoss"]


# vLLM's own CPU attention takes a fp32 model's sinks from 0.31 on (it casts them to fp32; 0.27's
# kernel stops with "expected scalar type BFloat16 but found Float").
OWN_CPU_FP32_SINKS_SINCE = (0, 31)


def _reference(engine_run, vllm_python: str, model: str) -> dict:
    """vLLM's own CPU attention on the same model: on the same release, except where that release's
    cannot run the model; then on this interpreter's release (same model files, same prompts)."""
    from conftest import vllm_version_of

    from atom_backend.vllm import compat

    if model == "gptoss" and compat.parse_version(vllm_version_of(vllm_python))[:2] < OWN_CPU_FP32_SINKS_SINCE:
        here = compat.parse_version(vllm_version_of(sys.executable))
        assert here and here[:2] >= OWN_CPU_FP32_SINKS_SINCE, f"no vLLM >= 0.31 here to serve the {model} reference"
        return engine_run(model, "default", sys.executable)
    return engine_run(model, "default", vllm_python)


@pytest.mark.parametrize("model", MODELS)
def test_greedy_tokens_and_logprobs_match_vllm_cpu_backend(engine_run, vllm_python, model):
    ours, ref = engine_run(model, "CUSTOM", vllm_python), _reference(engine_run, vllm_python, model)
    assert "atom" in ours and ours["atom"]["counters"]["batches"] > 0, "our backend did not run"
    assert "atom" not in ref or ref["atom"]["counters"]["batches"] == 0, "the reference run used our backend"
    assert_same_greedy(ours, ref, model)  # fp32 end to end


@pytest.mark.parametrize("model", MODELS)
def test_prefix_cache_hit_is_served_by_varlen(engine_run, vllm_python, model):
    """The second request shares 3 blocks (96 tokens) with the first: vLLM reports the hit and
    our plan sends that prefill (40 new tokens over 96 cached) to the varlen path. gpt-oss has
    sinks and a sliding window, so this is also the sinks + prefix-hit case."""
    r = engine_run(model, "CUSTOM", vllm_python)
    assert r["second"]["num_cached_tokens"] == 96
    prefills = [tuple(x) for x in r["atom"]["second_prefills"]]
    assert (40, 96, "varlen", "preferred") in prefills, prefills
    assert all(path != "unified" for _, cached, path, _ in prefills if cached == 96), prefills
    c = r["atom"]["counters"]
    assert c["varlen_prefix_hit_requests"] >= 1
    assert r["atom"]["gather"]["tokens"] > 0


@pytest.mark.parametrize("model", MODELS)
def test_mixed_batches_are_split_by_route(engine_run, vllm_python, model):
    """Five prompts at once under a 64-token budget: decodes and prefill chunks share batches,
    and each batch is split into routes (never serialised into one path)."""
    c = engine_run(model, "CUSTOM", vllm_python)["atom"]["counters"]
    assert c["mixed_batches"] > 0, c
    assert c["decode_requests"] > 0 and c["varlen_requests"] > 0, c
