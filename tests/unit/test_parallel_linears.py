"""Cutting packed quantized weights for tensor parallelism: a slice's dequantized weight is exactly
that slice of the whole weight's, or the cut is refused with the reason."""

from __future__ import annotations

import pytest
import torch

from inference_service.worker.kernels.packed import quantize_rtn
from inference_service.worker.linears.parallel import ShardingRefused, packed_columns, packed_rows


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(
    ("group_size", "start", "end"),
    [
        (32, 0, 64),  # whole groups
        (32, 64, 128),
        (128, 0, 64),  # inside one group: a per-channel scheme's halves
        (128, 64, 128),
        (16, 96, 128),
    ],
)
def test_a_column_slice_dequantizes_to_that_slice(bits, group_size, start, end):
    torch.manual_seed(0)
    packed = quantize_rtn(torch.randn(48, 128), bits=bits, group_size=group_size)
    sliced = packed_columns(packed, start, end)
    assert sliced.in_features == end - start
    torch.testing.assert_close(sliced.dequantize(), packed.dequantize()[:, start:end], rtol=0, atol=0)


@pytest.mark.parametrize("bits", [4, 8])
def test_a_row_slice_dequantizes_to_those_rows(bits):
    torch.manual_seed(0)
    packed = quantize_rtn(torch.randn(48, 100), bits=bits, group_size=32)  # a partial last group too
    rows = torch.tensor([5, 6, 7, 40, 47])
    torch.testing.assert_close(packed_rows(packed, rows).dequantize(), packed.dequantize()[rows], rtol=0, atol=0)


def test_cuts_across_groups_or_packed_bytes_are_refused():
    packed = quantize_rtn(torch.randn(8, 96), bits=8, group_size=32)
    with pytest.raises(ShardingRefused, match=r"input columns \[0, 48\) cut across quantization groups of 32"):
        packed_columns(packed, 0, 48)
    four_bit = quantize_rtn(torch.randn(8, 90), bits=4, group_size=90)
    with pytest.raises(ShardingRefused, match="odd column"):
        packed_columns(four_bit, 45, 90)
