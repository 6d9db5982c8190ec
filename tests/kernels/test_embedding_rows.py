"""A tied embedding's rows read back out of the LM head's quantized panels in one kernel call
(engine/cpu/csrc/quantized/embedding_rows.cpp, int8 and int4 alike): bit for bit the Python
reference's values (each scheme's dequantize_rows), for any rows in any order; none gives an
empty result, and a row outside the weight is refused."""

from __future__ import annotations

import pytest
import torch

from engine.cpu.host import detect_cpu_features
from engine.cpu import int4_linear, int8_linear
from engine.cpu.quantized_plan import plan_quantization

# With VNNI the kernels must build (a build failure fails here rather than skipping).
HAS_VNNI = detect_cpu_features().has_avx512_vnni
SCHEMES = {"int8": (int8_linear.Int8Linear, int8_linear.dequantize_rows),
           "int4": (int4_linear.Int4Linear, int4_linear.dequantize_rows)}


@pytest.mark.skipif(not HAS_VNNI, reason="int8 and int4 need AVX512_VNNI, which this CPU lacks")
@pytest.mark.parametrize("scheme", list(SCHEMES))
@pytest.mark.parametrize("shape", [(45, 70), (32, 64), (130, 577)])
def test_rows_read_back_in_one_call_equal_the_reference(scheme, shape):
    linear_class, reference = SCHEMES[scheme]
    plan = plan_quantization("cpu", True, scheme)
    linear = linear_class(torch.randn(*shape, generator=torch.Generator().manual_seed(shape[1])), None, plan)
    rows = torch.tensor([shape[0] - 1, 0, 3, 3, shape[0] // 2])
    assert torch.equal(linear.dequantize_rows(rows), reference(linear.quantized, rows))
    assert linear.dequantize_rows(torch.tensor([], dtype=torch.long)).shape == (0, shape[1])
    for outside in (-1, shape[0]):
        with pytest.raises(RuntimeError, match="out of range"):
            linear.dequantize_rows(torch.tensor([outside]))
