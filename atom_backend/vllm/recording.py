"""Who records what on a model of several KV-cache groups, so that a metric counts a step once.

vLLM makes one builder per KV-cache group (gpt-oss: a window group and a full
one) and builds every group's metadata each step, all for the same scheduled tokens. So that a
metric counts a step once, the builder holding the process's lowest layer index records the
step's tokens, and for each layer kind (``layer_kind``) the builder with that kind's lowest layer
index records the kind's routing series; every builder records the gather's bytes for its own
layers (real work). Only tensor-parallel rank 0 of the first pipeline stage records tokens and
routing (the other ranks plan the same batch). Builders made by ``for_model`` without layer
names record everything, as if alone. The roles are decided at a builder's first build and
again when the set of live builders changes, never per batch. Capture builds (vLLM's dummy
runs) and draft builds record nothing.
"""

from __future__ import annotations

import re
import sys
import weakref

from atom_backend.planning import ModelFacts


def layer_kind(facts: ModelFacts) -> str:
    """The ``layer_kind`` label of a plan's layers: "window" (sliding window), else "sinks" (per-head
    sink logits), else "full"; "mixed" when a group holds windowed and full layers (gpt-oss with
    vLLM's hybrid KV-cache allocator off)."""
    windows = set(facts.layer_windows)
    if 0 in windows and len(windows) > 1:
        return "mixed"
    if facts.window > 0 or windows:
        return "window"
    return "sinks" if facts.has_sinks else "full"


_LAYER_INDEX = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


def layer_rank(layer_names) -> tuple[int, str]:
    """Order of a builder among the process's: its lowest layer index ("model.layers.3.self_attn.attn"
    -> 3), the name breaking ties, so that two builders of one group (vLLM's microbatches) rank
    equal and both record their halves of the step."""
    keys = [(int(m.group(1)) if (m := _LAYER_INDEX.search(n)) else sys.maxsize, n) for n in layer_names]
    return min(keys) if keys else (sys.maxsize, "")


class Registry:
    """The process's builders made by vLLM, weakly held; ``version`` changes with the set, so a
    builder re-decides its roles only then."""

    def __init__(self) -> None:
        self.builders: weakref.WeakSet = weakref.WeakSet()
        self.version = 0

    def add(self, b) -> None:
        self.builders.add(b)
        weakref.finalize(b, self._changed)
        self._changed()

    def discard(self, b) -> None:
        if b in self.builders:
            self.builders.discard(b)
            self._changed()

    def _changed(self) -> None:
        self.version += 1


REGISTRY = Registry()


def records_here() -> bool:
    """Whether this process records tokens and routing: tensor-parallel rank 0 of the first pipeline
    stage (every rank plans the same batch), or any process outside vLLM's distributed setup."""
    try:
        from vllm.distributed import parallel_state as ps
    except ImportError:
        return True
    if not ps.model_parallel_is_initialized():
        return True
    return ps.get_tensor_model_parallel_rank() == 0 and ps.get_pp_group().is_first_rank
