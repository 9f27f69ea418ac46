"""vLLM general-plugin entry point (group ``vllm.general_plugins``, see pyproject.toml).

vLLM calls ``register()`` in every process it starts (API server, engine core, workers), before
it picks attention backends. It points vLLM's ``CUSTOM`` attention backend at ours; the user
selects it with ``--attention-backend CUSTOM`` (``attention_config={"backend": "CUSTOM"}``).
Nothing changes for a user who does not select it. On vLLM's CPU platform the selection needs
the platform plugin of ``atom_backend.platform_cpu`` too (docs/vllm.md).
"""

from __future__ import annotations

import logging

logger = logging.getLogger("atom_backend")

BACKEND_PATH = "atom_backend.backend.AtomAttentionBackend"


def register() -> None:
    try:
        from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    except ImportError as e:  # vLLM < 0.32 kept the registry elsewhere; we only support >= 0.32
        logger.warning("atom-backend: this vLLM has no v1 attention registry (%s); backend not registered", e)
        return
    register_backend(AttentionBackendEnum.CUSTOM, BACKEND_PATH)
    logger.debug("atom-backend registered as attention backend CUSTOM -> %s", BACKEND_PATH)
