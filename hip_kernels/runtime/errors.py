"""Errors of the run-time compiler: every one is a KernelError (a RuntimeError)."""

from __future__ import annotations

import logging


from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hip_kernels.runtime.variant import Variant

log = logging.getLogger("hip_kernels")

class KernelError(RuntimeError):
    """Base class of every hip_kernels runtime error."""


class ToolchainMissingError(KernelError):
    """No compiler for the requested arch is installed."""


class KernelCompileError(KernelError):
    """The compiler rejected a variant; ``.log`` holds its output."""

    def __init__(self, variant: "Variant", arch: str, toolchain: str, log_text: str):
        self.variant, self.arch, self.toolchain, self.log = variant, arch, toolchain, log_text
        super().__init__(f"compiling {variant.name} for {arch} with {toolchain} failed:\n{log_text.strip()}")


class CompileForbiddenError(KernelError):
    """ATOM_NO_COMPILE=1 and the variant is not in the cache."""
