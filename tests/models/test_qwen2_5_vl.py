"""Qwen2.5-VL: images in, text out, with M-RoPE and dynamic resolution. Greedy fp32 tokens equal
transformers' generate on a tiny random checkpoint (scripts/lib/qwen_vl_model.py) for prompts with one
image and with two of different sizes, with prefill chunks cutting through images' tokens, beside
text-only requests, after prefix-cache hits; the pixels are transformers' image processor's, bit for
bit, and the positions transformers' get_rope_index."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from engine import LLM, SamplingParams
from engine.worker.step_inputs import pixels_to_tensor
from ipc.vision.qwen2_vl import patchify, smart_resize
from scripts.lib.qwen_vl_model import hf_image_processor, make_tiny_qwen2_5_vl

NUM_NEW_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
# 4-token blocks, 16-token chunks: an image's 6-36 tokens span several chunks and blocks.
ENGINE_KWARGS = dict(dtype="float32", block_size=4, max_num_batched_tokens=16, num_kv_blocks=512)


def image(seed: int, height: int, width: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def prompt(text: str, num_images: int) -> str:
    return ("<|im_start|>user\n" + "<|vision_start|><|image_pad|><|vision_end|>" * num_images + text
            + "<|im_end|>\n<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def qwen_vl(tmp_path_factory):
    path, hf_model = make_tiny_qwen2_5_vl(tmp_path_factory.mktemp("qwen-vl"))
    llm = LLM(path, **ENGINE_KWARGS)
    yield path, hf_model, llm
    llm.shutdown()


def hf_greedy(hf_model, token_ids: list[int], images: list[Image.Image]) -> list[int]:
    input_ids = torch.tensor([token_ids])
    kwargs = {}
    if images:
        pixels = hf_image_processor()(images=images, return_tensors="pt")
        kwargs = dict(pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"],
                      mm_token_type_ids=(input_ids == hf_model.config.image_token_id).int())
    with torch.no_grad():
        out = hf_model.generate(input_ids=input_ids, max_new_tokens=NUM_NEW_TOKENS, do_sample=False, **kwargs)
    return out[0, len(token_ids):].tolist()


CASES = [  # (text, images): sizes resized to 2 x 3 up to 6 x 6 merge blocks (6-36 tokens, 1-9 windows)
    ("Describe this.", [image(1, 60, 90)]),
    ("Big one.", [image(2, 150, 170)]),
    ("Tall one.", [image(3, 200, 40)]),
    ("Tiny one, scaled up to the minimum.", [image(4, 10, 12)]),
    ("Compare the two.", [image(5, 150, 170), image(6, 60, 90)]),
    ("Wide, then square.", [image(7, 40, 160), image(8, 112, 112)]),
    ("A long question about the picture, asked with many words so the text spans chunks too.", [image(9, 100, 70)]),
    ("Same picture twice.", [image(10, 84, 84), image(10, 84, 84)]),
]


def test_pixels_are_transformers_image_processors_bit_for_bit(qwen_vl):
    _, _, llm = qwen_vl
    processor = hf_image_processor()
    for text, images in CASES:
        _, records = llm._vision_processor().process(prompt(text, len(images)), images)
        expected = processor(images=images, return_tensors="np")
        ours = np.concatenate([patchify(pixels_to_tensor(r, torch.device("cpu"))[0].numpy(), 14, 2, 2)
                               for r in records])
        assert ours.shape == expected["pixel_values"].shape and np.array_equal(ours, expected["pixel_values"]), text
        grids = [[1, r.shape[2] // 14, r.shape[3] // 14] for r in records]
        assert grids == expected["image_grid_thw"].tolist(), text


def test_smart_resize_bounds():
    assert smart_resize(10, 12, 28, 56 * 56, 28 * 28 * 36) == (56, 84)  # up to the minimum area, rounded up
    assert smart_resize(1000, 2000, 28, 56 * 56, 28 * 28 * 36) == (112, 224)  # down within the maximum
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(10, 3000)


def test_prompt_tokens_are_the_processors_expansion(qwen_vl):
    """transformers' Qwen2_5_VLProcessor writes <|image_pad|> x (grid_h * grid_w / 4) and tokenizes the text."""
    from transformers import PreTrainedTokenizerFast

    path, _, llm = qwen_vl
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=f"{path}/tokenizer.json")
    grids = hf_image_processor()(images=[im for _, ims in CASES for im in ims], return_tensors="np")["image_grid_thw"]
    counts = iter(int(t * h * w) // 4 for t, h, w in grids)
    for text, images in CASES:
        expanded = prompt(text, len(images))
        for _ in images:
            expanded = expanded.replace("<|image_pad|>", "<|placeholder|>" * next(counts), 1)
        expected = tokenizer(expanded.replace("<|placeholder|>", "<|image_pad|>"))["input_ids"]
        assert llm._vision_processor().process(prompt(text, len(images)), images)[0] == expected, text


def test_positions_equal_transformers_get_rope_index(qwen_vl):
    from engine.models.qwen2_5_vl import mrope_positions

    _, hf_model, llm = qwen_vl
    vision = llm.engine.model_runner.model_config.vision
    for text, images in CASES:
        token_ids, records = llm._vision_processor().process(prompt(text, len(images)), images)
        input_ids = torch.tensor([token_ids])
        grids = hf_image_processor()(images=images, return_tensors="pt")["image_grid_thw"]
        expected, delta = hf_model.model.get_rope_index(input_ids, (input_ids == vision.image_token_id).int(), grids)
        ours, our_delta = mrope_positions(token_ids, records, vision)
        assert np.array_equal(ours, expected[:, 0].numpy()) and our_delta == int(delta), text


def test_greedy_tokens_equal_transformers_with_text_requests_beside(qwen_vl):
    _, hf_model, llm = qwen_vl
    requests = [{"prompt": prompt(text, len(images)), "multi_modal_data": {"image": images}} for text, images in CASES]
    texts = ["<|im_start|>user\nno picture here, just words.<|im_end|>\n<|im_start|>assistant\n", "Once upon a time"]
    outputs = llm.generate(requests + texts, GREEDY)  # one batch: image requests beside text-only ones
    vision = llm._vision_processor()
    num_cut = 0  # images whose tokens a 16-token prefill chunk boundary cuts through
    for (text, images), output in zip(CASES, outputs):
        token_ids, records = vision.process(prompt(text, len(images)), images)
        num_cut += sum(r.offset // 16 != (r.offset + r.length - 1) // 16 for r in records)
        assert output.token_ids == hf_greedy(hf_model, token_ids, images), text
    for text, output in zip(texts, outputs[len(CASES):]):
        assert output.token_ids == hf_greedy(hf_model, llm.tokenizer.encode(text), []), text
    assert num_cut >= 4  # of the 11 images


def test_whole_prompts_in_one_step_equal_transformers(qwen_vl):
    path, hf_model, _ = qwen_vl
    llm = LLM(path, dtype="float32", max_num_batched_tokens=2048, num_kv_blocks=256)
    try:
        for text, images in CASES[4:6]:
            output = llm.generate({"prompt": prompt(text, len(images)), "multi_modal_data": {"image": images}}, GREEDY)
            token_ids, _ = llm._vision_processor().process(prompt(text, len(images)), images)
            assert output[0].token_ids == hf_greedy(hf_model, token_ids, images), text
    finally:
        llm.shutdown()


def test_chat_with_image_parts_equals_transformers(qwen_vl):
    import base64
    import io

    _, hf_model, llm = qwen_vl
    picture = image(11, 90, 130)
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "What is this?"}]}]
    chat = llm.chat(messages, GREEDY)[0]
    assert chat.prompt_token_ids.count(hf_model.config.image_token_id) == 3 * 5  # 90 x 130 -> 84 x 140 px
    assert chat.token_ids == hf_greedy(hf_model, chat.prompt_token_ids, [picture])


def test_prefix_cache_hits_keep_the_positions(qwen_vl):
    """A second question after the same image hits the cache through the image, and its text's positions
    (shifted by the image's rope delta) still equal transformers'; a different image gets no hit past it."""
    _, hf_model, llm = qwen_vl
    scheduler = llm.engine.scheduler
    picture = image(30, 150, 170)
    first = prompt("A first question, long enough to fill several blocks of four.", 1)
    llm.reset_prefix_cache()
    llm.generate({"prompt": first, "multi_modal_data": {"image": picture}}, GREEDY)
    second = prompt("A first question, long enough to fill several blocks of four, then more.", 1)
    hits = scheduler.num_prefix_cache_hits
    output = llm.generate({"prompt": second, "multi_modal_data": {"image": picture}}, GREEDY)[0]
    token_ids, records = llm._vision_processor().process(second, [picture])
    assert scheduler.num_prefix_cache_hits - hits > records[0].offset + records[0].length  # past the image
    assert output.token_ids == hf_greedy(hf_model, token_ids, [picture])
    hits = scheduler.num_prefix_cache_hits
    other = llm.generate({"prompt": second, "multi_modal_data": {"image": image(31, 150, 170)}}, GREEDY)[0]
    assert scheduler.num_prefix_cache_hits - hits <= records[0].offset // 4 * 4
    assert other.token_ids == hf_greedy(hf_model, token_ids, [image(31, 150, 170)])


def test_decode_steps_of_an_image_request_run_on_the_decode_stack(qwen_vl):
    _, _, llm = qwen_vl
    executor = llm.engine.model_runner.step_executor
    assert executor.name == "decode stack"
    stack = executor.decode_stack
    calls = []
    forward = stack.forward
    stack.forward = lambda *args, **kwargs: calls.append(1) or forward(*args, **kwargs)
    try:
        llm.generate({"prompt": prompt("Decode me.", 1), "multi_modal_data": {"image": image(50, 60, 60)}}, GREEDY)
    finally:
        del stack.forward
    assert len(calls) == NUM_NEW_TOKENS - 1  # every token after the prompt's


def test_bad_images_fail_the_request_alone(qwen_vl):
    from ipc.messages import ImageInput, PixelDType

    _, _, llm = qwen_vl
    with pytest.raises(ValueError, match="marks 2 images"):
        llm.generate({"prompt": prompt("x", 2), "multi_modal_data": {"image": [image(1, 60, 60)]}}, GREEDY)
    ids, records = llm._vision_processor().process(prompt("x", 1), [image(1, 60, 60)])
    r = records[0]
    odd = ImageInput(bytes(3 * 30 * 56), [1, 3, 30, 56], PixelDType.UINT8, "ab", r.offset, r.length, r.rescale_factor,
                     r.image_mean, r.image_std)
    with pytest.raises(ValueError, match="multiples of 28"):
        llm.engine.add_request("bad", ids, GREEDY, None, None, [odd])
    spread = ids[:r.offset] + [ids[0]] + ids[r.offset:]  # a text token inside the image's tokens
    moved = ImageInput(r.data, r.shape, r.dtype, r.content_hash, r.offset, r.length + 1, r.rescale_factor,
                       r.image_mean, r.image_std)
    spread[r.offset], spread[r.offset + 1] = spread[r.offset + 1], spread[r.offset]
    with pytest.raises(ValueError, match="consecutive"):
        llm.engine.add_request("bad2", spread, GREEDY, None, None, [moved])
    assert llm.generate({"prompt": prompt("still fine", 1), "multi_modal_data": {"image": image(1, 60, 60)}},
                        GREEDY)[0].token_ids


def test_the_published_checkpoint_layout_loads_and_answers_the_same(qwen_vl, tmp_path):
    """Qwen2.5-VL-3B's folder layout: a flat config with rope_scaling {"type": "mrope"}, weights named
    visual.X and model.X."""
    from engine.models.config import ModelConfig
    from scripts.lib.qwen_vl_model import as_published_layout

    path, hf_model, _ = qwen_vl
    published = as_published_layout(path, tmp_path / "published")
    config = ModelConfig.from_folder(published)
    assert (config.rope_scaling, config.attention_bias, config.layer_windows) == (None, True, ())
    assert config.vision.mrope_section == (2, 3, 3) and config.vision.fullatt_block_indexes == (1, 3)
    llm = LLM(published, **ENGINE_KWARGS)
    try:
        text, images = CASES[4]
        output = llm.generate({"prompt": prompt(text, len(images)), "multi_modal_data": {"image": images}}, GREEDY)
        token_ids, _ = llm._vision_processor().process(prompt(text, len(images)), images)
        assert output[0].token_ids == hf_greedy(hf_model, token_ids, images)
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_the_tower_at_the_qwen2_5_vl_3b_shape_equals_transformers():
    """The published vision tower (32 blocks of 1280, full attention in 7/15/23/31, 112-px windows) on a
    224 x 336 px image (6 windows): transformers' merged embeddings, to the bit in fp32."""
    import transformers
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    from engine.models.qwen2_5_vision import Qwen2_5VisionTransformer
    from engine.models.qwen_vision_config import split_qwen2_5_vl_config
    from scripts.lib.qwen_vl_model import QWEN2_5_VL_3B_VISION

    config = transformers.Qwen2_5_VLConfig(vision_config=QWEN2_5_VL_3B_VISION, text_config=dict(
        hidden_size=2048, num_attention_heads=16, num_hidden_layers=1, intermediate_size=64, vocab_size=256,
        bos_token_id=1, eos_token_id=2, rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                                         "mrope_section": [16, 24, 24]}))
    torch.manual_seed(0)
    hf_tower = Qwen2_5_VisionTransformerPretrainedModel._from_config(config.vision_config).eval()
    _, vision = split_qwen2_5_vl_config({**config.to_dict(), "architectures": ["Qwen2_5_VLForConditionalGeneration"]})
    tower = Qwen2_5VisionTransformer(vision).eval()
    tower.load_state_dict(hf_tower.state_dict())
    grid_h, grid_w = 16, 24
    patches = torch.randn(grid_h * grid_w, 3 * 2 * 14 * 14)
    with torch.inference_mode():
        expected = hf_tower(patches, grid_thw=torch.tensor([[1, grid_h, grid_w]])).pooler_output
        assert torch.equal(tower(patches, grid_h, grid_w), expected)  # [96, 2048]
