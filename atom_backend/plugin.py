"""vLLM general-plugin entry point (group `vllm.general_plugins`)."""

import logging

logger = logging.getLogger("atom_backend")


def register() -> None:
    """Register atom-backend with vLLM. The backend class lands with the vLLM integration."""
    logger.warning("atom-backend plugin loaded, but no attention backend is registered yet")
