"""`--vision-quantization int8`: the vision encoder's linears on fbgemm's dynamic int8 matmuls (SigLIP, and
Qwen2.5-VL's ViT: its embeddings within 0.99 cosine too). Its
image embeddings stay within 0.99 cosine of the fp32 encoder's per token (the tiny checkpoint, and
SigLIP-B/16 at 512 px, SmolVLM-256M's shape), the greedy answers on the tiny checkpoint are fp32's
(transformers' tokens), only the tower is quantized, and a bad value is refused naming the field."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import LLM, SamplingParams
from engine.cpu.vision_int8 import DynamicInt8Linear
from ipc.engine_config import EngineConfig
from scripts.lib.vision_model import SMOLVLM_256M_TEXT, SMOLVLM_256M_VISION, make_tiny_smolvlm
from tests.models.test_idefics3 import CASES, ENGINE_KWARGS, hf_greedy, hf_processor, image, prompt

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def embeddings(llm, pixels: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return llm.engine.model_runner.model.embed_images(pixels)  # [tokens, hidden]


def frames(processor, picture) -> torch.Tensor:
    return torch.from_numpy(processor(images=[[picture]], return_tensors="np")["pixel_values"][0])  # [F, C, H, W]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    path, hf_model = make_tiny_smolvlm(tmp_path_factory.mktemp("smolvlm_int8"))
    fp32 = LLM(path, **ENGINE_KWARGS)
    int8 = LLM(path, vision_quantization="int8", **ENGINE_KWARGS)
    yield hf_model, fp32, int8
    int8.shutdown()
    fp32.shutdown()


def test_only_the_vision_tower_is_quantized(engines):
    _, fp32, int8 = engines
    model = int8.engine.model_runner.model
    tower = [m for m in model.vision_model.modules() if isinstance(m, DynamicInt8Linear)]
    assert len(tower) == 4 * len(model.vision_model.encoder.layers)  # fused qkv, out, fc1, fc2
    assert not any(isinstance(m, DynamicInt8Linear) for m in model.connector.modules())
    outside = [name for name, m in model.named_modules() if isinstance(m, DynamicInt8Linear)
               and not name.startswith("vision_model.")]
    assert outside == []
    assert not any(isinstance(m, DynamicInt8Linear) for m in fp32.engine.model_runner.model.modules())


def test_image_embeddings_within_0_99_cosine_of_fp32(engines):
    _, fp32, int8 = engines
    processor = hf_processor()
    for seed, (height, width) in enumerate([(40, 70), (64, 64), (20, 24)]):
        pixels = frames(processor, image(100 + seed, height, width))
        exact, quantized = embeddings(fp32, pixels), embeddings(int8, pixels)
        assert not torch.equal(exact, quantized)  # it is the int8 encoder
        cosine = F.cosine_similarity(quantized, exact, dim=-1)  # [tokens]
        assert cosine.min().item() >= 0.99, cosine


def test_greedy_answers_equal_fp32s(engines):
    hf_model, _, int8 = engines
    requests = [{"prompt": prompt(text, len(images)), "multi_modal_data": {"image": images}} for text, images in CASES]
    outputs = int8.generate(requests, GREEDY)
    vision = int8._vision_processor()
    for (text, images), output in zip(CASES, outputs):
        token_ids, _ = vision.process(prompt(text, len(images)), images)
        assert output.token_ids == hf_greedy(hf_model, token_ids, images, hf_processor()), text


def test_a_bad_value_names_the_field():
    with pytest.raises(ValueError, match="vision_quantization"):
        EngineConfig(vision_quantization="int4")


@pytest.mark.slow
def test_smolvlm_256m_shape_encoder_within_0_99_cosine(tmp_path):
    """SigLIP-B/16 at 512 px: 1024 patches through 12 layers of 768, where int8's error could add up."""
    from transformers import Idefics3ImageProcessorPil

    path, _ = make_tiny_smolvlm(tmp_path, crop_size=512, longest_edge=512, vision=SMOLVLM_256M_VISION,
                                text=SMOLVLM_256M_TEXT, scale_factor=4, name="SmolVLM-256M-shape")
    processor = Idefics3ImageProcessorPil(size={"longest_edge": 512}, max_image_size={"longest_edge": 512}, resample=1)
    pixels = frames(processor, image(41, 512, 512))  # one frame, 64 tokens
    kwargs = dict(dtype="float32", max_num_batched_tokens=256, num_kv_blocks=64)
    fp32 = LLM(path, **kwargs)
    exact = embeddings(fp32, pixels)
    fp32.shutdown()
    int8 = LLM(path, vision_quantization="int8", **kwargs)
    quantized = embeddings(int8, pixels)
    int8.shutdown()
    cosine = F.cosine_similarity(quantized, exact, dim=-1)  # [64]
    assert cosine.shape == (64,) and cosine.min().item() >= 0.99, cosine


def test_qwen2_5_vl_tower_within_0_99_cosine_of_fp32(tmp_path):
    """The same flag on Qwen2.5-VL's ViT: its qkv, proj and SwiGLU linears and the patch merger's."""
    from scripts.lib.qwen_vl_model import make_tiny_qwen2_5_vl

    path, _ = make_tiny_qwen2_5_vl(tmp_path)
    fp32 = LLM(path, **ENGINE_KWARGS)
    int8 = LLM(path, vision_quantization="int8", **ENGINE_KWARGS)
    model = int8.engine.model_runner.model
    num_layers = len(model.visual.blocks)
    assert sum(isinstance(m, DynamicInt8Linear) for m in model.modules()) == 5 * num_layers + 2
    pixels = torch.randn(1, 3, 56, 84, generator=torch.Generator().manual_seed(0))  # 2 x 3 merged tokens
    exact, quantized = embeddings(fp32, pixels), embeddings(int8, pixels)
    int8.shutdown()
    fp32.shutdown()
    assert not torch.equal(exact, quantized)
    cosine = F.cosine_similarity(quantized, exact, dim=-1)  # [6]
    assert cosine.shape == (6,) and cosine.min().item() >= 0.99, cosine
