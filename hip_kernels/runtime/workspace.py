"""Device buffers that kernels share across launches: grown, never shrunk or freed, so that launches
packed or captured into a CUDA graph earlier keep valid addresses."""

from __future__ import annotations

import torch

from hip_kernels.runtime.launch import current_stream

# Zeroed int32 counters of the kernels that pick a finishing CTA at run time (the split decode's
# completion counts, the prefill scheduler's work counter): each user leaves its counters zeroed,
# and each (device, stream) has its own buffer, so launches on different streams never share a
# counter. One first made during a CUDA-graph capture comes from the graph memory pool, where
# another graph of that pool may overwrite it: a graph that outlives its capture takes counters
# made outside it.
_SEMAPHORES: dict = {}  # (device, stream) -> grown_buffer's list
_MIN_SEMAPHORES = 1 << 16


def grown_buffer(buffers: list, need: int, dtype: torch.dtype, device) -> torch.Tensor:
    """The newest buffer of `buffers` if it holds `need` elements on `device`, else a new zeroed
    one (at least twice the size) appended. Outgrown buffers stay in the list, allocated:
    launches packed or captured earlier keep their addresses."""
    buf = buffers[-1] if buffers else None
    if buf is None or buf.numel() < need or buf.device != torch.device(device):
        buf = torch.zeros(max(need, 2 * (buf.numel() if buf is not None else 0)), dtype=dtype, device=device)
        buffers.append(buf)
    return buf


def semaphores(device, count: int) -> torch.Tensor:
    """Zeroed int32 counters (>= count) on `device` for launches on the current stream."""
    idx = device.index if isinstance(device, torch.device) else torch.device(device).index
    key = (device, current_stream(torch.cuda.current_device() if idx is None else idx))
    return grown_buffer(_SEMAPHORES.setdefault(key, []), max(count, _MIN_SEMAPHORES), torch.int32, device)


def semaphores_zeroed() -> bool:
    """Whether every counter buffer is back to zero (what each user promises to leave)."""
    return all(int(buf.abs().sum()) == 0 for bufs in _SEMAPHORES.values() for buf in bufs)
