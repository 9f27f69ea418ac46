"""deploy/: the dashboard (Grafana SDK model, every queried metric exists in our exposition),
Prometheus config (promtool), compose (compose-spec schema), Kubernetes manifests
(kubernetes-validate, strict), Dockerfiles (hadolint) and the warm-up guard.

The validators are real tools installed by .ci/run; outside CI a missing one skips its test,
in CI (CI=true) it fails, so a green CI never hides an unvalidated file."""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from atom_backend.metrics import Metrics
from atom_backend.planning import ModelFacts, PlannerConfig, plan
from atom_backend.catalog import platform_for

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "atom-backend.json"
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def need(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        if IN_CI:
            pytest.fail(f"{tool} is not installed; .ci/run must install it")
        pytest.skip(f"{tool} is not installed")
    return path


def need_module(name: str):
    try:
        return __import__(name, fromlist=["_"])
    except ImportError:
        if IN_CI:
            pytest.fail(f"python package for {name} is not installed; .ci/run must install it")
        pytest.skip(f"{name} is not installed")


# -- dashboard -----------------------------------------------------------------------------

PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "offset", "bool", "and", "or", "unless", "inf", "nan"}


def dashboard_exprs(dash: dict) -> list[str]:
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    for v in dash["templating"]["list"]:
        if v.get("type") == "query":
            exprs.append(re.sub(r"^label_values\((.*),\s*\w+\)$", r"\1", v["query"]))
    return exprs


def promql_metric_names(expr: str) -> set[str]:
    """Metric names an expression selects: identifiers left after removing strings, label
    matchers, range/offset durations, grouping clauses, functions and keywords."""
    s = re.sub(r'"(?:\\.|[^"\\])*"', '""', expr)
    s = re.sub(r"\{[^}]*\}", " ", s)
    s = re.sub(r"\[[^\]]*\]", " ", s)
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", s):
        rest = s[m.end():].lstrip()
        if rest.startswith("(") or m.group(0).lower() in PROMQL_WORDS:
            continue
        if m.start() > 0 and (s[m.start() - 1].isdigit() or s[m.start() - 1] in ".$"):
            continue  # 1e-3, $__rate_interval
        names.add(m.group(0))
    return names


def test_promql_name_parser():
    assert promql_metric_names('histogram_quantile(0.99, sum by (le, path) (rate(a_bucket{x=~"$i", y="{b}"}[$__rate_interval])))') == {"a_bucket"}
    assert promql_metric_names("sum(rate(x_sum[5m])) / sum(rate(x_count[5m] offset 1m)) > bool 0") == {"x_sum", "x_count"}
    assert promql_metric_names("up") == {"up"}


def live_sample_names() -> set[str]:
    """Sample names of a registry after recording every kind of event once."""
    reg = CollectorRegistry()
    m = Metrics(reg, sample_rate=1.0, device_timing=False)
    facts = ModelFacts(num_q_heads=8, num_kv_heads=2, head_dim=64)
    m.record_plan(plan([300, 1, 1, 3, 200], [40, 900, 100, 10, 64 * 200 + 1], facts, platform_for("sm_90a", use_tables=False), PlannerConfig()), 1e-5)
    fp8 = ModelFacts(num_q_heads=32, num_kv_heads=8, head_dim=128, kv_dtype="fp8_e4m3", kv_scale_mode="per_tensor")
    m.record_plan(plan([300], [40], fp8, platform_for("sm_90a", use_tables=False), PlannerConfig()), 1e-5)
    m.record_fallback("kernel_unavailable", "unified")
    m.record_compile("decode", 0.1, cache_hit=False)
    m.record_compile("decode", 0.01, cache_hit=True)
    with m.kernel_timer("varlen"):
        pass
    from prometheus_client import generate_latest

    return {s.name for f in text_string_to_metric_families(generate_latest(reg).decode()) for s in f.samples}


def test_dashboard_queries_only_metrics_we_export():
    dash = json.loads(DASHBOARD.read_text())
    exprs = dashboard_exprs(dash)
    assert len(exprs) >= 12
    referenced = set().union(*map(promql_metric_names, exprs))
    live = live_sample_names()
    assert referenced, exprs
    assert referenced <= live, f"queried but never exported: {sorted(referenced - live)}"
    # Each thing the issue asks the dashboard to show is queried.
    for needed in ("atom_tokens_total", "atom_batches_total", "atom_routed_tokens_total", "atom_routed_requests_total",
                   "atom_gathered_bytes_total", "atom_varlen_compute_requests_total",
                   "atom_kernel_seconds_bucket", "atom_decode_num_splits_bucket", "atom_kernel_compiles_total"):
        assert needed in referenced
    assert any(e.startswith("histogram_quantile(0.99") and "atom_kernel_seconds_bucket" in e for e in exprs)


def test_dashboard_never_adds_layer_kinds_together():
    """Each layer kind plans the same step: a routing panel summing kinds would count it twice.
    Every query of a series with the layer_kind label keeps it, and the routing row repeats per kind."""
    dash = json.loads(DASHBOARD.read_text())
    kind_series = {"atom_batches_total", "atom_routed_tokens_total", "atom_routed_requests_total",
                   "atom_varlen_compute_requests_total", "atom_gathered_bytes_total", "atom_gathered_tokens_total",
                   "atom_decode_num_splits_bucket", "atom_decode_num_splits_sum", "atom_decode_num_splits_count"}
    checked = 0
    for p in dash["panels"]:
        for t in p.get("targets", []):
            if promql_metric_names(t["expr"]) & kind_series:
                groups = re.findall(r"\bby\s*\(([^)]*)\)", t["expr"])
                assert groups and all("layer_kind" in g for g in groups), t["expr"]
                checked += 1
    assert checked >= 6
    rows = [p for p in dash["panels"] if p["type"] == "row" and p.get("repeat") == "layer_kind"]
    assert len(rows) == 1 and "layer_kind" in {v["name"] for v in dash["templating"]["list"]}


def test_dashboard_matches_grafana_sdk_model():
    """The SDK's models are generated from Grafana's dashboard schema; a field outside it is
    dropped by from_json, so the round trip must be lossless. The committed JSON must also be
    what the generator writes (nobody hand-edits it)."""
    need_module("grafana_foundation_sdk")
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models.dashboard import Dashboard

    raw = json.loads(DASHBOARD.read_text())
    again = json.loads(json.dumps(Dashboard.from_json(raw), cls=JSONEncoder))
    assert again == raw
    assert raw["uid"] == "atom-backend" and raw["schemaVersion"] >= 36
    assert len({p["id"] for p in raw["panels"]}) == len(raw["panels"])
    for p in raw["panels"]:
        if p["type"] != "row":
            assert p["datasource"] == {"type": "prometheus", "uid": "prometheus"}
            assert [t["refId"] for t in p["targets"]] == sorted({t["refId"] for t in p["targets"]})

    sys.path.insert(0, str(DEPLOY / "grafana"))
    try:
        import build_dashboard
    finally:
        sys.path.pop(0)
    assert build_dashboard.render() == DASHBOARD.read_text(), "run python deploy/grafana/build_dashboard.py"

    broken = copy.deepcopy(raw)
    broken["panels"][1]["notAGrafanaField"] = 1
    assert json.loads(json.dumps(Dashboard.from_json(broken), cls=JSONEncoder)) != broken


def test_grafana_provisioning_points_at_dashboard_and_datasource():
    ds = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yaml").read_text())
    prov = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/atom.yaml").read_text())
    assert ds["apiVersion"] == 1 and ds["datasources"][0]["uid"] == "prometheus"
    assert ds["datasources"][0]["url"] == "http://prometheus:9090"
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    mounts = dict(v.rsplit(":", 2)[:2] for v in compose["services"]["grafana"]["volumes"])
    assert mounts["./grafana/dashboards"] == prov["providers"][0]["options"]["path"]
    assert mounts["./grafana/provisioning"] == "/etc/grafana/provisioning"


# -- Prometheus, compose, Kubernetes, Dockerfiles ------------------------------------------

def test_promtool_accepts_prometheus_config(tmp_path):
    promtool = need("promtool")
    r = subprocess.run([promtool, "check", "config", str(DEPLOY / "prometheus/prometheus.yml")], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stdout + r.stderr
    bad = yaml.safe_load((DEPLOY / "prometheus/prometheus.yml").read_text())
    bad["scrape_configs"][0]["scrape_timeout"] = "10s"  # longer than the 5 s interval
    (tmp_path / "bad.yml").write_text(yaml.safe_dump(bad))
    r = subprocess.run([promtool, "check", "config", str(tmp_path / "bad.yml")], capture_output=True, text=True, timeout=30)
    assert r.returncode != 0


def test_compose_file_matches_compose_spec(tmp_path):
    tool = need("check-jsonschema")
    compose = DEPLOY / "compose.yaml"
    r = subprocess.run([tool, "--builtin-schema", "vendor.compose-spec", str(compose)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    doc = yaml.safe_load(compose.read_text())
    bad = copy.deepcopy(doc)
    bad["services"]["prometheus"]["ports"] = {"9090": 9090}  # must be a list
    (tmp_path / "compose.yaml").write_text(yaml.safe_dump(bad))
    r = subprocess.run([tool, "--builtin-schema", "vendor.compose-spec", str(tmp_path / "compose.yaml")], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0

    svc = doc["services"]
    assert {"vllm-cuda", "vllm-rocm", "prometheus", "grafana"} <= set(svc)
    for name, vendor_key in (("vllm-cuda", "deploy"), ("vllm-rocm", "devices")):
        s = svc[name]
        assert "vllm" in s["networks"]["default"]["aliases"]
        assert (DEPLOY.parent / s["build"]["context"].replace("..", ".") / s["build"]["dockerfile"]).exists()
        assert vendor_key in s
    assert svc["vllm-cuda"]["deploy"]["resources"]["reservations"]["devices"][0]["driver"] == "nvidia"
    assert "/dev/kfd" in svc["vllm-rocm"]["devices"]
    # Every bind-mounted path of the stack exists in the repository.
    for s in svc.values():
        for v in s.get("volumes", []):
            src = v.split(":")[0]
            if src.startswith("./"):
                assert (DEPLOY / src).exists(), src
    prom = yaml.safe_load((DEPLOY / "prometheus/prometheus.yml").read_text())
    assert prom["scrape_configs"][0]["static_configs"][0]["targets"] == ["vllm:8000"]


def k8s_docs() -> dict[str, dict]:
    out = {}
    for f in sorted((DEPLOY / "k8s").glob("*.yaml")):
        for d in yaml.safe_load_all(f.read_text()):
            out[f"{d['kind']}/{d['metadata']['name']}"] = d
    return out


def test_kubernetes_manifests_validate_strictly(tmp_path):
    kv = need_module("kubernetes_validate")
    docs = k8s_docs()
    core = {k: d for k, d in docs.items() if not d["apiVersion"].startswith("monitoring.coreos.com")}
    assert set(core) == {"Deployment/atom-vllm-cuda", "Deployment/atom-vllm-rocm", "Service/atom-vllm"}
    for name, d in core.items():
        kv.validate(d, "1.30.0", strict=True)  # raises ValidationError with the path
        kv.validate(d, "1.37.0", strict=True)
    bad = copy.deepcopy(docs["Deployment/atom-vllm-cuda"])
    bad["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["pathh"] = "/health"
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, "1.37.0", strict=True)


def test_kubernetes_manifests_fit_together():
    docs = k8s_docs()
    svc = docs["Service/atom-vllm"]
    sm = docs["ServiceMonitor/atom-vllm"]  # a CRD: no schema in kubernetes-validate, so checked here
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert {e["port"] for e in sm["spec"]["endpoints"]} <= {p["name"] for p in svc["spec"]["ports"]}
    assert all(e["path"] == "/metrics" for e in sm["spec"]["endpoints"])
    for vendor, gpu in (("cuda", "nvidia.com/gpu"), ("rocm", "amd.com/gpu")):
        dep = docs[f"Deployment/atom-vllm-{vendor}"]
        pod = dep["spec"]["template"]
        assert dep["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
        assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
        c = pod["spec"]["containers"][0]
        assert c["image"] == f"atom-backend:{vendor}"
        assert c["resources"]["limits"][gpu] == 1 and c["resources"]["requests"][gpu] == 1
        assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(ports["http"])
        env = {e["name"]: e.get("value") for e in c["env"]}
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        vols = {v["name"]: v for v in pod["spec"]["volumes"]}
        assert "emptyDir" in vols[mounts[env["PROMETHEUS_MULTIPROC_DIR"]]]  # fresh per pod
        other = "amd.com/gpu" if gpu == "nvidia.com/gpu" else "nvidia.com/gpu"
        assert other not in c["resources"]["limits"]


def test_yaml_lint(tmp_path):
    tool = need("yamllint")
    files = [str(p) for p in DEPLOY.rglob("*.y*ml")]
    conf = "{extends: default, rules: {line-length: {max: 140}, document-start: disable, comments: {min-spaces-from-content: 1}, truthy: {check-keys: false}}}"
    r = subprocess.run([tool, "-s", "-d", conf, *files], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("vendor", ["cuda", "rocm"])
def test_dockerfiles_lint_and_serve_our_backend(vendor):
    hadolint = need("hadolint")
    f = DEPLOY / f"Dockerfile.{vendor}"
    r = subprocess.run([hadolint, "--failure-threshold", "warning", str(f)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    text = f.read_text()
    base = re.search(r"^ARG VLLM_IMAGE=(\S+)", text, re.M).group(1)
    assert base.startswith("vllm/vllm-openai-rocm:" if vendor == "rocm" else "vllm/vllm-openai:")
    assert f'".[{vendor}]"' in text and "warmup.sh" in text and 'ENTRYPOINT ["/opt/atom-backend/entrypoint.sh"]' in text
    for copied in re.findall(r"^COPY (.+) \S+$", text, re.M):
        for src in copied.split():
            assert (ROOT / src).exists(), src
    entry = (DEPLOY / "entrypoint.sh").read_text()
    assert "--attention-backend CUSTOM" in entry and "PROMETHEUS_MULTIPROC_DIR" in entry


def test_warmup_is_guarded(tmp_path):
    env = dict(os.environ, WARMUP_DRY_RUN="1", PYTHONPATH=str(ROOT))
    r = subprocess.run(["sh", str(DEPLOY / "warmup.sh"), "sm_90a", "gfx942"], capture_output=True, text=True, env=env, timeout=60, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert re.search(r"-m (atom_backend\.catalog build|hip_kernels\.variants) --arch sm_90a --arch gfx942", r.stdout), r.stdout
    # A package without any warm-up command: the image still builds and says why.
    bare = tmp_path / "python-without-site"
    bare.write_text(f"#!/bin/sh\nexec {sys.executable} -S \"$@\"\n")
    bare.chmod(0o755)
    env = dict(os.environ, PYTHON=str(bare), PYTHONPATH="")
    r = subprocess.run(["sh", str(DEPLOY / "warmup.sh"), "sm_90a"], capture_output=True, text=True, env=env, timeout=60, cwd=tmp_path)
    assert r.returncode == 0 and "no kernel build command" in r.stdout, r.stdout + r.stderr
    r = subprocess.run(["sh", str(DEPLOY / "warmup.sh")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
