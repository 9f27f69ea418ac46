"""Run-time compilation, disk cache and launch of the HIP kernels in ``hip_kernels/src``.

API (small and stable; kernel modules build on exactly this):

``Variant(source, kernel, defines=())``
    One compiled specialisation: ``source`` is a file name under ``hip_kernels/src`` (or an
    absolute path), ``kernel`` the ``extern "C" __global__`` function to load, ``defines`` the
    ``-D`` options that specialise it (a dict or pairs; stored sorted, so equal variants hash
    equal). ``variant.name`` is a readable id used in errors, metrics and cache file names.

``compile_variant(variant, arch) -> Compiled``
    Code object for ``arch`` ("sm_90a", "sm_80", "gfx942", "gfx950", ...), from the disk cache
    or compiled now. Needs no GPU: NVRTC (cuda-bindings + nvidia-cuda-nvrtc wheels) for sm_*,
    hiprtc (hip-python on a ROCm install) or, without ROCm, clang-22 in ``-nogpuinc`` mode for
    gfx*. ``Compiled.binary`` is the cubin / AMDGPU code object, ``Compiled.log`` the compiler
    log, ``Compiled.cache_hit`` says where it came from.

``load(variant, device=None) -> Kernel``
    Compile-or-fetch for the current torch device's arch and load it; memoised per
    (variant, device), so a second ``load`` costs a dict lookup.

``Kernel(grid, block, *args, shared_mem=0)``
    Launch on ``torch.cuda.current_stream()`` (so CUDA-graph capture records it). ``grid`` and
    ``block`` are ints or tuples of up to 3 ints; a grid with a zero dimension launches nothing.
    Argument conventions (the kernel's parameter list must match):
    torch.Tensor or None -> pointer, Python int -> ``long long``, Python float -> ``float``;
    ``i32(x)``, ``i64(x)``, ``f32(x)``, ``f64(x)`` make the type explicit. No host sync.

``Packed(kernel, grid, block, args, shared_mem=0)``
    The same launch with its arguments packed once: ``put(i, tensor)`` swaps argument ``i``'s
    pointer (``put_f32(i, x)`` a float's value), ``launch()`` runs it. For callers that launch
    one configuration many times (plan once per batch, launch per layer).

Helpers: ``device_arch(device)``, ``current_stream(device_index)``, ``native_fp8_dtype(arch)``,
``warp_size(arch)``, ``resource_usage(compiled)`` (registers / spills when the toolchain reports
them), ``cache_dir()``.

Cache: ``$ATOM_KERNEL_CACHE`` (default ``~/.cache/atom_backend/kernels``). The key hashes the
source, every header in ``hip_kernels/include`` and ``hip_kernels/src/*.h``, the defines,
the kernel name, the arch, the toolchain and its version and options, and the package version.
Entries are written to a temporary file and renamed into place under an ``flock``, and carry a
checksum, so concurrent processes never see or leave a torn entry. ``ATOM_NO_COMPILE=1`` turns
a cache miss into ``CompileForbiddenError`` (deployments pre-warm the cache).

Errors: ``ToolchainMissingError`` names the extra to install, ``KernelCompileError`` carries
the variant name and the compiler log; both derive from ``KernelError`` (a RuntimeError).
``observe_compiles(fn)`` subscribes ``fn(name, seconds, cache_hit)`` to every variant made
ready (atom-backend's metrics do): this package imports nothing of its users.

Modules, by concern: ``variant`` (what is compiled), ``arch`` (targets), ``toolchains``
(compilers), ``cache`` (disk cache and ``compile_variant``), ``launch`` (loading, argument
packing, launches on the torch stream), ``workspace`` (grown device buffers and the per-stream
zeroed counters kernels share, imported on its own: it needs torch), ``errors``.
"""

from hip_kernels.runtime.arch import (device_arch, is_amd_arch, is_mfma_arch, max_dynamic_smem, native_fp8_dtype,
                                      warp_size)
from hip_kernels.runtime.cache import cache_dir, cache_key, compile_variant, observe_compiles, resource_usage
from hip_kernels.runtime.errors import CompileForbiddenError, KernelCompileError, KernelError, ToolchainMissingError
from hip_kernels.runtime.launch import Blob, Kernel, Packed, clear_memo, current_stream, f32, f64, i32, i64, load
from hip_kernels.runtime.toolchains import toolchain_for
from hip_kernels.runtime.variant import Compiled, Variant

__all__ = [
    "Blob", "Compiled", "CompileForbiddenError", "Kernel", "KernelCompileError", "KernelError", "Packed",
    "ToolchainMissingError", "Variant", "cache_dir", "cache_key", "clear_memo", "compile_variant", "current_stream",
    "device_arch", "f32", "f64", "i32", "i64", "is_amd_arch", "is_mfma_arch", "load", "max_dynamic_smem",
    "native_fp8_dtype", "observe_compiles", "resource_usage", "toolchain_for", "warp_size",
]
