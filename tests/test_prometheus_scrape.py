"""A real Prometheus server (Debian's `prometheus`) on loopback scrapes a process exposing
our metrics the way the deployment does (multiprocess directory, values written by a
separate "worker" process), and returns our series through its HTTP API. Every dashboard
query then runs against it: it must parse and return data.

Bounded: each wait has a deadline, and both processes are always killed."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

WORKER = """
import json
from atom_backend import metrics
from atom_backend.planning import ModelFacts, PlannerConfig, plan
from atom_backend.catalog import platform_for
facts = ModelFacts(num_q_heads=16, num_kv_heads=4, head_dim=64)
p = plan([256, 1, 1, 1, 4, 9], [0, 300, 2000, 40, 10, 64 * 9 + 1], facts, platform_for("sm_90a", use_tables=False), PlannerConfig())
for _ in range(3):
    metrics.record_plan(p, 2e-5)  # a model of one layer kind, one layer
    # the same steps planned by a second KV-cache group (window layers) of two layers
    metrics.record_plan(p, 2e-5, layer_kind="window", step=False, layers=2)
metrics.record_fallback("kernel_unavailable", "unified")
metrics.record_compile("decode", 0.8, cache_hit=False)
metrics.record_compile("gather", 0.01, cache_hit=True)
for path in ("varlen", "splitkv", "unified"):
    with metrics.kernel_timer(path):
        sum(range(2000))
print(json.dumps(dict(varlen_tokens=p.varlen_tokens, prefill_tokens=p.varlen_tokens + p.unified_tokens,
                      gather_bytes=p.gather_bytes, num_splits=p.num_splits)))
"""

# The API server side: serves the multiprocess directory until killed, and keeps recording
# a little so that rate() over the scrapes is not flat zero.
EXPORTER = """
import sys, time
from atom_backend import metrics
server, thread = metrics.start_http_server(int(sys.argv[1]), addr="127.0.0.1")
print("ready", flush=True)
deadline = time.monotonic() + float(sys.argv[2])
while time.monotonic() < deadline:
    metrics.record_compile("gather", 0.001, cache_hit=True)
    time.sleep(0.5)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str, timeout: float = 5.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def wait_for(fn, deadline_s: float, what: str):
    end = time.monotonic() + deadline_s
    last = None
    while time.monotonic() < end:
        try:
            v = fn()
            if v:
                return v
        except (OSError, urllib.error.URLError, ValueError) as e:
            last = e
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what} (last error: {last})")


def stop(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory):
    exe = shutil.which("prometheus")
    if exe is None:
        if IN_CI:
            pytest.fail("prometheus is not installed; .ci/run must install Debian's prometheus")
        pytest.skip("prometheus is not installed")
    tmp = tmp_path_factory.mktemp("prom")
    mp = tmp / "multiproc"
    env = {k: v for k, v in os.environ.items() if k.lower() != "prometheus_multiproc_dir"}
    env.update(PROMETHEUS_MULTIPROC_DIR=str(mp), ATOM_METRICS_SAMPLE_RATE="1", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", WORKER], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-3000:]
    worker = json.loads(r.stdout)

    # The deployment's scrape job, pointed at the loopback exporter and scraped every second.
    cfg = yaml.safe_load((DEPLOY / "prometheus/prometheus.yml").read_text())
    exp_port, prom_port = free_port(), free_port()
    cfg["global"]["scrape_interval"] = "1s"
    job = cfg["scrape_configs"][0]
    job["scrape_timeout"] = "1s"
    job["static_configs"][0]["targets"] = [f"127.0.0.1:{exp_port}"]
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(cfg))

    exporter = server = None
    try:
        exporter = subprocess.Popen(
            [sys.executable, "-c", EXPORTER, str(exp_port), "120"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        assert exporter.stdout.readline().strip() == "ready", exporter.stderr.read()
        server = subprocess.Popen(
            [exe, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'data'}",
             f"--web.listen-address=127.0.0.1:{prom_port}", "--log.level=warn"],
            stdout=subprocess.DEVNULL, stderr=open(tmp / "prometheus.log", "w"),
        )
        base = f"http://127.0.0.1:{prom_port}"
        wait_for(lambda: urllib.request.urlopen(base + "/-/ready", timeout=2).status == 200, 30, "prometheus ready")

        def query(expr: str) -> dict:
            return get_json(base + "/api/v1/query?" + urllib.parse.urlencode({"query": expr}))

        # rate() over a window needs two scrapes of each series.
        wait_for(lambda: query("count_over_time(atom_batches_total[1m]) >= 3")["data"]["result"], 30, "three scrapes")
        yield dict(query=query, base=base, worker=worker, job=job["job_name"], log=tmp / "prometheus.log")
    finally:
        stop(server)
        stop(exporter)


def one(res: dict) -> float:
    assert res["status"] == "success", res
    vals = res["data"]["result"]
    assert len(vals) == 1, vals
    return float(vals[0]["value"][1])


def test_scraped_series_carry_worker_values(prometheus):
    q, w = prometheus["query"], prometheus["worker"]
    assert one(q(f'up{{job="{prometheus["job"]}"}}')) == 1
    assert one(q('atom_tokens_total{phase="prefill"}')) == 3 * w["prefill_tokens"]  # once per step
    for kind in ("full", "window"):
        assert one(q(f'atom_routed_tokens_total{{phase="prefill", path="varlen", layer_kind="{kind}"}}')) == 3 * w["varlen_tokens"]
        assert one(q(f'atom_routed_requests_total{{phase="decode", path="splitkv", reason="preferred", layer_kind="{kind}"}}')) == 3 * 3
        assert one(q(f'atom_routed_requests_total{{phase="prefill", path="unified", reason="small_prefill", layer_kind="{kind}"}}')) == 3
        assert one(q(f'atom_routed_requests_total{{phase="prefill", path="unified", reason="gather_cost", layer_kind="{kind}"}}')) == 3
        assert one(q(f'atom_decode_num_splits_count{{layer_kind="{kind}"}}')) == 3
        assert one(q(f'atom_decode_num_splits_sum{{layer_kind="{kind}"}}')) == 3 * w["num_splits"]
    assert one(q('atom_gathered_bytes_total{layer_kind="full"}')) == 3 * w["gather_bytes"] > 0
    assert one(q('atom_gathered_bytes_total{layer_kind="window"}')) == 3 * 2 * w["gather_bytes"]
    assert one(q('atom_fallbacks_total{reason="kernel_unavailable", path="unified"}')) == 1
    assert one(q('atom_kernel_compiles_total{kernel="decode"}')) == 1
    for path in ("varlen", "splitkv", "unified"):
        assert one(q(f'atom_kernel_seconds_count{{path="{path}"}}')) == 1
    # The label set the deployment's scrape job adds.
    res = q("atom_planner_seconds_count")["data"]["result"][0]["metric"]
    assert res["backend"] == "atom" and res["job"] == prometheus["job"]


def test_every_dashboard_query_runs(prometheus):
    dash = json.loads((DEPLOY / "grafana/dashboards/atom-backend.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    assert exprs
    for expr in exprs:
        e = expr.replace("$__rate_interval", "30s").replace('instance=~"$instance"', 'instance=~".*"')
        e = e.replace('layer_kind=~"$layer_kind"', 'layer_kind=~".*"')
        res = prometheus["query"](e)
        assert res["status"] == "success", (expr, res)
        assert res["data"]["result"], f"no series for {expr}"
    # Grafana's variable query returns our exporter's instance.
    res = get_json(prometheus["base"] + "/api/v1/label/instance/values?" + urllib.parse.urlencode({"match[]": "atom_planner_seconds_count"}))
    assert len(res["data"]) == 1 and res["data"][0].startswith("127.0.0.1:")
    # ... and the layer_kind variable's query the kinds its routing row repeats over.
    res = get_json(prometheus["base"] + "/api/v1/label/layer_kind/values?" + urllib.parse.urlencode({"match[]": "atom_batches_total"}))
    assert res["data"] == ["full", "window"]
