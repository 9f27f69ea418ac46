"""atom-backend: an attention backend for vLLM (planner, kernels, metrics)."""

__version__ = "0.1.0"
