"""A user's first serve: vLLM's OpenAI server started exactly as docs/vllm.md says, with
``--attention-backend CUSTOM``, from the package as installed. The CPU platform must honour the
selection (no fallback to vLLM's own attention), and /metrics must show the atom_* series the
engine process records beside vLLM's own, with nothing set by the test. Under every vLLM
interpreter (``conftest.vllm_pythons``)."""

from __future__ import annotations

import pytest

from conftest import post_json, scrape, serve

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _sum(series: dict[str, float], name: str, **labels) -> float:
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(v for k, v in series.items() if k.split("{")[0] == name and all(w in k for w in want))


def test_documented_serve_command_uses_the_backend_and_exports_its_metrics(tiny_models, vllm_python, tmp_path):
    log = tmp_path / "server.log"
    with serve(tiny_models["gptoss"], log, python=vllm_python) as base:
        prompt = " ".join(f"w{i}" for i in range(40))
        resp = post_json(base, "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 6,
                                                   "temperature": 0})
        series = scrape(base)
    text = log.read_text()
    assert "Cannot use AttentionBackendEnum.CUSTOM" not in text, "the CPU platform ignored the selection"
    assert "Using CUSTOM attention backend" in text, text[-3000:]
    assert resp["choices"][0]["text"].strip() and resp["usage"]["completion_tokens"] == 6, resp
    # recorded in the engine process, read by the API server through the multiprocess directory
    assert _sum(series, "atom_tokens_total", phase="prefill") >= 40, series
    assert _sum(series, "atom_tokens_total", phase="decode") >= 5, series
    # vLLM's own front-end series survive the switch to multiprocess values
    assert _sum(series, "vllm:prompt_tokens_total") >= 40, sorted(k for k in series if k.startswith("vllm:"))[:20]
    assert _sum(series, "vllm:generation_tokens_total") == 6


def test_a_bad_setting_stops_the_server_at_once_with_one_line(tiny_models, vllm_python, tmp_path):
    import subprocess

    from conftest import CPU_SERVE_ARGS, engine_env

    cmd = [vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_models["llama"]),
           "--attention-backend", "CUSTOM", *CPU_SERVE_ARGS]
    p = subprocess.run(cmd, env=engine_env(ATOM_FORCE_PATH="bogus"), capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("atom-backend:")]
    assert lines == ["atom-backend: ATOM_FORCE_PATH='bogus': use varlen, unified or leave unset"], p.stderr[-3000:]
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
