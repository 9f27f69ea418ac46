"""Collection rules shared by the CPU suite."""

from __future__ import annotations

import os

import pytest


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def pytest_configure(config):
    config.addinivalue_line("markers", "triton_interpreter: runs only under TRITON_INTERPRET=1 (a child process)")


def pytest_collection_modifyitems(config, items):
    """Triton's interpreter is fixed when triton is first imported, so a process either runs the
    interpreter cases or the rest: the other group is deselected, not skipped."""
    interp = _interpreting()
    keep, drop = [], []
    for item in items:
        wants_interp = item.get_closest_marker("triton_interpreter") is not None
        in_child_only = item.name == "test_interpreter_suite"
        if (wants_interp and not interp) or (in_child_only and interp):
            drop.append(item)
        else:
            keep.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture
def sm90_cache(monkeypatch, tmp_path):
    """NVRTC for sm_90a (or a skip where the extra is missing) and a private kernel cache."""
    from hip_kernels import runtime

    try:
        runtime.toolchain_for("sm_90a")
    except runtime.ToolchainMissingError:
        pytest.skip("NVRTC not installed")
    monkeypatch.setenv("ATOM_KERNEL_CACHE", str(tmp_path))
    monkeypatch.delenv("ATOM_NO_COMPILE", raising=False)
    return tmp_path
