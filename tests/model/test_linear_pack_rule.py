"""Linear's kernel choice on CPU (model/layers.py `PLAIN_ONE_ROW_MAX`): one row on a small float32 weight goes to
F.linear, two rows or more, a large weight, or bfloat16 to oneDNN's packed GEMM; float64 is never packed. Both give
x W^T within float32 rounding."""
from __future__ import annotations

import pytest
import torch

from pdserve.model import layers
from pdserve.model.layers import Linear, _packs

pytestmark = pytest.mark.skipif(not _packs(torch.float32), reason="no oneDNN packed GEMM in this torch")


def linear(i: int, o: int, dtype=torch.float32) -> Linear:
    lin = Linear(i, o, False, dtype)
    torch.nn.init.normal_(lin.weight)
    lin.pack_for_cpu()
    return lin


def plain_calls(lin: Linear, rows: int, monkeypatch) -> int:
    calls = []
    real = layers.F.linear
    monkeypatch.setattr(layers.F, "linear", lambda *a: calls.append(1) or real(*a))
    x = torch.randn(rows, lin.weight.shape[1], dtype=lin.weight.dtype)
    with torch.inference_mode():
        y = lin(x)
    monkeypatch.undo()
    torch.testing.assert_close(y, x @ lin.weight.T, rtol=1e-4, atol=1e-4)
    return len(calls)


@pytest.mark.parametrize("i,o,rows,plain", [(256, 640, 1, 1), (256, 640, 2, 0), (256, 640, 7, 0),
                                            (256, 1250, 1, 1), (256, 1251, 1, 0), (1024, 1024, 1, 0)])
def test_one_row_on_a_small_weight_is_plain(i, o, rows, plain, monkeypatch):
    assert plain_calls(linear(i, o), rows, monkeypatch) == plain


def test_float64_is_never_packed_and_bf16_always(monkeypatch):
    lin = linear(256, 256, torch.float64)
    assert lin.packed is None and plain_calls(lin, 1, monkeypatch) == 1
    if _packs(torch.bfloat16):
        assert linear(256, 256, torch.bfloat16).packed_min_rows == 1
