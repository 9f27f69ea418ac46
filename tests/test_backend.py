"""Backend declarations, plugin registration and the CPU platform hook (vLLM >= 0.32)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from vllm.v1.attention.backend import AttentionCGSupport, AttentionType  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402
from vllm.v1.attention.selector import AttentionSelectorConfig  # noqa: E402

from atom_backend.vllm.backend import AtomAttentionBackend  # noqa: E402
from atom_backend.vllm.metadata import AtomMetadataBuilder  # noqa: E402


def _reasons(**kw):
    cfg = dict(head_size=64, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=16)
    cfg.update(kw)
    return AtomAttentionBackend.validate_configuration(device_capability=None,
                                                       **AttentionSelectorConfig(**cfg)._asdict())


def test_supported_configurations_have_no_reasons():
    for kw in (dict(), dict(head_size=32, dtype=torch.float32), dict(head_size=128, kv_cache_dtype="fp8", has_sink=True),
               dict(head_size=256, block_size=1024, has_sliding_window=True), dict(block_size=1)):
        assert _reasons(**kw) == [], kw


def test_every_unsupported_feature_is_reported_at_once():
    r = _reasons(head_size=36, kv_cache_dtype="fp8_e5m2", block_size=2048, use_mla=True,
                 attn_type=AttentionType.ENCODER_ONLY)
    # each names the offending value and the supported set
    for want in ("head_size 36 not supported: multiples of 8 from 8 to 256",
                 "kv_cache_dtype 'fp8_e5m2' not supported: auto, float16, bfloat16, fp8, fp8_e4m3",
                 "block_size 2048 not supported: 1 to 1024", "MLA not supported"):
        assert any(x.startswith(want) for x in r), (want, r)
    assert any("attention type" in x for x in r), r
    assert _reasons(head_size=64, dtype=torch.float32, kv_cache_dtype="fp8") != []


def test_declarations():
    assert AtomAttentionBackend.get_name() == "CUSTOM" and AttentionBackendEnum["CUSTOM"]
    assert AtomAttentionBackend.forward_includes_kv_cache_update is False
    assert AtomAttentionBackend.supports_sink() and AtomAttentionBackend.supports_sliding_window()
    assert AtomMetadataBuilder._cudagraph_support == AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    assert AtomAttentionBackend.get_builder_cls() is AtomMetadataBuilder


def test_plugin_registers_custom():
    from atom_backend.vllm.plugin import BACKEND_PATH, register

    AttentionBackendEnum.CUSTOM.clear_override()
    try:
        register()
        assert AttentionBackendEnum.CUSTOM.get_path() == BACKEND_PATH
        assert AttentionBackendEnum.CUSTOM.get_class() is AtomAttentionBackend
    finally:
        AttentionBackendEnum.CUSTOM.clear_override()


def test_cpu_platform_honours_custom_only_when_selected():
    from atom_backend.vllm import platform_cpu

    assert platform_cpu.cpu_platform() == platform_cpu.QUALNAME  # this is vLLM's CPU build
    plat = platform_cpu.AtomCpuPlatform
    sel = AttentionSelectorConfig(head_size=64, dtype=torch.float32, kv_cache_dtype="auto", block_size=32)
    try:
        assert plat.get_attn_backend_cls(AttentionBackendEnum.CUSTOM, sel).endswith("AtomAttentionBackend")
        # No selection, or another one: vLLM's own CPU choice, unchanged.
        cpu_attn = AttentionBackendEnum.CPU_ATTN.get_path()
        assert plat.get_attn_backend_cls(None, sel) == cpu_attn
        assert plat.get_attn_backend_cls(AttentionBackendEnum.TRITON_ATTN, sel) == cpu_attn
        with pytest.raises(ValueError, match="head_size 36 not supported"):
            plat.get_attn_backend_cls(AttentionBackendEnum.CUSTOM, sel._replace(head_size=36))
    finally:
        AttentionBackendEnum.CUSTOM.clear_override()


@pytest.mark.parametrize("argv, selected", [
    (["api_server", "--model", "m", "--attention-backend", "CUSTOM"], True),
    (["api_server", "--attention-backend=custom"], True),
    (["serve", "m", "--attention-config", '{"backend": "CUSTOM"}'], True),
    (["serve", "m", "--attention-backend", "FLASH_ATTN"], False),
    (["serve", "m", "--attention-config", '{"backend": "TRITON_ATTN"}'], False),
    (["serve", "m"], False),
])
def test_the_plugin_sees_a_custom_selection_on_the_command_line(argv, selected):
    from atom_backend.vllm.plugin import custom_selected

    assert custom_selected(argv) is selected


@pytest.mark.parametrize("env, message", [
    ({"ATOM_FORCE_PATH": "bogus"}, "ATOM_FORCE_PATH='bogus'"),
    ({"ATOM_MAX_SPLITS": "abc"}, "ATOM_MAX_SPLITS"),
    ({"ATOM_NO_COMPILE": "maybe"}, "ATOM_NO_COMPILE='maybe'"),
    ({"ATOM_METRICS_SAMPLE_RATE": "2"}, "ATOM_METRICS_SAMPLE_RATE='2'"),
    ({"ATOM_TABLES_DIR": "/nonexistent/tables"}, "ATOM_TABLES_DIR='/nonexistent/tables' is not a directory"),
])
def test_a_bad_setting_stops_the_front_end_with_one_line(env, message):
    from atom_backend.vllm.plugin import prepare_front_end

    with pytest.raises(SystemExit) as e:
        prepare_front_end(env)
    line = str(e.value.code)
    assert line.startswith("atom-backend: ") and message in line and "\n" not in line, line


def test_good_settings_pass_the_front_end_check():
    from atom_backend.vllm.plugin import check_environment

    check_environment({"ATOM_FORCE_PATH": "varlen", "ATOM_MAX_SPLITS": "32", "ATOM_NO_COMPILE": "off",
                       "ATOM_METRICS": "on", "ATOM_METRICS_SAMPLE_RATE": "0.5"})


def test_no_compile_reads_off_as_off(monkeypatch):
    from hip_kernels.runtime import cache as runtime

    for raw, want in (("off", False), ("no", False), ("0", False), ("", False), ("on", True), ("1", True)):
        monkeypatch.setenv("ATOM_NO_COMPILE", raw)
        assert runtime._no_compile() is want, raw
    monkeypatch.setenv("ATOM_NO_COMPILE", "maybe")
    with pytest.raises(ValueError, match="ATOM_NO_COMPILE"):
        runtime._no_compile()
