"""The step's encoder budget cuts a chunk before an image that would pass it (never starving a
request), and block keys carry the hashes of the images they cover."""

from __future__ import annotations

from engine.core.encoder_budget import EncoderBudget
from engine.core.request import Request
from ipc.messages import ImageInput, PixelDType
from ipc.sampling_params import SamplingParams


def image(offset: int, length: int, content_hash: str = "a") -> ImageInput:
    return ImageInput(b"", [1, 3, 2, 2], PixelDType.UINT8, content_hash, offset, length)


def request(images: list[ImageInput], num_tokens: int = 100) -> Request:
    return Request("r", list(range(num_tokens)), SamplingParams(), 10, images=images)


def test_a_chunk_stops_before_the_image_that_passes_the_budget():
    budget = EncoderBudget(20)
    r = request([image(10, 16), image(40, 16)])
    assert budget.fit(r, 5, 55) == 35  # img0 costs 16; img1 would make 32 > 20: stop at 40
    assert budget.num_used == 16


def test_an_image_larger_than_the_budget_runs_alone():
    budget = EncoderBudget(8)
    r = request([image(0, 30)])
    assert budget.fit(r, 0, 50) == 50
    other = request([image(3, 4)])
    assert budget.fit(other, 0, 50) == 3  # the budget is spent: the second request stops before its image
    budget.reset()
    assert budget.fit(other, 3, 50) == 50


def test_a_chunk_that_starts_inside_an_image_costs_nothing_for_it():
    budget = EncoderBudget(4)
    budget.num_used = 4
    assert budget.fit(request([image(0, 30)]), 16, 10) == 10


def test_text_requests_are_not_touched():
    assert EncoderBudget(0).fit(request([]), 0, 64) == 64


def test_block_keys_include_the_images_they_cover():
    one = request([image(5, 4, "one")], 16)
    two = request([image(5, 4, "two")], 16)
    same = request([image(5, 4, "one")], 16)
    keys_one, keys_two = one.extend_block_hashes(4, 4), two.extend_block_hashes(4, 4)
    assert keys_one[0] == keys_two[0]  # tokens 0-3: before the image
    assert keys_one[1] != keys_two[1] and keys_one[2] != keys_two[2]  # tokens 4-11 hold image tokens
    assert same.extend_block_hashes(4, 4) == keys_one
