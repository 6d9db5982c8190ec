"""Idefics3 (SmolVLM): images in, text out. Greedy fp32 tokens equal transformers' generate on a tiny
random checkpoint served as SmolVLM is (its tokenizer's special tokens, chat template, image splitting),
with prefill chunks cut through images' tokens and image requests batched beside text-only ones; the
frames are transformers' image processor's, bit for bit; a repeated image runs the encoder once; a
different image behind the same text gets no prefix-cache hit, the same one does."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from engine import LLM, SamplingParams
from engine.worker.step_inputs import pixels_to_tensor
from scripts.lib.vision_model import (
    SMOLVLM_256M_TEXT, SMOLVLM_256M_VISION, make_tiny_smolvlm,
)

NUM_NEW_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
# 4-token blocks, 16-token chunks: an image's 20-76 tokens span several chunks and blocks.
ENGINE_KWARGS = dict(dtype="float32", block_size=4, max_num_batched_tokens=16, num_kv_blocks=512)


def image(seed: int, height: int, width: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def prompt(text: str, num_images: int) -> str:
    return "User:" + "<image>" * num_images + text + "<end_of_utterance>\nAssistant:"


@pytest.fixture(scope="module")
def smolvlm(tmp_path_factory):
    path, hf_model = make_tiny_smolvlm(tmp_path_factory.mktemp("smolvlm"))
    llm = LLM(path, **ENGINE_KWARGS)
    yield path, hf_model, llm
    llm.shutdown()


def hf_processor(crop_size: int = 32, longest_edge: int = 64):
    from transformers import Idefics3ImageProcessorPil

    return Idefics3ImageProcessorPil(size={"longest_edge": longest_edge}, max_image_size={"longest_edge": crop_size},
                                     resample=1)


def hf_greedy(hf_model, token_ids: list[int], images: list[Image.Image], processor) -> list[int]:
    kwargs = {}
    if images:
        pixels = processor(images=[images], return_tensors="np")
        kwargs = dict(pixel_values=torch.from_numpy(pixels["pixel_values"]),
                      pixel_attention_mask=torch.from_numpy(pixels["pixel_attention_mask"]))
    with torch.no_grad():
        out = hf_model.generate(input_ids=torch.tensor([token_ids]), max_new_tokens=NUM_NEW_TOKENS, do_sample=False,
                                **kwargs)
    return out[0, len(token_ids):].tolist()


CASES = [  # (text, images): 1-2 images, split (2 x 2 crops + global: 20 tokens) or whole (4 tokens)
    ("Describe this.", [image(1, 40, 70)]),
    ("What is here?", [image(2, 64, 64)]),
    ("Tall one.", [image(3, 90, 30)]),
    ("Small one.", [image(4, 20, 24)]),
    ("Compare the two.", [image(5, 50, 50), image(6, 33, 77)]),
    ("Two small ones.", [image(7, 16, 16), image(8, 30, 20)]),
    ("A long question about the picture, asked with many words so the text spans chunks too.", [image(9, 64, 40)]),
    ("Same picture twice.", [image(10, 48, 48), image(10, 48, 48)]),
    ("Grey.", [Image.new("RGB", (37, 53), (128, 128, 128))]),
    ("Black and wide.", [Image.new("RGB", (100, 30), (0, 0, 0))]),
]


def test_frames_are_transformers_image_processors_bit_for_bit(smolvlm):
    _, _, llm = smolvlm
    processor = hf_processor()
    for text, images in CASES:
        _, records = llm._vision_processor().process(prompt(text, len(images)), images)
        expected = processor(images=[images], return_tensors="np")["pixel_values"][0]  # [frames, 3, 32, 32]
        ours = torch.cat([pixels_to_tensor(r, torch.device("cpu")) for r in records]).numpy()
        assert ours.shape == expected.shape and np.array_equal(ours, expected), text


def test_greedy_tokens_equal_transformers_with_text_requests_beside(smolvlm):
    _, hf_model, llm = smolvlm
    processor = hf_processor()
    requests = [{"prompt": prompt(text, len(images)), "multi_modal_data": {"image": images}} for text, images in CASES]
    texts = ["User: no picture here, just words.<end_of_utterance>\nAssistant:", "Once upon a time"]
    outputs = llm.generate(requests + texts, GREEDY)  # one batch: image requests beside text-only ones
    vision = llm._vision_processor()
    num_cut = 0  # images whose tokens a 16-token prefill chunk boundary cuts through
    for (text, images), output in zip(CASES, outputs):
        token_ids, records = vision.process(prompt(text, len(images)), images)
        num_cut += sum(r.offset // 16 != (r.offset + r.length - 1) // 16 for r in records)
        assert output.token_ids == hf_greedy(hf_model, token_ids, images, processor), text
    for text, output in zip(texts, outputs[len(CASES):]):
        token_ids = llm.tokenizer.encode(text)
        assert output.token_ids == hf_greedy(hf_model, token_ids, [], processor), text
    assert num_cut >= 5


def test_chat_with_image_parts_equals_generate(smolvlm):
    _, _, llm = smolvlm
    picture = image(11, 40, 60)
    import base64
    import io

    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "What is this?"}]}]
    chat = llm.chat(messages, GREEDY)[0]
    text = llm.tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text",
                                              "text": "What is this?"}]}], True)
    token_ids, records = llm._vision_processor().process(text, [picture], add_special_tokens=False)
    assert chat.prompt_token_ids == token_ids
    assert chat.token_ids == llm.generate({"prompt": text, "multi_modal_data": {"image": picture}}, GREEDY)[0].token_ids


def test_a_repeated_image_runs_the_encoder_once(smolvlm):
    _, _, llm = smolvlm
    cache = llm.engine.model_runner.encoder_cache
    picture = image(20, 64, 64)
    before = cache.num_encoder_runs
    first = llm.generate({"prompt": prompt("First question.", 1), "multi_modal_data": {"image": picture}}, GREEDY)
    assert cache.num_encoder_runs == before + 1
    second = llm.generate({"prompt": prompt("A different question.", 1), "multi_modal_data": {"image": picture}},
                          GREEDY)
    assert cache.num_encoder_runs == before + 1  # the cache's, not a second run
    assert first[0].token_ids and second[0].token_ids


def test_prefix_cache_keys_include_the_image(smolvlm):
    _, _, llm = smolvlm
    scheduler = llm.engine.scheduler
    text = prompt("The same words behind a picture, long enough to fill several blocks.", 1)
    llm.reset_prefix_cache()
    llm.generate({"prompt": text, "multi_modal_data": {"image": image(30, 64, 64)}}, GREEDY)
    hits = scheduler.num_prefix_cache_hits
    other = llm.generate({"prompt": text, "multi_modal_data": {"image": image(31, 64, 64)}}, GREEDY)
    # Blocks before the image's first token match (the same "User:" text), none from the image on.
    vision = llm._vision_processor()
    _, records = vision.process(text, [image(31, 64, 64)])
    assert scheduler.num_prefix_cache_hits - hits <= records[0].offset // 4 * 4
    hits = scheduler.num_prefix_cache_hits
    again = llm.generate({"prompt": text, "multi_modal_data": {"image": image(31, 64, 64)}}, GREEDY)
    assert scheduler.num_prefix_cache_hits - hits > records[0].offset + records[0].length  # the image's blocks hit
    assert again[0].token_ids == other[0].token_ids


def test_bad_images_fail_the_request_alone(smolvlm, tmp_path):
    path, _, llm = smolvlm
    with pytest.raises(ValueError, match="marks 2 images"):
        llm.generate({"prompt": prompt("x", 2), "multi_modal_data": {"image": [image(1, 8, 8)]}}, GREEDY)
    ids, records = llm._vision_processor().process(prompt("x", 1), [image(1, 40, 40)])
    with pytest.raises(ValueError, match="placeholder tokens that no image fills"):
        llm.engine.add_request("bad", ids[:-3] + [ids[records[0].offset]] * 3, GREEDY, None, None, records[:0])
    assert llm.generate({"prompt": prompt("still fine", 1), "multi_modal_data": {"image": image(1, 40, 40)}},
                        GREEDY)[0].token_ids


def test_an_image_to_a_text_only_model_is_refused(tmp_path):
    from tests.helpers.models import make_tiny_model

    path, _ = make_tiny_model(tmp_path, "LlamaForCausalLM")
    from engine.loop.engine_core import EngineCore
    from engine.config import EngineConfig
    from ipc.messages import ImageInput, PixelDType

    core = EngineCore(EngineConfig(model=path, dtype="float32", num_kv_blocks=64))
    record = ImageInput(bytes(3 * 32 * 32), [1, 3, 32, 32], PixelDType.UINT8, "ab", 0, 1, 1 / 255, [0.5] * 3, [0.5] * 3)
    with pytest.raises(ValueError, match="text-only"):
        core.add_request("r", [1, 2, 3], SamplingParams(max_tokens=2), None, None, [record])
    core.shutdown()


@pytest.mark.slow
def test_smolvlm_256m_shape_equals_transformers(tmp_path):
    """The published shape: SigLIP-B/16 at 512 px, pixel shuffle 4, SmolLM2-135M's text model."""
    path, hf_model = make_tiny_smolvlm(tmp_path, crop_size=512, longest_edge=1024, vision=SMOLVLM_256M_VISION,
                                       text=SMOLVLM_256M_TEXT, scale_factor=4, name="SmolVLM-256M-shape")
    llm = LLM(path, dtype="float32", max_num_batched_tokens=256, num_kv_blocks=256)
    picture = image(40, 600, 500)  # 2 x 2 crops of 512 and the global view: 5 x 64 tokens
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    text = prompt("What is in this image?", 1)
    out = llm.generate({"prompt": text, "multi_modal_data": {"image": picture}}, params)[0]
    token_ids, _ = llm._vision_processor().process(text, [picture])
    from transformers import Idefics3ImageProcessorPil

    processor = Idefics3ImageProcessorPil(size={"longest_edge": 1024}, max_image_size={"longest_edge": 512}, resample=1)
    pixels = processor(images=[[picture]], return_tensors="np")
    with torch.no_grad():
        expected = hf_model.generate(input_ids=torch.tensor([token_ids]), max_new_tokens=4, do_sample=False,
                                     pixel_values=torch.from_numpy(pixels["pixel_values"]),
                                     pixel_attention_mask=torch.from_numpy(pixels["pixel_attention_mask"]))
    assert out.token_ids == expected[0, len(token_ids):].tolist()
    llm.shutdown()


def test_decode_steps_of_an_image_request_run_on_the_decode_stack(smolvlm):
    _, _, llm = smolvlm
    executor = llm.engine.model_runner.step_executor
    assert executor.name == "decode stack"
    stack = executor.decode_stack
    calls = []
    forward = stack.forward
    stack.forward = lambda *args, **kwargs: calls.append(1) or forward(*args, **kwargs)
    try:
        llm.generate({"prompt": prompt("Decode me.", 1), "multi_modal_data": {"image": image(50, 40, 40)}}, GREEDY)
    finally:
        del stack.forward
    assert len(calls) == NUM_NEW_TOKENS - 1  # every token after the prompt's


def test_prompt_tokens_equal_transformers_idefics3_processor(smolvlm):
    """The expansion of each <image> (crops' row/column tags, the global view) is transformers' own."""
    from transformers import Idefics3Processor, PreTrainedTokenizerFast

    path, _, llm = smolvlm
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=f"{path}/tokenizer.json")
    processor = Idefics3Processor(hf_processor(), tokenizer, image_seq_len=4)
    for text, images in CASES:
        expected = processor(text=[prompt(text, len(images))], images=[images])["input_ids"][0]
        assert llm._vision_processor().process(prompt(text, len(images)), images)[0] == list(expected), text
