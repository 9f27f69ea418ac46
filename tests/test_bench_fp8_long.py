"""bench.fp8_long's chunked causal reference (its kernels run on the GPU) against the library's."""

from __future__ import annotations

import torch

from atom_backend import reference as ref
from bench.fp8_long import causal_reference


def test_chunked_causal_reference_is_the_library_reference():
    g = torch.Generator().manual_seed(0)
    sq, sk = 37, 90  # a prefix hit: rows aligned bottom-right, three query chunks of 16
    q, k, v = (torch.randn(n, h, 16, generator=g) for n, h in ((sq, 4), (sk, 2), (sk, 2)))
    want, _ = ref.varlen_attention(q, k, v, torch.tensor([0, sq], dtype=torch.int32),
                                   torch.tensor([0, sk], dtype=torch.int32))
    got = causal_reference(q, k, v, 16 ** -0.5, chunk=16)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
