"""The one-token software prefetch switch (gguf_dot.h's g_one_token_prefetch, which
engine/cpu/prefetch_tuner.py steers while decoding) moves no data the kernels compute with: one
token's outputs are the same bits with it on and off, for every kept type, grouped rows and the
row kernels' tail alike, and calls of several tokens ignore it."""

from __future__ import annotations

import pytest
import torch

from engine.cpu.gguf_extension import load_gguf_kernels
from engine.cpu.gguf_linear import KERNEL_TYPE_NAMES, GgufLinear
from tests.helpers.prefetch_switch import outputs_both_ways
from tests.kernels.test_gguf_linear import make_blocks


@pytest.fixture
def kernels():
    module = load_gguf_kernels()
    assert module.one_token_prefetch()  # on until a tuner says otherwise
    yield module
    module.set_one_token_prefetch(True)


@pytest.mark.parametrize("type_name", KERNEL_TYPE_NAMES)
def test_one_token_outputs_are_the_same_bits_with_and_without_the_prefetch(kernels, type_name):
    in_features = 1024
    linear = GgufLinear([(type_name, make_blocks(type_name, 43, in_features, seed=7))], in_features)  # 5 groups + 3 rows
    for num_tokens in (1, 2, 3):
        x = torch.randn(num_tokens, in_features, generator=torch.Generator().manual_seed(num_tokens)).bfloat16()
        outputs = outputs_both_ways(kernels, linear, x)
        assert torch.equal(*outputs), (type_name, num_tokens)
        assert outputs[0].abs().sum() > 0
