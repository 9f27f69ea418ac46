"""A minimal stand-in for the few vLLM names atom_backend imports, for machines without vLLM
(the GPU machine: docs/toolchains.md), used by bench.trace and tests/test_impl_gpu.py; every line of
atom_backend that runs on top of it is production code. No-op when vLLM is installed."""

from __future__ import annotations

import enum
import sys
import types
from dataclasses import dataclass
from typing import Generic, TypeVar


def _install_vllm_stand_in() -> None:
    try:
        import vllm.v1.attention.backend  # noqa: F401
        return
    except ImportError:
        pass
    T = TypeVar("T")
    be = types.ModuleType("vllm.v1.attention.backend")

    class AttentionType(str, enum.Enum):
        DECODER = "decoder"
        ENCODER = "encoder"
        ENCODER_ONLY = "encoder_only"
        ENCODER_DECODER = "encoder_decoder"

    class AttentionCGSupport(enum.Enum):
        ALWAYS, UNIFORM_BATCH, UNIFORM_SINGLE_TOKEN_DECODE, NEVER = 3, 2, 1, 0

    @dataclass(frozen=True)
    class MultipleOf:
        base: int

    class AttentionMetadataBuilder(Generic[T]):
        pass

    class AttentionImpl(Generic[T]):
        pass

    class AttentionBackend:
        pass

    class CommonAttentionMetadata(types.SimpleNamespace):
        pass

    for name, obj in dict(AttentionType=AttentionType, AttentionCGSupport=AttentionCGSupport, MultipleOf=MultipleOf,
                          AttentionMetadataBuilder=AttentionMetadataBuilder, AttentionImpl=AttentionImpl,
                          AttentionBackend=AttentionBackend, CommonAttentionMetadata=CommonAttentionMetadata).items():
        setattr(be, name, obj)
    lay = types.ModuleType("vllm.v1.kv_cache_layout")
    lay.KVCacheLayout = enum.Enum("KVCacheLayout", {"LBNHC": (0, 1, 3, 2, 4), "LBHNC": (0, 1, 2, 3, 4)})
    for name in ("vllm", "vllm.v1", "vllm.v1.attention"):
        sys.modules[name] = types.ModuleType(name)
    sys.modules["vllm.v1.attention.backend"] = be
    sys.modules["vllm.v1.kv_cache_layout"] = lay




install = _install_vllm_stand_in
