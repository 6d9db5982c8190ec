"""What the n-gram and prediction proposers propose (engine/spec_decode): plain objects, no model."""

from __future__ import annotations

from array import array

from engine.core.request import Request
from engine.spec_decode.ngram_proposer import encode, find_after, propose_ngram
from engine.spec_decode.prediction_proposer import propose_prediction
from ipc.messages import SpecMethod
from ipc.sampling_params import SamplingParams


def test_find_after_takes_the_leftmost_or_rightmost_match_with_a_token_after_it():
    haystack = [1, 2, 3, 9, 1, 2, 4, 1, 2]
    assert find_after(haystack, [1, 2]) == 2
    assert find_after(haystack, [1, 2], last=True) == 6  # the match at the end has nothing after it
    assert find_after(haystack, [1, 2], start=1) == 6
    assert find_after(haystack, [1, 2], end=5) == 2
    assert find_after(haystack, [2, 4], last=True) == 7
    assert find_after(haystack, [4, 4]) is None
    assert find_after([5, 1, 2], [1, 2], last=True) is None


def test_find_after_never_matches_across_token_boundaries():
    # Little-endian, [0x200, 0x300, 0] is 00 02 00 00 00 03 00 00 00 00 00 00: from its second byte
    # on it reads as the ids 2, 3, a match that is no match.
    haystack = [0x00000200, 0x00000300, 0, 7]
    assert bytes(array("i", haystack))[1:9] == bytes(array("i", [2, 3]))
    assert find_after(haystack, [2, 3]) is None
    assert find_after(haystack, [2, 3], last=True) is None
    assert find_after(haystack + [2, 3, 8], [2, 3], last=True) == 6


def _find_after_by_hand(haystack, suffix, end, start, last):
    """find_after's definition, written out: every aligned match within [start, end) with a token after it."""
    n = len(suffix)
    afters = [i + n for i in range(start, end - n + 1) if haystack[i:i + n] == suffix and i + n < end]
    if not afters or not suffix:
        return None
    return afters[-1] if last else afters[0]


def test_find_after_matches_its_definition_with_and_without_the_encoded_haystack():
    import random

    rng = random.Random(0)
    for _ in range(2000):
        # Ids that share bytes (256 + small, small * 65536) make misaligned byte matches likely.
        haystack = [rng.choice([1, 2, 256 + 1, 2 * 65536, 0]) for _ in range(rng.randint(0, 14))]
        suffix = [rng.choice([1, 2, 256 + 1, 2 * 65536, 0]) for _ in range(rng.randint(1, 3))]
        end = rng.randint(0, len(haystack))
        start = rng.randint(0, end)
        last = rng.random() < 0.5
        expected = _find_after_by_hand(haystack, suffix, end, start, last)
        assert find_after(haystack, suffix, end, start, last) == expected, (haystack, suffix, end, start, last)
        assert find_after(haystack, suffix, end, start, last, encoded=encode(haystack)) == expected


def test_ngram_proposes_what_followed_the_latest_occurrence_of_the_longest_suffix():
    tokens = [10, 11, 12, 13, 50, 10, 11, 12, 14, 60, 11, 12]
    # suffix [11, 12] occurs at 1 and 6: the latest is followed by 14, 60
    assert propose_ngram(tokens, 2, 1, 3) == [14, 60]
    assert propose_ngram(tokens + [14], 3, 1, 4) == [60, 11, 12]  # [11, 12, 14] at 6
    assert propose_ngram([1, 2, 3], 4, 1, 3) == []
    assert propose_ngram(tokens, 0, 1, 3) == []


def make_request(prompt: list[int], prediction: list[int], output: list[int]) -> Request:
    params = SamplingParams(max_tokens=64)
    params.prediction_token_ids = prediction
    request = Request("r", prompt, params, max_tokens=64)
    request.all_token_ids.extend(output)
    return request


def test_a_prediction_is_followed_in_order_while_the_output_agrees():
    request = make_request([7, 7], [1, 2, 3, 4, 5, 6], [1, 2])
    assert propose_prediction(request, 3) == ([3, 4, 5], SpecMethod.PREDICTION)
    request.all_token_ids.extend([3, 4])
    assert propose_prediction(request, 8) == ([5, 6], SpecMethod.PREDICTION)


def test_after_an_edit_the_prediction_resumes_past_where_the_output_last_stood():
    # 20 21 occurs twice in the prediction; the output had followed it to position 6.
    prediction = [20, 21, 30, 31, 32, 33, 34, 20, 21, 40, 41]
    request = make_request([7], prediction, [20, 21, 30, 31, 32, 33])
    assert propose_prediction(request, 2)[0] == [34, 20]
    request.all_token_ids.extend([99, 20, 21])  # an edit (99), then 20 21 again
    assert propose_prediction(request, 2) == ([40, 41], SpecMethod.PREDICTION)


def test_a_diverged_prediction_falls_back_to_the_requests_own_tokens_counted_as_ngram():
    prompt = [5, 6, 8, 9, 10, 11]
    request = make_request(prompt, [1, 2, 3], [1, 5, 6, 8])
    assert propose_prediction(request, 3) == ([9, 10, 11], SpecMethod.NGRAM)
    nothing = make_request([5, 6], [1, 2, 3], [1, 70, 71])
    assert propose_prediction(nothing, 3) == ([], SpecMethod.NGRAM)
