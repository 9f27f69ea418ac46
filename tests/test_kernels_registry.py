"""The kernel registry: derived from the kernel modules, validation rules with named reasons, the
planner's capabilities from it, model configs, the CLI, tables and their fallbacks, and the
ahead-of-time build leaving nothing to compile in a fresh process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from atom_backend.catalog import registry, tables, tuning
from atom_backend.planning import rules
from atom_backend.catalog.model import from_hf_config, parse_layer_windows
from atom_backend.planning.rules import Entry, PathCaps, Signature
from atom_backend.planning import ModelFacts, PlannerConfig, Reason, model_splitkv_reason, model_varlen_reason, plan
from atom_backend.unified import aot
from hip_kernels import runtime
from hip_kernels import variants as hv

ROOT = Path(__file__).resolve().parents[1]
GPT_OSS = ModelFacts(64, 8, 64, has_sinks=True, window=0, layer_windows=(0, 128))


def _have(arch: str) -> bool:
    try:
        runtime.toolchain_for(arch)
        return True
    except runtime.ToolchainMissingError:
        return False


# -- the registry ---------------------------------------------------------------------------

def test_every_module_variant_is_declared_for_some_arch():
    declared = {e.variant for e in registry.entries()}
    for name, v in hv.all_variants():
        assert v.name in declared, f"hip_kernels.{name} variant {v.name} is missing from the registry"


def test_fp8_flavour_per_arch():
    kv = lambda arch, kernel: {e.kv_dtype for e in registry.entries_for(arch) if e.kernel == kernel}
    for kernel in ("splitkv_decode", "gather_kv"):
        assert "fp8_e4m3" in kv("sm_90a", kernel) and "fp8_e4m3fnuz" not in kv("sm_90a", kernel)
        assert "fp8_e4m3fnuz" in kv("gfx942", kernel) and "fp8_e4m3" not in kv("gfx942", kernel)
        assert "fp8_e4m3" in kv("gfx950", kernel)
    assert rules.compile_target("sm_90") == "sm_90a" and rules.arch_family("sm_90a") == "sm_90"


@pytest.mark.parametrize("facts,path,reason,detail", [
    (ModelFacts(32, 8, 80), "varlen", "unsupported_head_dim", "head dim 80 not in {64, 128, 256}"),
    (ModelFacts(32, 8, 80), "splitkv", "unsupported_head_dim", "head dim 80"),
    (ModelFacts(8, 8, 64, dtype="fp32"), "varlen", "unsupported_dtype", "query dtype fp32"),
    (ModelFacts(32, 8, 128, kv_dtype="fp8_e4m3fnuz", kv_scale_mode="per_tensor"), "splitkv", "unsupported_kv_format",
     "fp8_e4m3fnuz"),
    (ModelFacts(32, 8, 128, kv_dtype="fp8_e4m3fnuz", kv_scale_mode="per_tensor"), "varlen", "unsupported_kv_format",
     "gather_kv"),
    (ModelFacts(32, 8, 128, dtype="fp16", kv_dtype="bf16"), "splitkv", "unsupported_kv_format", "kv dtype bf16"),
])
def test_named_refusals_on_sm90(facts, path, reason, detail):
    r = rules.check(registry.path_caps("sm_90a")[path], Signature.of(facts))
    assert r is not None and r.reason == reason and detail in r.detail, r


def test_rules_for_scale_mode_page_size_and_features():
    e = Entry("k", "varlen", "bf16", "fp8_e4m3", ("per_tensor",), 64, (1, 16), frozenset({"window"}), (), ("x",), "k")
    caps = PathCaps("x", (("k", (e,)),))
    sig = Signature("bf16", "fp8_e4m3", "per_page", 64, 16, frozenset())
    r = rules.check(caps, sig)
    assert r.reason == "unsupported_kv_format" and "scale mode per_page not built" in r.detail
    r = rules.check(caps, replace(sig, scale_mode="per_tensor", page_size=32))
    assert r.reason == "unsupported_page_size"
    r = rules.check(caps, replace(sig, scale_mode="per_tensor", features=frozenset({"sinks"})))
    assert r.reason == "unsupported_feature"
    assert rules.check(caps, replace(sig, scale_mode="per_tensor", features=frozenset({"window"}))) is None
    assert rules.check(None, sig).reason == "kernel_unavailable"
    assert rules.check(PathCaps("x"), sig).reason == "kernel_unavailable"
    assert rules.check(rules.ANY, sig) is None


def test_planner_reasons_are_the_registrys():
    """One source of truth: the planner's refusals are rules.check over the registry's caps."""
    p = registry.platform_for("sm_90a", use_tables=False)
    for facts in (GPT_OSS, ModelFacts(32, 8, 80), ModelFacts(8, 8, 64, dtype="fp32"),
                  ModelFacts(32, 8, 128, kv_dtype="fp8_e4m3fnuz", kv_scale_mode="per_tensor")):
        for caps, got in ((p.varlen_caps, model_varlen_reason(facts, p, PlannerConfig())),
                          (p.splitkv_caps, model_splitkv_reason(facts, p))):
            r = rules.check(caps, Signature.of(facts))
            assert got == (None if r is None else Reason(r.reason))
    for name in ("planner.py", "facts.py", "splits.py", "config.py"):
        src = (ROOT / "atom_backend" / "planning" / name).read_text()
        assert "frozenset({64" not in src and "head_dims" not in src, f"capability sets are hand-written in {name}"


def test_gfx942_routes_fp8_fnuz_to_the_kernels():
    p = registry.platform_for("gfx942", use_tables=False)
    facts = ModelFacts(32, 8, 128, kv_dtype="fp8_e4m3fnuz", kv_scale_mode="per_tensor")
    pl = plan([1, 500], [100, 1000], facts, p, PlannerConfig())
    assert pl.route_of(0) == ("decode", "splitkv", "preferred") and pl.route_of(1)[1] == "varlen"


def test_selection_is_the_launchers():
    from hip_kernels import combine, decode, gather, prefill

    sel = registry.select(GPT_OSS, "sm_90a")
    assert not sel.refusals
    assert set(sel.variants["varlen"]) == {prefill._variant(64, 0, False, prefill.config_for(64, 0, arch="sm_90a")),
                                           prefill._variant(64, 0, False, prefill.config_for(64, 128, arch="sm_90a")),
                                           gather.variant("vllm", False)}
    # H100 decodes on the tensor-core kernel (decode.choose_impl): that is the variant to build
    assert decode.choose_impl("sm_90a", 64, 0) == "mma"
    assert set(sel.variants["splitkv"]) == {decode._mma_variant(64, 0, 0), combine.variant(__import__("torch").bfloat16)}
    fma = registry.select(ModelFacts(32, 8, 256), "sm_90a")  # d=256: the CUDA-core kernel
    rows, _ = decode._pick_rows(4, 0)
    assert decode._variant(256, rows, 0, 0) in fma.variants["splitkv"]
    spec = registry.select(GPT_OSS, "sm_90a", max_query_tokens=4)
    assert len(spec.variants["splitkv"]) >= len(sel.variants["splitkv"])


# -- model configs and the CLI -----------------------------------------------------------------

def _gpt_oss_config(tmp_path: Path) -> Path:
    cfg = {"model_type": "gpt_oss", "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
           "hidden_size": 2880, "num_hidden_layers": 4, "sliding_window": 128, "torch_dtype": "bfloat16",
           "layer_types": ["sliding_attention", "full_attention"] * 2}
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    return p


def test_hf_config_gives_gpt_oss_facts(tmp_path):
    spec = from_hf_config(_gpt_oss_config(tmp_path))
    spec.kv_dtypes = ("auto", "fp8")
    f16, f8 = spec.facts("sm_90a")
    assert (f16.num_q_heads, f16.num_kv_heads, f16.head_dim, f16.has_sinks) == (64, 8, 64, True)
    assert f16.layer_windows == (0, 128) and f16.window == 0 and f16.kv_dtype == "bf16"
    assert f8.kv_dtype == "fp8_e4m3" and f8.kv_scale_mode == "per_tensor"
    assert spec.facts("gfx942")[1].kv_dtype == "fp8_e4m3fnuz"
    assert parse_layer_windows("0,128", 5) == (0, 128, 0, 128, 0)


def _cli(*args, env=None, timeout=600):
    e = dict(os.environ, PYTHONPATH=str(ROOT))
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "atom_backend.catalog", *args], capture_output=True, text=True,
                          env=e, timeout=timeout, cwd=ROOT)


def test_cli_list_and_check():
    r = _cli("list", "--json", "--arch", "gfx942")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert rows and all(row["archs"] == ["gfx942"] for row in rows)
    assert {"varlen_prefill", "gather_kv", "splitkv_decode", "combine"} <= {row["kernel"] for row in rows}
    r = _cli("list")
    assert r.returncode == 0 and "validation rules in order" in r.stdout
    r = _cli("check", "--arch", "sm_90", "--heads", "32", "--kv-heads", "8", "--head-dim", "80")
    assert r.returncode == 0 and "reason unsupported_head_dim" in r.stdout, r.stdout + r.stderr


GPT_OSS_FLAGS = ["--heads", "64", "--kv-heads", "8", "--head-dim", "64", "--sinks", "--layer-windows", "0,128",
                 "--kv-dtype", "auto,fp8"]

FRESH = textwrap.dedent("""
    import json, sys
    from atom_backend import metrics
    from atom_backend.catalog import registry, tuning
    from atom_backend.catalog.model import ModelSpec
    from hip_kernels import runtime
    arch = sys.argv[1]
    runtime.observe_compiles(metrics.record_compile)  # what the backend's kernel health does
    tuning.apply(arch)  # what detect_platform does in a serving process
    spec = ModelSpec(64, 8, 64, kv_dtypes=("auto", "fp8"), has_sinks=True, layer_windows=(0, 128))
    needed = {}
    for facts in spec.facts(arch):
        sel = registry.select(facts, arch)
        assert not sel.refusals, sel.refusals
        needed.update((v.name, v) for v in sel.all_variants())
    for v in needed.values():
        runtime.compile_variant(v, arch)  # ATOM_NO_COMPILE=1: a miss raises
    names = needed
    m = metrics._impl
    total = lambda c: sum(s.value for f in c.collect() for s in f.samples if s.name.endswith("_total"))
    print(json.dumps({"variants": len(names), "compiles": total(m.compiles), "hits": total(m.cache_hits)}))
""")


@pytest.mark.parametrize("arch", [
    pytest.param("sm_90a", marks=pytest.mark.skipif(not _have("sm_90a"), reason="NVRTC missing")),
    pytest.param("gfx942", marks=pytest.mark.skipif(not _have("gfx942"), reason="clang-22 missing")),
])
def test_after_build_a_fresh_process_compiles_nothing(arch, tmp_path):
    env = {"ATOM_KERNEL_CACHE": str(tmp_path / "cache"), "ATOM_METRICS": "1", "ATOM_TABLES_DIR": str(tmp_path)}
    env.pop("ATOM_NO_COMPILE", None)
    r = _cli("build", "--arch", arch, *GPT_OSS_FLAGS, "-j", "2", env=dict(env, ATOM_NO_COMPILE="0"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "failed" in r.stdout and " 0 failed" in r.stdout and "with 2 processes" in r.stdout, r.stdout
    e = dict(os.environ, PYTHONPATH=str(ROOT), ATOM_NO_COMPILE="1", **env)
    r = subprocess.run([sys.executable, "-c", FRESH, arch], capture_output=True, text=True, env=e, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["compiles"] == 0 and got["hits"] == got["variants"] > 0, got
    # and a second build is all cache hits
    r = _cli("build", "--arch", arch, *GPT_OSS_FLAGS, "--quiet", env=env)
    assert r.returncode == 0 and " 0 compiled" in r.stdout, r.stdout


def test_build_dry_run_and_no_model_builds_everything_declared():
    r = _cli("build", "--arch", "gfx950", "--dry-run")
    assert r.returncode == 0, r.stderr
    names = {line.split()[-1] for line in r.stdout.splitlines() if line.strip()}
    declared = {e.variant for e in registry.entries_for("gfx950")}
    assert {n for n in names if not n.startswith("unified.")} == declared
    triton = {v.name for f in aot.declared_facts("gfx950") for v in aot.launch_variants("gfx950", f)}
    assert {n for n in names if n.startswith("unified.")} == triton and len(triton) > 50


def test_build_dry_run_lists_the_unified_triton_configs():
    r = _cli("build", "--arch", "sm_90a", "--arch", "gfx1250", *GPT_OSS_FLAGS, "--dry-run")
    assert r.returncode == 0, r.stderr
    names = {line.split()[-1] for line in r.stdout.splitlines() if line.startswith("sm_90a") and " unified " in line}
    facts = [GPT_OSS, replace(GPT_OSS, kv_dtype="fp8_e4m3", kv_scale_mode="per_tensor")]
    assert names == {v.name for f in facts for v in aot.launch_variants("sm_90a", f)}
    assert "unified.paged_attention.bf16.bf16.d64.g8.128x64w4s3.sinks" in names
    assert "unified.paged_decode.bf16.fp8_e4m3.d64.g8.16x64w4s3.window.sinks.per_tensor" in names
    assert not any(line.startswith("gfx1250") and "unified." in line for line in r.stdout.splitlines())
    assert "[gfx1250] unified (triton): skipped, no declared unified tile table for gfx1250" in r.stderr


class PTXASError(RuntimeError):
    """What triton raises when ptxas crashes."""


def _fake_compilers(monkeypatch, triton_compile, cannot=""):
    """HIP variants compile instantly; Triton configs through ``triton_compile``."""
    monkeypatch.setattr(runtime, "toolchain_for", lambda arch: None)
    monkeypatch.setattr(runtime, "compile_variant", lambda v, arch: SimpleNamespace(cache_hit=False, seconds=0.0))
    monkeypatch.setattr(aot, "compile_variant", triton_compile)
    monkeypatch.setattr(aot, "cannot_compile", lambda arch: cannot)


def test_build_fails_on_a_triton_config_ptxas_rejects(monkeypatch, capsys):
    from atom_backend.catalog import __main__ as cli

    def compile_variant(arch, v):
        if (v.cfg.block_m, v.cfg.block_n, v.cfg.num_stages) == (128, 64, 3):
            raise PTXASError("PTXAS error: `ptxas` failed with error code -11\n`ptxas` stderr:")
        return aot.Compiled(0.0, False, 1024)

    _fake_compilers(monkeypatch, compile_variant)
    rc = cli.main(["build", "--arch", "sm_90a", *GPT_OSS_FLAGS, "-j", "1", "--quiet"])
    out = capsys.readouterr().out
    assert rc == 1, out
    failed = [line for line in out.splitlines() if line.strip().startswith("FAILED")]
    # the full-attention prefill tile of the bf16 and of the fp8 cache
    assert len(failed) == 2, out
    assert all("FAILED sm_90a unified.paged_attention." in f and ".128x64w4s3." in f and "PTXASError" in f
               for f in failed), failed
    assert " 2 failed" in out.splitlines()[0]


def test_build_skips_triton_configs_where_triton_cannot_compile(monkeypatch, capsys):
    from atom_backend.catalog import __main__ as cli

    def compile_variant(arch, v):
        raise AssertionError("nothing is compiled for a target Triton cannot build for")

    _fake_compilers(monkeypatch, compile_variant, cannot="Triton cannot compile for gfx942 here (no backend)")
    rc = cli.main(["build", "--arch", "gfx942", *GPT_OSS_FLAGS, "-j", "1", "--quiet"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "  skipped gfx942 unified (triton): Triton cannot compile for gfx942 here (no backend)" in out
    assert "FAILED" not in out and " 0 failed" in out


# -- tables ------------------------------------------------------------------------------------

def test_missing_tables_fall_back_to_defaults(monkeypatch, tmp_path):
    monkeypatch.setenv("ATOM_TABLES_DIR", str(tmp_path))
    tables.clear_cache()
    assert tables.load("cost", "gfx1250") is None and tables.cost_model("gfx1250") is None
    assert tuning.apply("gfx1250") == {}
    from hip_kernels import prefill

    assert prefill.config_for(64, 0, "gfx1250") == tuning.defaults()[(64, "full")]
    assert registry.platform_for("gfx1250").cost is None  # threshold routing


def test_tuning_table_is_applied_and_seen_by_selection(monkeypatch, tmp_path):
    from hip_kernels import prefill

    monkeypatch.setenv("ATOM_TABLES_DIR", str(tmp_path))
    cfg = {"num_warps": 8, "block_n": 64, "stages": 2, "warp_m_tiles": 2}
    bad = {"num_warps": 8, "block_n": 24, "stages": 2}  # 24 keys: not a shape the portable kernel builds
    tables.write("tuning", "gfx950", {"kernels": {"varlen_prefill": [
        {"head_dim": 64, "window_class": "full", "config": cfg},
        {"head_dim": 128, "window_class": "full", "config": bad}]}}, "test", "none", tmp_path, family=True)
    try:
        changed = tuning.apply("gfx950")
        assert changed == {(64, "full"): prefill.Config(8, 64, 2, 2)}  # the bad row: logged, default kept
        assert prefill.config_for(64, 0, "gfx950") == prefill.Config(8, 64, 2, 2)
        assert prefill.config_for(128, 0, "gfx950") == tuning.defaults()[(128, "full")]
        assert prefill.config_for(64, 0) == prefill.config_for(64, 0, "gfx942") == tuning.defaults()[(64, "full")]
        sel = registry.select(GPT_OSS, "gfx950")
        assert prefill._variant(64, 0, False, prefill.Config(8, 64, 2, 2)) in sel.variants["varlen"]
        assert prefill._variant(64, 0, False, prefill.Config(8, 64, 2, 2)) in prefill.variants("gfx950")
        assert prefill._variant(64, 0, False, prefill.Config(8, 64, 2, 2)) not in prefill.variants()
    finally:
        monkeypatch.delenv("ATOM_TABLES_DIR")
        tables.clear_cache()
    assert tuning.apply("gfx950") == {} and prefill.config_for(64, 0, "gfx950") == tuning.defaults()[(64, "full")]


def test_tuning_rows_carry_the_ctas_of_a_hopper_tile():
    # A tile of one consumer warpgroup at three CTAs per SM survives the table round trip, and
    # the launch grid and the kernel's CTAS define follow it (the kernel sizes its registers by it).
    from hip_kernels import prefill

    c3 = prefill.Config(4, 64, 3, wgmma=True, q_stages=1, ctas=3)
    assert tuning.config_from_dict(tuning.config_to_dict(c3)) == c3
    assert tuning.config_from_dict({"num_warps": 4, "block_n": 64, "stages": 3, "wgmma": True}).ctas == 0
    assert c3.ctas_per_sm == 3 and prefill.Config(4, 64, 3, wgmma=True).ctas_per_sm == 2
    assert prefill.Config(8, 64, 3, wgmma=True).ctas_per_sm == 1
    assert ("CTAS", "3") in prefill._variant(64, 0, False, c3).defines
    assert "CTAS" not in dict(prefill._variant(64, 0, False, prefill.Config(4, 64, 3, wgmma=True)).defines)


@pytest.mark.parametrize("name, key", [("NVIDIA H200", "h200"), ("NVIDIA H100 80GB HBM3", "h100_80gb_hbm3"),
                                       ("AMD Instinct MI300X", "mi300x"), ("AMD Instinct MI355X", "mi355x"),
                                       ("", "")])
def test_device_keys(name, key):
    assert tables.device_key(name) == key


def test_a_devices_own_table_comes_before_its_familys(monkeypatch, tmp_path):
    """Tuning measured on an H200 is read on the H200 only; the family's table serves its other
    cards (and a process that names no device); with no family table they get the defaults."""
    from hip_kernels import prefill

    monkeypatch.setenv("ATOM_TABLES_DIR", str(tmp_path))
    h200 = {"num_warps": 8, "block_n": 64, "stages": 2, "warp_m_tiles": 2}
    fam = {"num_warps": 4, "block_n": 32, "stages": 2}
    row = lambda cfg: {"kernels": {"varlen_prefill": [{"head_dim": 64, "window_class": "full", "config": cfg}]}}
    try:
        p = tables.write("tuning", "gfx950", row(h200), "test", "AMD Instinct MI355X", tmp_path)
        assert p.name == "tuning_gfx950_mi355x.json"
        assert tuning.apply("gfx950", "AMD Instinct MI355X") == {(64, "full"): prefill.Config(8, 64, 2, 2)}
        assert tuning.apply("gfx950", "AMD Instinct MI350X") == {} and tuning.apply("gfx950") == {}
        assert tables.write("tuning", "gfx950", row(fam), "test", "AMD Instinct MI350X", tmp_path,
                            family=True).name == "tuning_gfx950.json"
        assert tuning.apply("gfx950", "AMD Instinct MI350X") == {(64, "full"): prefill.Config(4, 32, 2)}
        assert tuning.apply("gfx950", "AMD Instinct MI355X") == {(64, "full"): prefill.Config(8, 64, 2, 2)}
        assert tables.load("tuning", "gfx950", "AMD Instinct MI355X")["produced_by"]["device"] == "AMD Instinct MI355X"
    finally:
        monkeypatch.delenv("ATOM_TABLES_DIR")
        tables.clear_cache()
        tuning.apply("gfx950")


def test_schema_mismatch_and_bad_tables_are_ignored(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("ATOM_TABLES_DIR", str(tmp_path))
    (tmp_path / "cost_gfx950.json").write_text(json.dumps({"schema": 99}))
    (tmp_path / "cost_gfx1250.json").write_text("{not json")
    tables.clear_cache()
    try:
        assert tables.cost_model("gfx950") is None and tables.cost_model("gfx1250") is None
        assert "schema" in caplog.text and "unreadable" in caplog.text
    finally:
        tables.clear_cache()


def test_committed_h100_tables_load():
    tables.clear_cache()
    for kind in tables.KINDS:
        data = tables.load(kind, "sm_90a")
        assert data is not None, f"{kind}_sm_90.json missing"
        pb = data["produced_by"]
        assert pb["device"].startswith("NVIDIA H100") and pb["command"].startswith("python -m bench.")
    from atom_backend.planning.cost import CostModel

    data = tables.load("cost", "sm_90")
    m = CostModel(data, data["_path"])  # the committed numbers make a model
    assert {(s.hq, s.d, s.window) for s in m.shapes} >= {(64, 64, 0), (64, 64, 128)}
    # ... of the kernels in this tree: a change to a costed source leaves the H100 without cost
    # routing (threshold rules, one log line) until the table is measured again.
    assert data.get("kernels") == tables.kernel_fingerprint(), (
        "cost_sm_90.json measured other kernels: run `python -m bench.calibrate` on an H100 and commit the table")
    assert tables.cost_model("sm_90") is not None


def test_committed_h100_tuning_table_gives_its_tiles():
    """tuning_sm_90.json (schema 2, rows without exp_poly) still selects the tiles it was measured to pick:
    the declared ones but for the small-window Hopper tiles, and only for sm_90a."""
    from hip_kernels import prefill

    tables.clear_cache()
    C = prefill.Config
    try:
        assert tuning.apply("sm_90a") == {
            (64, "wgmma_small"): C(4, 64, 3, wgmma=True, q_stages=2, ctas=3),
            (128, "wgmma_small"): C(12, 64, 3, wgmma=True, q_stages=1)}
        assert prefill.config_for(128, 128, "sm_90a") == C(12, 64, 3, wgmma=True, q_stages=1)
        assert prefill.config_for(128, 0, "sm_90a") == prefill.HOPPER_TILES.get("full", 128)
        assert prefill.config_for(128, 128, "sm_80") == prefill.PORTABLE_TILES.get("small", 128)
    finally:
        prefill._tuned.pop("sm_90a", None)


def test_cost_table_of_other_kernels_is_not_used(monkeypatch, tmp_path, caplog):
    from tests.test_cost_model import table

    monkeypatch.setenv("ATOM_TABLES_DIR", str(tmp_path))
    try:
        tables.write("cost", "gfx950", {**table(), "kernels": tables.kernel_fingerprint()}, "test", "none", tmp_path,
                     family=True)
        tables.write("cost", "gfx1250", {**table(), "kernels": "0123456789abcdef"}, "test", "none", tmp_path,
                     family=True)
        assert tables.cost_model("gfx950") is not None
        assert tables.cost_model("gfx1250") is None and "measured on other kernels" in caplog.text
    finally:
        tables.clear_cache()


HIP_SNIPPET = '''// the kernel's doc
#define TILE 64
__global__ void k(float* o, const char* tag) {
  /* a block
     comment */
  o[threadIdx.x] = 2.0f / TILE;  // trailing
  tag = "not // a comment";
}
'''
PY_SNIPPET = '''"""Module doc."""
CONFIGS = {64: (128, 64)}  # tile per head dim


def tile(d):
    """Doc."""
    return CONFIGS[d]
'''


@pytest.mark.parametrize("name, text, same, other", [
    ("k.hip", HIP_SNIPPET,
     [HIP_SNIPPET.replace("// the kernel's doc", "// another doc").replace("  o[", "\n      o["),
      HIP_SNIPPET.replace("/* a block\n     comment */", "")],
     [HIP_SNIPPET.replace("#define TILE 64", "#define TILE 128"), HIP_SNIPPET.replace("2.0f", "3.0f"),
      HIP_SNIPPET.replace('"not // a comment"', '"not a comment"')]),
    ("tiles.py", PY_SNIPPET,
     [PY_SNIPPET.replace('"""Doc."""', '"""Another doc, longer."""').replace("# tile per head dim", ""),
      PY_SNIPPET.replace("\n\n\ndef", "\n\ndef").replace("{64: (128, 64)}", "{64: (128,  64)}")],
     [PY_SNIPPET.replace("(128, 64)", "(128, 32)"), PY_SNIPPET.replace("return CONFIGS[d]", "return CONFIGS[d // 2]")]),
])
def test_the_cost_key_follows_code_not_comments_or_layout(name, text, same, other):
    key = tables.code_digest(name, text)
    for edit in same:
        assert edit != text and tables.code_digest(name, edit) == key, edit
    for edit in other:
        assert tables.code_digest(name, edit) != key, edit


def test_the_cost_key_ignores_where_the_sources_live(monkeypatch, tmp_path):
    # the same files under other paths and in another order give the same key
    root = tables._ROOT
    moved = []
    for i, rel in enumerate(reversed(tables.COSTED_SOURCES)):
        dst = tmp_path / f"moved_{i}{Path(rel).suffix}"
        dst.write_bytes((root / rel).read_bytes())
        moved.append(dst.name)
    key = tables.kernel_fingerprint()
    monkeypatch.setattr(tables, "_ROOT", tmp_path)
    monkeypatch.setattr(tables, "COSTED_SOURCES", tuple(moved))
    tables.kernel_fingerprint.cache_clear()
    try:
        assert tables.kernel_fingerprint() == key
    finally:
        tables.kernel_fingerprint.cache_clear()


@pytest.mark.skipif(not _have("sm_90a"), reason="NVRTC missing")
def test_build_in_threads_compiles_what_the_model_needs(tmp_path, monkeypatch):
    """The serving process's warm-up (execution.health.warm_kernels) compiles in threads: a vLLM
    worker is a daemon process and may not start a process pool."""
    from atom_backend.catalog import build

    monkeypatch.setenv("ATOM_KERNEL_CACHE", str(tmp_path))
    monkeypatch.delenv("ATOM_NO_COMPILE", raising=False)
    job = build.plan_build(["sm_90a"], lambda _arch: [GPT_OSS])[0]
    job.variants, job.triton = job.variants[:3], []
    results = build.run([job], workers=2, progress=False, threads=True)
    assert [r.error for r in results] == ["", "", ""] and not any(r.cache_hit for r in results), results
    again = build.run([job], workers=2, progress=False, threads=True)
    assert all(r.cache_hit for r in again), again


def test_the_cost_key_is_the_same_on_every_python(monkeypatch):
    """Python 3.12 tokenizes f-strings into parts (FSTRING_START ... FSTRING_END), 3.11 as one
    STRING: the key joins them back into their source text, so a deployment on any Python reads
    the table measured under another (the H200 machine runs 3.12, CI 3.11). Here the 3.12 stream
    of `x = f"a{b}c"` is given as 3.12 makes it, whatever this Python is."""
    import tokenize

    text = 'x = f"a{b}c"\n'
    tok = tokenize.TokenInfo
    start, middle, end = getattr(tokenize, "FSTRING_START", 1001), getattr(tokenize, "FSTRING_MIDDLE", 1002), \
        getattr(tokenize, "FSTRING_END", 1003)
    monkeypatch.setattr(tokenize, "FSTRING_START", start, raising=False)
    monkeypatch.setattr(tokenize, "FSTRING_END", end, raising=False)
    stream = [tok(tokenize.NAME, "x", (1, 0), (1, 1), text), tok(tokenize.OP, "=", (1, 2), (1, 3), text),
              tok(start, 'f"', (1, 4), (1, 6), text), tok(middle, "a", (1, 6), (1, 7), text),
              tok(tokenize.OP, "{", (1, 7), (1, 8), text), tok(tokenize.NAME, "b", (1, 8), (1, 9), text),
              tok(tokenize.OP, "}", (1, 9), (1, 10), text), tok(middle, "c", (1, 10), (1, 11), text),
              tok(end, '"', (1, 11), (1, 12), text), tok(tokenize.NEWLINE, "\n", (1, 12), (1, 13), text)]
    joined = [(t.type, t.string) for t in tables._whole_fstrings(stream, text)]
    assert joined == [(tokenize.NAME, "x"), (tokenize.OP, "="), (tokenize.STRING, 'f"a{b}c"'), (tokenize.NEWLINE, "\n")]
    assert tables._python_code(text).split() == ['x', '=', 'f"a{b}c"', 'NEWLINE']  # this Python's tokenizer agrees
