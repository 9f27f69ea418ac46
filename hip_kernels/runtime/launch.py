"""Loading and launching: argument packing, Kernel and Packed launches on the current torch stream, the CUDA / HIP driver APIs."""

from __future__ import annotations

import ctypes
import functools
import logging
import struct
import threading
from dataclasses import dataclass
from typing import Any, Iterable


from hip_kernels.runtime import toolchains as _tc
from hip_kernels.runtime.arch import device_arch
from hip_kernels.runtime.cache import compile_variant
from hip_kernels.runtime.errors import KernelError, ToolchainMissingError
from hip_kernels.runtime.variant import Compiled, Variant

log = logging.getLogger("hip_kernels")

@dataclass(frozen=True)
class _Typed:
    value: Any
    fmt: str  # struct format


def i32(x: int) -> _Typed:
    return _Typed(int(x), "<i")


def i64(x: int) -> _Typed:
    return _Typed(int(x), "<q")


def f32(x: float) -> _Typed:
    return _Typed(float(x), "<f")


def f64(x: float) -> _Typed:
    return _Typed(float(x), "<d")


_F32 = struct.Struct("<f")
_U32 = struct.Struct("<I")


_MASK64 = 0xFFFFFFFFFFFFFFFF
_arg_buffers = threading.local()


@functools.lru_cache(maxsize=None)
def _array_types(n: int):
    """ctypes array types of n slots and of n pointers, and a struct packing n 64-bit words
    (filling an array through its constructor costs ~8 us for 46 arguments, pack_into ~1)."""
    return ctypes.c_uint64 * max(n, 1), ctypes.c_void_p * max(n, 1), struct.Struct(f"<{n}Q")


def _new_arg_arrays(n: int):
    """(slots, pointer array to them, packer) for n arguments: every argument its own 8-byte slot."""
    slots_t, ptrs_t, packer = _array_types(n)
    slots, ptrs = slots_t(), ptrs_t()
    if n:
        base = ctypes.addressof(slots)
        packer.pack_into(ptrs, 0, *range(base, base + 8 * n, 8))
    return slots, ptrs, packer


def _arg_buffer(n: int):
    """This thread's (slots, pointer array, packer) for n arguments: the driver copies the
    parameters at launch, so one buffer per size serves every launch."""
    cache = _arg_buffers.__dict__.setdefault("by_n", {})
    buf = cache.get(n)
    if buf is None:
        buf = cache[n] = _new_arg_arrays(n)
    return buf


def _f32_bits(x: float) -> int:
    return _U32.unpack(_F32.pack(x))[0]


class Blob:
    """A by-value kernel parameter wider than a slot (a CUDA tensor map: 128 bytes, 64-byte
    aligned). The driver copies it at launch from this object's aligned buffer."""

    __slots__ = ("_raw", "addr", "data")

    def __init__(self, data: bytes, align: int = 64):
        self._raw = ctypes.create_string_buffer(len(data) + align)
        self.addr = (ctypes.addressof(self._raw) + align - 1) & ~(align - 1)
        ctypes.memmove(self.addr, data, len(data))
        self.data = bytes(data)


def _pack_args(args: Iterable[Any], kernel_name: str):
    """ctypes (slots, pointer array): every argument gets its own 8-byte slot, in this thread's
    buffer for that many arguments; a Blob's pointer goes to the Blob's own bytes (in a fresh
    pointer array, so the shared one keeps pointing at its slots)."""
    blobs: list = []
    vals = _arg_values(args, kernel_name, blobs)
    slots, ptrs, packer = _arg_buffer(len(vals))
    packer.pack_into(slots, 0, *vals)
    if blobs:
        own = _array_types(len(vals))[1]()
        ctypes.memmove(own, ptrs, ctypes.sizeof(own))
        for i, b in blobs:
            own[i] = b.addr
        ptrs = own
    return slots, ptrs


def _arg_values(args: Iterable[Any], kernel_name: str, blobs: list | None = None) -> list[int]:
    """Each argument as the 64-bit slot value the kernel reads. Exact types are checked first:
    a decode step packs ~45 arguments per layer. Blobs are collected into `blobs` as
    (index, Blob); their slot holds 0."""
    import torch

    vals = []
    for i, a in enumerate(args):
        t = type(a)
        if t is int:
            vals.append(a & _MASK64)
        elif a is None:
            vals.append(0)
        elif t is float:
            vals.append(_f32_bits(a))
        elif isinstance(a, torch.Tensor):
            vals.append(a.data_ptr())
        elif t is Blob:
            if blobs is None:
                raise TypeError(f"{kernel_name}: argument {i} is a Blob; this launch path packs slots only")
            blobs.append((i, a))
            vals.append(0)
        elif isinstance(a, bool):
            raise TypeError(f"{kernel_name}: argument {i} is a bool; pass i32(...) explicitly")
        elif isinstance(a, int):
            vals.append(int(a) & _MASK64)
        elif isinstance(a, float):
            vals.append(_f32_bits(float(a)))
        elif isinstance(a, _Typed):
            raw = struct.pack(a.fmt, a.value).ljust(8, b"\0")
            vals.append(struct.unpack("<Q", raw)[0])
        else:
            raise TypeError(f"{kernel_name}: argument {i} has unsupported type {type(a).__name__}")
    return vals


def current_stream(device_index: int) -> int:
    """The current torch stream of a device, as the raw handle launches take."""
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # ~10x cheaper, as Triton's launcher
    return raw(device_index) if raw is not None else torch.cuda.current_stream(device_index).cuda_stream


def _dims(x, what: str) -> tuple[int, int, int]:
    t = (x,) if isinstance(x, int) else tuple(int(v) for v in x)
    if not 1 <= len(t) <= 3 or any(v < 0 for v in t):
        raise ValueError(f"{what} must be 1-3 non-negative ints, got {x!r}")
    return t + (1,) * (3 - len(t))


class Kernel:
    """A loaded kernel; call it to launch on the current torch stream."""

    def __init__(self, variant: Variant, compiled: Compiled, device_index: int, module, func, api):
        self.variant, self.compiled, self.device_index = variant, compiled, device_index
        self._module, self._func, self._api = module, func, api
        self._max_smem = 48 * 1024

    def __repr__(self):
        return f"Kernel({self.variant.name}, {self.compiled.arch})"

    def __call__(self, grid, block, *args, shared_mem: int = 0, stream=None) -> None:
        g, b = _dims(grid, "grid"), _dims(block, "block")
        _slots, ptrs = _pack_args(args, self.variant.name)
        self._launch(g, b, shared_mem, ctypes.addressof(ptrs), stream)

    def _launch(self, g, b, shared_mem: int, params: int, stream) -> None:
        if 0 in g:
            return
        if shared_mem > self._max_smem:
            self._api.set_max_smem(self._func, shared_mem, self.variant.name)
            self._max_smem = shared_mem
        if stream is None:
            stream = current_stream(self.device_index)
        elif not isinstance(stream, int):
            stream = stream.cuda_stream
        self._api.launch(self._func, g, b, shared_mem, stream, params, self)


class Packed:
    """One launch of a kernel with its arguments packed once (FlashInfer's plan / run split): a
    caller that launches the same configuration many times (every layer of a batch) replaces
    only the pointers that change with `put`, then `launch`es; ~1 us instead of packing ~45
    arguments again. The slots are this object's own, so it may be kept across calls."""

    __slots__ = ("kernel", "grid", "block", "shared_mem", "_slots", "_ptrs")

    def __init__(self, kernel: "Kernel", grid, block, args, shared_mem: int = 0):
        self.kernel, self.shared_mem = kernel, int(shared_mem)
        self.grid, self.block = _dims(grid, "grid"), _dims(block, "block")
        vals = _arg_values(args, kernel.variant.name)
        self._slots, self._ptrs, packer = _new_arg_arrays(len(vals))
        packer.pack_into(self._slots, 0, *vals)

    def put(self, index: int, tensor) -> None:
        """Argument `index` becomes this tensor's data pointer (None: a null pointer)."""
        self._slots[index] = 0 if tensor is None else tensor.data_ptr()

    def put_f32(self, index: int, value: float) -> None:
        """Argument `index` (a float parameter) becomes `value`."""
        self._slots[index] = _f32_bits(value)

    def launch(self, stream=None) -> None:
        """On the current torch stream (or `stream`), as Kernel.__call__."""
        self.kernel._launch(self.grid, self.block, self.shared_mem, ctypes.addressof(self._ptrs), stream)


class _CudaApi:
    def __init__(self):
        from cuda.bindings import driver

        self.d = driver
        self._ctx: dict[int, Any] = {}
        self._check(driver.cuInit(0)[0], "cuInit")

    def _check(self, err, what: str, name: str = ""):
        if err != self.d.CUresult.CUDA_SUCCESS:
            _, s = self.d.cuGetErrorString(err)
            msg = s.decode() if isinstance(s, bytes) else str(err)
            raise KernelError(f"{what}{' (' + name + ')' if name else ''}: {msg}")

    def make_current(self, dev: int):
        # torch uses the primary context; make it current on this thread for driver calls.
        d = self.d
        if dev not in self._ctx:
            err, cudev = d.cuDeviceGet(dev)
            self._check(err, "cuDeviceGet")
            err, ctx = d.cuDevicePrimaryCtxRetain(cudev)
            self._check(err, "cuDevicePrimaryCtxRetain")
            self._ctx[dev] = ctx
        self._check(d.cuCtxSetCurrent(self._ctx[dev])[0], "cuCtxSetCurrent")

    def load(self, binary: bytes, kernel: str, dev: int, name: str):
        self.make_current(dev)
        err, mod = self.d.cuModuleLoadData(binary)
        self._check(err, "cuModuleLoadData", name)
        err, func = self.d.cuModuleGetFunction(mod, kernel.encode())
        self._check(err, f"cuModuleGetFunction({kernel})", name)
        return mod, func

    def set_max_smem(self, func, nbytes: int, name: str):
        attr = self.d.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        self._check(self.d.cuFuncSetAttribute(func, attr, nbytes)[0], f"dynamic shared memory {nbytes} B", name)

    def launch(self, func, g, b, smem, stream, params, k: Kernel):
        d = self.d
        s = d.CUstream(stream)
        (err,) = d.cuLaunchKernel(func, *g, *b, smem, s, params, 0)
        if err == d.CUresult.CUDA_ERROR_INVALID_CONTEXT:  # first launch from another thread
            self.make_current(k.device_index)
            (err,) = d.cuLaunchKernel(func, *g, *b, smem, s, params, 0)
        self._check(err, "cuLaunchKernel", k.variant.name)


class _HipApi:
    def __init__(self):
        try:
            from hip import hip
        except Exception as e:
            raise ToolchainMissingError("HIP runtime bindings missing: pip install atom-backend[rocm]") from e
        self.h = hip

    def _check(self, err, what: str, name: str = ""):
        if err != self.h.hipError_t.hipSuccess:
            raise KernelError(f"{what}{' (' + name + ')' if name else ''}: {err}")

    def load(self, binary: bytes, kernel: str, dev: int, name: str):
        self._check(self.h.hipSetDevice(dev)[0], "hipSetDevice")
        err, mod = self.h.hipModuleLoadData(binary)
        self._check(err, "hipModuleLoadData", name)
        err, func = self.h.hipModuleGetFunction(mod, kernel.encode())
        self._check(err, f"hipModuleGetFunction({kernel})", name)
        return mod, func

    def set_max_smem(self, func, nbytes: int, name: str):
        attr = self.h.hipFunction_attribute.HIP_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        self._check(self.h.hipFuncSetAttribute(func, attr, nbytes)[0], f"dynamic shared memory {nbytes} B", name)

    def launch(self, func, g, b, smem, stream, params, k: Kernel):
        (err,) = self.h.hipModuleLaunchKernel(func, *g, *b, smem, stream, params, None)
        self._check(err, "hipModuleLaunchKernel", k.variant.name)


_api = None
_loaded: dict[tuple[Variant, int], Kernel] = {}
_load_lock = threading.Lock()


def _device_api():
    global _api
    if _api is None:
        import torch

        _api = _HipApi() if getattr(torch.version, "hip", None) else _CudaApi()
    return _api


def load(variant: Variant, device=None) -> Kernel:
    """Compile-or-fetch `variant` for `device` (default: current torch device) and load it."""
    import torch

    if isinstance(device, int):
        idx = device
    else:
        idx = None if device is None else torch.device(device).index
        if idx is None:
            idx = torch.cuda.current_device()
    k = _loaded.get((variant, idx))
    if k is not None:
        return k
    with _load_lock:
        k = _loaded.get((variant, idx))
        if k is not None:
            return k
        arch = device_arch(idx)
        compiled = compile_variant(variant, arch)
        api = _device_api()
        mod, func = api.load(compiled.binary, variant.kernel, idx, variant.name)
        k = Kernel(variant, compiled, idx, mod, func, api)
        _loaded[(variant, idx)] = k
        return k


def clear_memo() -> None:
    """Forget in-process loads/toolchains (tests: force the disk-cache path)."""
    _loaded.clear()
    _tc._toolchains.clear()
