"""End to end with vLLM's real OpenAI server (vLLM's CPU build): atom_* values recorded in the
engine-core and worker processes appear on the API server's /metrics when
PROMETHEUS_MULTIPROC_DIR is set, as deploy/entrypoint.sh sets it.

A probe general plugin (a throwaway dist-info on PYTHONPATH) records one metric per process
that loads plugins, labelled with the process name. ~30 s on 2 cores: marked integration."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[1]

PLUGIN = '''
import multiprocessing
def register():
    from atom_backend import metrics
    metrics.record_compile("probe-" + multiprocessing.current_process().name, 0.001, cache_hit=True)
'''


def _tiny_model(d: Path) -> None:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(256)} | {"<unk>": 256, "<s>": 257, "</s>": 258}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>").save_pretrained(d)
    cfg = LlamaConfig(vocab_size=259, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, bos_token_id=257, eos_token_id=258)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(d)


def test_worker_metrics_on_api_server_metrics(tmp_path):
    pytest.importorskip("vllm.entrypoints.openai.api_server")
    pytest.importorskip("transformers")
    model, plug, mp = tmp_path / "model", tmp_path / "plugins", tmp_path / "multiproc"
    _tiny_model(model)
    (plug / "atomprobe-0.0.dist-info").mkdir(parents=True)
    (plug / "atomprobe_plugin.py").write_text(PLUGIN)
    (plug / "atomprobe-0.0.dist-info/METADATA").write_text("Metadata-Version: 2.1\nName: atomprobe\nVersion: 0.0\n")
    (plug / "atomprobe-0.0.dist-info/entry_points.txt").write_text("[vllm.general_plugins]\natomprobe = atomprobe_plugin:register\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k.lower() != "prometheus_multiproc_dir"}
    env.update(PROMETHEUS_MULTIPROC_DIR=str(mp), PYTHONPATH=os.pathsep.join([str(plug), str(ROOT)]), VLLM_CPU_KVCACHE_SPACE="1")
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
         "--port", str(port), "--dtype", "float32", "--enforce-eager", "--max-model-len", "128",
         "--kv-cache-memory-bytes", str(256 << 20)],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()[-4000:]
            try:
                if urllib.request.urlopen(base + "/health", timeout=2).status == 200:
                    break
            except OSError:
                time.sleep(1)
        else:
            pytest.fail("vLLM server not healthy in 150 s:\n" + (tmp_path / "server.log").read_text()[-4000:])
        text = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)  # the server and the engine processes it started
            proc.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        log.close()
    probes = {line.split('kernel="')[1].split('"')[0] for line in text.splitlines()
              if line.startswith("atom_kernel_cache_hits_total{")}
    assert "probe-EngineCore" in probes, text[:3000]  # recorded in another process than the server's
    assert "atom_batches_total" in text
    assert "vllm:" in text  # vLLM's own series are still there
