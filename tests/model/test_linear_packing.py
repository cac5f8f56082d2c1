"""oneDNN-packed Linear weights on CPU: the same products as F.linear, for the dtypes that pack, at odd M."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.model.layers import Linear, _packs

# Which dtypes pack is the speed path: float32 and (where oneDNN has bf16 kernels) bfloat16; float64 never.
DTYPES = [torch.float32, torch.bfloat16, torch.float64]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_f_linear(dtype, bias):
    g = torch.Generator().manual_seed(3)
    lin = Linear(37, 53, bias=bias, dtype=dtype)
    lin.weight.data.copy_(torch.randn(53, 37, generator=g).to(dtype))
    if bias:
        lin.bias.data.copy_(torch.randn(53, generator=g).to(dtype))
    lin.pack_for_cpu()
    assert (lin.packed is not None) == _packs(dtype)
    if dtype == torch.float64:
        assert lin.packed is None
    for m in (1, 7, 8, 9, 129):  # the packing hint is 8: below, at and past it
        x = torch.randn(m, 37, generator=g).to(dtype)
        ref = F.linear(x.double(), lin.weight.double(), None if lin.bias is None else lin.bias.double())
        out = lin(x)
        assert out.dtype == dtype and out.shape == (m, 53)
        # float32: summation order only; bfloat16: the output's own rounding (8 bits of mantissa) at most twice.
        tol = {torch.float32: 1e-5, torch.bfloat16: 2 * 2 ** -8, torch.float64: 1e-12}[dtype]
        assert ((out.double() - ref).abs() <= tol * ref.abs().clamp(min=1.0)).all(), f"M={m}"


def test_bfloat16_packs_where_onednn_has_bf16():
    """The bf16 speed path is taken wherever oneDNN reports bf16 support (this project's CI machines do)."""
    supported = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert _packs(torch.bfloat16) == supported
    assert _packs(torch.float32) and not _packs(torch.float64)
