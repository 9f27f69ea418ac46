"""Portable HIP kernels compiled at run time (hiprtc on ROCm, NVRTC on NVIDIA), cached on disk."""
