"""The Triton LoRA shrink/expand (engine.kernels.lora_sgmv) against the torch layer of
engine.lora.lora_layers. Without CUDA they run under Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1 before anything imports triton), so sizes are small."""

import pytest
import torch

from engine.kernels.lora_sgmv import NO_SLOT, add_lora, lora_shrink, lora_shrink_kernel, make_segment_plan
from engine.lora.lora_layers import LoRALinear, LoRAStepState

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and type(lora_shrink_kernel).__name__ != "InterpretedFunction":
    pytest.fail("engine.kernels was imported before TRITON_INTERPRET=1 was set (tests/conftest.py sets it)")


def torch_reference(x, a, b, scales, slots):
    """The CPU path itself: LoRALinear over an identity-free base (a zero linear) plus y0."""
    base = torch.nn.Linear(x.shape[1], b.shape[1], bias=False, dtype=torch.float32)
    torch.nn.init.zeros_(base.weight)
    state = LoRAStepState()
    state.prepare(slots, None, torch.device("cpu"))
    b_stored = b.float().transpose(1, 2).contiguous()  # the pool keeps B as [slots, R, out]
    layer = LoRALinear(base, a.float(), b_stored, [float(s) for s in scales], state, is_output_layer=False)
    return layer(x.float())


def make_case(num_rows, in_features, out_features, rank, num_slots, slots, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_rows, in_features, generator=gen).to(dtype)
    a = (torch.randn(num_slots, rank, in_features, generator=gen) * 0.2).to(dtype)
    b = (torch.randn(num_slots, out_features, rank, generator=gen) * 0.2).to(dtype)
    scales = torch.tensor([0.5 + s for s in range(num_slots)], dtype=torch.float32)
    return x, a, b, scales


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.float16, 2e-2), (torch.bfloat16, 1e-1)],
                         ids=["fp32", "fp16", "bf16"])
def test_mixed_rows_match_the_torch_layer(dtype, tol):
    # 37 rows over 3 slots and the base, unsorted; slot 1's segment (17 rows) spans two row blocks;
    # rank 24 (a fused qkv's 3 x 8) and 70 outputs are no powers of two.
    slots = [1, NO_SLOT, 0, 1, 2, 1, NO_SLOT] * 5 + [1, 1]
    x, a, b, scales = make_case(len(slots), 96, 70, 24, 3, slots, dtype)
    y0 = torch.randn(len(slots), 70).to(dtype)
    plan = make_segment_plan(slots, DEVICE)
    assert plan.max_rows == slots.count(1) == 17
    y = add_lora(y0.clone().to(DEVICE), x.to(DEVICE), a.to(DEVICE), b.to(DEVICE), scales.to(DEVICE), plan)
    expected = y0.float() + torch_reference(x, a, b, scales.tolist(), slots)
    assert y.dtype == dtype
    torch.testing.assert_close(y.float().cpu(), expected, atol=tol, rtol=tol)
    base_rows = [row for row, slot in enumerate(slots) if slot == NO_SLOT]
    assert torch.equal(y.cpu()[base_rows], y0[base_rows])  # the base's rows are left bit for bit


def test_shrink_leaves_base_rows_zero_and_each_slot_uses_its_own_a():
    slots = [0, NO_SLOT, 2, 0]
    x, a, _, _ = make_case(len(slots), 32, 16, 16, 3, slots, torch.float32, seed=3)
    t = lora_shrink(x.to(DEVICE), a.to(DEVICE), make_segment_plan(slots, DEVICE)).cpu()
    assert torch.equal(t[1], torch.zeros(16))
    for row, slot in ((0, 0), (2, 2), (3, 0)):
        torch.testing.assert_close(t[row], x[row] @ a[slot].t(), atol=1e-4, rtol=1e-4)


def test_a_step_of_the_base_alone_has_no_plan_and_changes_nothing():
    assert make_segment_plan([NO_SLOT] * 5, DEVICE) is None
    y = torch.randn(5, 8)
    assert add_lora(y, torch.randn(5, 4), torch.randn(1, 16, 4), torch.randn(1, 8, 16), torch.ones(1), None) is y


def test_one_adapter_on_every_row_of_a_decode_batch():
    slots = [2] * 9
    x, a, b, scales = make_case(9, 64, 48, 16, 4, slots, torch.float32, seed=5)
    plan = make_segment_plan(slots, DEVICE)
    assert plan.slot_ids.tolist() == [2] and plan.starts.tolist() == [0, 9]
    y = add_lora(torch.zeros(9, 48, device=DEVICE), x.to(DEVICE), a.to(DEVICE), b.to(DEVICE), scales.to(DEVICE), plan)
    torch.testing.assert_close(y.cpu(), (x @ a[2].t()) @ b[2].t() * scales[2], atol=1e-4, rtol=1e-4)


def test_b_stored_transposed_reads_the_same():
    # engine.lora.adapter_pool may keep B as [slots, R, out] in memory; the kernel takes its strides.
    slots = [0, 1, NO_SLOT, 1]
    x, a, b, scales = make_case(4, 32, 40, 16, 2, slots, torch.float32, seed=7)
    b_transposed = b.transpose(1, 2).contiguous().transpose(1, 2)  # [slots, out, R] view of [slots, R, out]
    assert b_transposed.stride(2) != 1
    plan = make_segment_plan(slots, DEVICE)
    args = (x.to(DEVICE), a.to(DEVICE))
    y = add_lora(torch.zeros(4, 40, device=DEVICE), *args, b_transposed.to(DEVICE), scales.to(DEVICE), plan)
    y_ref = add_lora(torch.zeros(4, 40, device=DEVICE), *args, b.to(DEVICE), scales.to(DEVICE), plan)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(y.cpu(), torch_reference(x, a, b, scales.tolist(), slots), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("is_output_layer", [False, True])
def test_the_layer_on_the_kernels_equals_the_layer_on_torch(is_output_layer):
    # LoRALinear as the GPU runs it (uses_kernels: a segment plan, two launches) against the CPU's
    # groups, over a prefill chunk and a decode row; the output layer runs on the output rows alone.
    token_slots = [1, 1, 1, 1, NO_SLOT, NO_SLOT, 0]  # a 4-token chunk on slot 1, the base's 2, slot 0's decode
    output_slots = [1, NO_SLOT, 0]  # the sampled rows: each sequence's last
    x, a, b, scales = make_case(7 if not is_output_layer else 3, 48, 40, 16, 2, token_slots, torch.float32, seed=9)
    base = torch.nn.Linear(48, 40, bias=False)
    b_stored = b.transpose(1, 2).contiguous()  # [slots, R, out], as engine.lora.adapter_pool keeps it
    outputs = []
    for uses_kernels in (False, True):
        state = LoRAStepState(scales=scales.to(DEVICE), uses_kernels=uses_kernels)
        state.prepare(token_slots, output_slots, torch.device(DEVICE))
        layer = LoRALinear(base.to(DEVICE), a.to(DEVICE), b_stored.to(DEVICE), scales.tolist(), state, is_output_layer)
        outputs.append(layer(x.to(DEVICE)).cpu())
    torch.testing.assert_close(outputs[1], outputs[0], atol=1e-4, rtol=1e-4)
    assert not torch.equal(outputs[0], base(x))  # the adapters added something
