"""The OpenAI-compatible server started with ``--attention-backend CUSTOM`` on the CPU answers
a completion, and its /metrics shows our atom_* series recorded in the engine process
(prometheus-client multiprocess mode, as deploy/ sets it)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from conftest import engine_env

pytestmark = [pytest.mark.integration, pytest.mark.slow]
READY_TIMEOUT_S = 150


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_server_completion_and_atom_metrics(tiny_models, work_dir, tmp_path):
    port = _free_port()
    (tmp_path / "prom").mkdir()
    env = engine_env(work_dir, PROMETHEUS_MULTIPROC_DIR=str(tmp_path / "prom"))
    log_path = tmp_path / "server.log"
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_models["gptoss"]),
           "--host", "127.0.0.1", "--port", str(port), "--attention-backend", "CUSTOM", "--dtype", "float32",
           "--enforce-eager", "--max-model-len", "256", "--block-size", "32", "--kv-cache-memory-bytes", str(64 << 20),
           "--enable-prefix-caching", "--served-model-name", "tiny"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + READY_TIMEOUT_S
            while True:
                assert proc.poll() is None, log_path.read_text()[-5000:]
                try:
                    if urllib.request.urlopen(base + "/health", timeout=2).status == 200:
                        break
                except OSError:
                    pass
                assert time.monotonic() < deadline, "server not healthy in time:\n" + log_path.read_text()[-5000:]
                time.sleep(1)
            body = json.dumps({"model": "tiny", "prompt": " ".join(f"w{i}" for i in range(40)), "max_tokens": 6,
                               "temperature": 0}).encode()
            req = urllib.request.Request(base + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
            resp = json.loads(urllib.request.urlopen(req, timeout=60).read())
            metrics = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
        finally:
            try:
                os.killpg(proc.pid, signal.SIGTERM)  # the server and the engine processes it started
                proc.wait(timeout=30)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
    text = log_path.read_text()
    assert "Cannot use AttentionBackendEnum.CUSTOM" not in text, "the CPU platform ignored the selection"
    assert resp["choices"][0]["text"].strip(), resp
    assert resp["usage"]["completion_tokens"] == 6
    series = {ln.split(" ")[0]: float(ln.split(" ")[-1]) for ln in metrics.splitlines()
              if ln.startswith("atom_") and not ln.startswith("#")}
    prefill = [v for k, v in series.items() if k.startswith("atom_tokens_total{") and 'phase="prefill"' in k]
    decode = [v for k, v in series.items() if k.startswith("atom_tokens_total{") and 'phase="decode"' in k]
    assert sum(prefill) >= 40 and sum(decode) >= 5, {k: v for k, v in series.items() if "tokens" in k}
