"""Shared fixtures: tiny models built once per session, engine runs cached per (model, backend).

Every engine runs in its own subprocess (``runner.py``): vLLM's engine state and our
per-process counters stay isolated, and a crash fails one test with the log attached.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
RUN_TIMEOUT_S = 240

pytestmark = pytest.mark.integration


def _needs_vllm():
    pytest.importorskip("vllm")
    pytest.importorskip("transformers")


def plugin_pythonpath(tmp: Path) -> list[str]:
    """Paths to prepend to PYTHONPATH: the repo, and a throwaway dist-info declaring our
    ``vllm.platform_plugins`` entry point when the installed package does not declare it yet."""
    paths = [str(ROOT)]
    if not any(ep.value.startswith("atom_backend.platform_cpu") for ep in entry_points(group="vllm.platform_plugins")):
        d = tmp / "plugins" / "atom_platform_shim-0.0.dist-info"
        d.mkdir(parents=True, exist_ok=True)
        (d / "METADATA").write_text("Metadata-Version: 2.1\nName: atom-platform-shim\nVersion: 0.0\n")
        (d / "entry_points.txt").write_text("[vllm.platform_plugins]\natom_cpu = atom_backend.platform_cpu:cpu_platform\n")
        paths.insert(0, str(tmp / "plugins"))
    return paths


def engine_env(tmp: Path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k.lower() != "prometheus_multiproc_dir"}
    env["PYTHONPATH"] = os.pathsep.join(plugin_pythonpath(tmp) + [env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
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
            env = engine_env(work_dir, VLLM_ENABLE_V1_MULTIPROCESSING="0")
            p = subprocess.run([sys.executable, str(HERE / "runner.py"), str(tiny_models[model]), "--backend", backend],
                               env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, cwd=str(work_dir))
            lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
            assert p.returncode == 0 and lines, f"{model}/{backend} failed (rc={p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
            cache[(model, backend)] = json.loads(lines[-1][len("RESULT "):])
        return cache[(model, backend)]

    return run
