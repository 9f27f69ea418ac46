"""vLLM platform plugin for the CPU build (group ``vllm.platform_plugins``).

vLLM's ``CpuPlatform.get_attn_backend_cls`` (0.26 to 0.33 alike) returns its own ``CPU_ATTN``
whatever the user selected. ``cpu_platform()`` activates only where vLLM would pick its CPU
platform anyway (and only on a supported vLLM release, ``compat``) and returns a subclass that
differs in one thing: when the user selected ``CUSTOM`` (and CUSTOM is registered, by our
general plugin), that backend is validated the way vLLM's CUDA platform validates a selection
and then used. Every other selection, or none, goes to vLLM's code
unchanged, so installing atom-backend does not change CPU serving for anyone who does not ask
for it.

Limits (vLLM's own): only one out-of-tree platform plugin can be active in a process, and
``VLLM_TARGET_DEVICE=cpu`` bypasses platform plugins entirely (then CUSTOM is ignored on the CPU).
"""

from __future__ import annotations

import logging

# vLLM configures its own loggers only: the selection line belongs next to vLLM's.
logger = logging.getLogger("vllm.atom_backend")

QUALNAME = "atom_backend.vllm.platform_cpu.AtomCpuPlatform"


def cpu_platform() -> str | None:
    from atom_backend.vllm import compat

    try:
        from vllm.platforms import cpu_platform_plugin

        supported = compat.is_supported(compat.parse_version(compat.installed_version()))
    except ImportError:
        return None
    # Outside the supported range the general plugin registers nothing (and says why): vLLM's
    # own CPU platform then serves, as without atom-backend.
    return QUALNAME if supported and cpu_platform_plugin() is not None else None


def _make_class():
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    class AtomCpuPlatform(CpuPlatform):
        @classmethod
        def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None) -> str:
            if selected_backend == AttentionBackendEnum.CUSTOM and not (
                    attn_selector_config.use_mla or attn_selector_config.use_sparse):
                if not selected_backend.is_overridden():
                    from atom_backend.vllm.plugin import register

                    register()
                backend_cls = selected_backend.get_class()
                reasons = backend_cls.validate_configuration(device_capability=None,
                                                             **attn_selector_config._asdict())
                if reasons:
                    raise ValueError(f"Selected backend CUSTOM ({selected_backend.get_path()}) is not valid for this "
                                     f"configuration on the CPU. Reasons: {reasons}")
                logger.info("Using CUSTOM attention backend %s on the CPU.", selected_backend.get_path())
                return selected_backend.get_path()
            return super().get_attn_backend_cls(selected_backend, attn_selector_config, num_heads)

    return AtomCpuPlatform


def __getattr__(name):
    # vLLM imports the qualname after detection; building the class then keeps plugin
    # discovery free of vLLM's CPU platform import.
    if name == "AtomCpuPlatform":
        cls = _make_class()
        globals()["AtomCpuPlatform"] = cls
        return cls
    raise AttributeError(name)
