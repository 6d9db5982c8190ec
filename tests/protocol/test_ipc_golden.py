"""Golden bytes: the wire encoding of every message type, recorded from the hand-written
codec before the records became msgspec Structs. docs/protocol.md is these bytes;
a change here is a change of the wire format, which must stay append-only."""

from __future__ import annotations

import hashlib

import msgpack
import pytest

from ipc.codec import decode, encode
from ipc.messages import AddRequest, FinishReason, GenerateOutput, GenerateRequest, MessageType
from ipc.sampling_params import SamplingParams
from ipc.structured_outputs import StructuredOutputsParams
from tests.protocol.test_ipc import MESSAGES

# Bounds of every integer width, str8/str16/str32, negative and unsigned 64-bit ints.
EDGES = [
    AddRequest("x" * 40, [0, 127, 128, 255, 256, 65535, 65536, 2**31 - 1],
               SamplingParams(temperature=0, top_k=2**31 - 1, seed=-(2**63), max_tokens=2**31 - 1,
                              stop=["é" * 100]), arrival_time=1.7e9),
    AddRequest("y", [1], SamplingParams(seed=2**63 - 1, min_p=1, top_p=0.5, logprobs=20)),
    GenerateOutput("z", "t" * 300, [1] * 20, FinishReason.ERROR, "e" * 70000),
    # Every field appended since: penalties, logit_bias pairs, allowed and bad words, prompt log-probs, a grammar.
    AddRequest("n", [1], SamplingParams(
        repetition_penalty=1.5, frequency_penalty=-2.0, presence_penalty=2.0, logit_bias=[(0, -100.0), (5, 1.5)],
        allowed_token_ids=[1, 2], bad_words=["x"], bad_words_token_ids=[[3, 4]], prompt_logprobs=2,
        structured_outputs=StructuredOutputsParams(json='{"type": "object"}'))),
    # A grammar that waits for the end of the reasoning (--reasoning-parser).
    AddRequest("r", [1], SamplingParams(structured_outputs=StructuredOutputsParams(
        regex="[0-9]+", reasoning_end_token_ids=[151668]))),
]
# hex, or "sha256:" + the digest for the long ones
# SamplingParams.prediction_token_ids, RequestOutput's prediction counts and SchedulerStats.spec_decode appended;
# then AddRequest.pooling_params, RequestOutput.embedding, EngineReady's hidden_size and runner;
# then EngineOutputs.step_counts (a trailing nil while no dashboard watches) and WatchSteps;
# then AddRequest.images (a trailing empty array without images) and AddRequest.lora_request (a trailing nil
# for the base model).
GOLDEN = [
'sha256:1184bdaeaee2184396ff2a4c43b59ce765e670fd8aff8fdb69aee406011a0bf7',
    '9801a57265712d3290dc0017cb3ff0000000000000cb3ff0000000000000ffcb0000000000000000c0c000c29090c0c3c2cb3ff0000000000000cb0000000000000000cb000000000000000090c09090c0c0c0cb0000000000000000c090c0',
    '920293a161a162a163',
    '920290',
    '9203a3627965',
    '9204aa66726f6e74656e642d30',
    '9105',
    '9c0a01aa74696e792d6c6c616d61cd0800cd7d0064109202cd7d00a862666c6f61743136a000a0',  # EngineReady: quantization appended
    '950b01929aa57265712d3192050601929405cbbfd000000000000092050992cbbfd0000000000000cbbff80000000000009406cbbfe000000000000090900610c00000c09aa57265712d329107c0c0c000c00000c099010203040506070890c0',  # step_counts appended
    '950b009099000000000000000090c0',
    '960ca4626f6f6da57265712d31c303c2',  # EngineError: is_request_error appended
    '960ca4626f6f6dc0c200c2',
    '9514a3672d31a568656c6c6fc0dc0017cb3fe6666666666666cb3feccccccccccccd28cb3fa999999999999acd04d24002c392020792a20a0aa3454e4403c2c3cb3ff0000000000000cb0000000000000000cb000000000000000090c09090c0c0c0',
    '9514a3672d32c0920102dc0017cb3ff0000000000000cb3ff0000000000000ffcb0000000000000000c01000c29090c0c3c2cb3ff0000000000000cb0000000000000000cb000000000000000090c09090c0c0c0',
    '9615a3672d31aa68c3a96c6c6f20e29c9392010202ac6c617465206661696c757265',
    '9615a3672d32a090c0c0',
    '9206c3',  # WatchSteps, then EngineOutputs with its step_counts
    '9206c2',
    '950b02919aa57265712d339108c0c0c000c00000c09900000000000000009094ccc8030103',
    'sha256:80b00ba962c1987b90545dba014a6a5987dce4e19a519f63362f16d357572296',
    '9801a1799101dc0017cb3ff0000000000000cb3fe0000000000000ff01cf7fffffffffffffff1000c2909014c3c2cb3ff0000000000000cb0000000000000000cb000000000000000090c09090c0c0c0cb0000000000000000c090c0',
    'sha256:bbb1691909f603ed9a10198724c6cd71fb617d2f821de61be43d90316c3d8f9d',
    'sha256:5b83c006eeb2905f77ed9fda4f618dda52871ff271da52b9438d89e6c2681b21',  # reasoning_end_token_ids appended
    'sha256:9d53a96a3e2904b212ee29bb5a04aed177e381417e6153bb756a2e390f71d39d',
]


def recorded(data: bytes) -> str:
    return data.hex() if len(data) <= 100 else "sha256:" + hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize("msg, golden", list(zip(MESSAGES + EDGES, GOLDEN)),
                         ids=[type(m).__name__ for m in MESSAGES + EDGES])
def test_encoding_is_byte_identical_to_the_recorded_one(msg, golden):
    data = encode(msg)
    assert recorded(data) == golden
    assert decode(data) == msg


def test_the_readmes_raw_msgpack_example_still_speaks_the_protocol():
    params = [0.0, 1.0, -1, 0.0, None, 32, 0, False, [], [], None, True, False]
    request = decode(msgpack.packb([20, "req-1", "Once upon a time", None, params]))
    assert request == GenerateRequest("req-1", "Once upon a time", None,
                                      SamplingParams(temperature=0.0, max_tokens=32))
    _, request_id, text, token_ids, finish_reason, error = msgpack.unpackb(
        encode(GenerateOutput("req-1", "Once", [7], FinishReason.LENGTH)))
    assert (request_id, text, token_ids, finish_reason, error) == ("req-1", "Once", [7], 2, None)
    assert msgpack.unpackb(encode(GenerateOutput("r", "", [])))[0] == MessageType.GENERATE_OUTPUT


def test_a_grammar_from_before_reasoning_end_token_ids_still_decodes():
    """Append-only: a peer that sends the six fields of StructuredOutputsParams gets no end tokens."""
    msg = EDGES[3]
    fields = msgpack.unpackb(encode(msg))
    structured = fields[3][-2]  # prediction_token_ids was appended after it
    assert structured[-1] is None  # reasoning_end_token_ids, the appended field
    fields[3][-2] = structured[:-1]
    assert decode(msgpack.packb(fields)) == msg


def test_an_add_request_from_before_images_and_lora_still_decodes():
    """Append-only: a peer that sends AddRequest without its last fields (images, then lora_request)
    sends a text request to the base model."""
    for msg in [m for m in MESSAGES + EDGES if isinstance(m, AddRequest)]:
        fields = msgpack.unpackb(encode(msg))
        assert fields[-2:] == [[], None]  # images, lora_request: the appended fields
        assert decode(msgpack.packb(fields[:-1])) == msg  # before lora_request
        assert decode(msgpack.packb(fields[:-2])) == msg  # before images


def test_an_add_request_from_before_lora_still_decodes_to_the_base_model():
    # AddRequest("req-2", [], ...) as peers encoded it before images and lora_request were appended.
    old = bytes.fromhex('9601a57265712d3290dc0017cb3ff0000000000000cb3ff0000000000000ffcb0000000000000000c0c000c29090'
                        'c0c3c2cb3ff0000000000000cb0000000000000000cb000000000000000090c09090c0c0c0cb0000000000000000c0')
    message = decode(old)
    assert message == MESSAGES[1] and message.lora_request is None and message.images == []
