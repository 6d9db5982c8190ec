"""The ipc contract: codec round trips and rejections, fuzzing, real ZeroMQ sockets, no torch."""

import os
import stat
import subprocess
import sys
import time

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ipc import codec, sockets
from ipc.codec import MESSAGE_CLASSES, DecodeError, decode, encode
from ipc.messages import (
    AbortRequests,
    AddRequest,
    EngineError,
    EngineOutputs,
    EngineReady,
    FinishReason,
    GenerateOutput,
    GenerateRequest,
    Hello,
    MessageType,
    RequestOutput,
    ResetPrefixCache,
    SchedulerStats,
    Shutdown,
    StepCounts,
    TokenLogprobs,
    WatchSteps,
)
from ipc.pooling_params import MAX_EMBEDDING_SIZE, PoolingParams, PoolingType
from ipc.sampling_params import SamplingParams
from ipc.structured_outputs import MAX_REASONING_END_TOKENS

FULL_PARAMS = SamplingParams(
    temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, seed=1234, max_tokens=64, min_tokens=2,
    ignore_eos=True, stop_token_ids=[2, 7], stop=["\n\n", "END"], logprobs=3,
    skip_special_tokens=False, include_stop_str_in_output=True,
)  # fmt: skip
FULL_OUTPUT = RequestOutput(
    request_id="req-1",
    new_token_ids=[5, 6],
    finish_reason=FinishReason.STOP,
    new_logprobs=[TokenLogprobs(5, -0.25, [5, 9], [-0.25, -1.5]), TokenLogprobs(6, -0.5)],
    stop_token_id=6,
    num_cached_tokens=16,
)

# One message per type with every field set, plus ones exercising None and defaults.
MESSAGES = [
    AddRequest("req-1", [1, 2, 3], FULL_PARAMS, arrival_time=12.5),
    AddRequest("req-2", [], SamplingParams(seed=None, max_tokens=None, logprobs=None)),
    AbortRequests(["a", "b", "c"]),
    AbortRequests([]),
    Shutdown("bye"),
    Hello("frontend-0"),
    ResetPrefixCache(),
    EngineReady(1, "tiny-llama", 2048, 32000, 100, 16, eos_token_ids=[2, 32000], dtype="bfloat16"),
    EngineOutputs(1, [FULL_OUTPUT, RequestOutput("req-2", [7])], SchedulerStats(1, 2, 3, 4, 5, 6, 7, 8)),
    EngineOutputs(0, [], SchedulerStats()),
    EngineError("boom", request_id="req-1", is_fatal=True, engine_id=3),
    EngineError("boom"),
    GenerateRequest("g-1", "hello", None, FULL_PARAMS),
    GenerateRequest("g-2", None, [1, 2], SamplingParams()),
    GenerateOutput("g-1", "héllo ✓", [1, 2], FinishReason.LENGTH, error="late failure"),
    GenerateOutput("g-2", "", []),
    # appended since the golden bytes were first recorded
    WatchSteps(True),
    WatchSteps(),
    EngineOutputs(2, [RequestOutput("req-3", [8])], SchedulerStats(), StepCounts(200, 3, 1, 3)),
]


def test_every_message_type_has_a_round_trip_case():
    assert {type(m) for m in MESSAGES} == set(MESSAGE_CLASSES.values())
    assert set(MESSAGE_CLASSES) == set(MessageType)


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    out = decode(encode(msg))
    assert out == msg and type(out) is type(msg)


def test_wire_layout_is_positional_with_int_enums():
    raw = msgpack.unpackb(encode(EngineOutputs(1, [FULL_OUTPUT], SchedulerStats(1, 2, 3, 4, 5))))
    assert raw[0] == int(MessageType.ENGINE_OUTPUTS) and type(raw[0]) is int
    assert raw[1] == 1 and raw[3] == [1, 2, 3, 4, 5, 0, 0, 0, []] and raw[4] is None and len(raw) == 5  # no step counts
    assert raw[2][0][:3] == ["req-1", [5, 6], int(FinishReason.STOP)]
    assert raw[2][0][3][0] == [5, -0.25, [5, 9], [-0.25, -1.5]]


def test_enums_come_back_as_enums():
    out = decode(encode(EngineOutputs(0, [FULL_OUTPUT], SchedulerStats())))
    assert type(out.outputs[0].finish_reason) is FinishReason
    assert type(decode(encode(GenerateOutput("x", "", [], FinishReason.ABORT))).finish_reason) is FinishReason


def test_missing_trailing_fields_take_defaults():
    # An older core's stats (no prefix-cache counters) and outputs (no cached-token count) still decode.
    old = decode(msgpack.packb([MessageType.ENGINE_OUTPUTS, 0, [["r", [1], None, None, None]], [1, 2, 3, 4, 5]]))
    assert old.stats == SchedulerStats(1, 2, 3, 4, 5) and old.outputs[0].num_cached_tokens == 0
    assert decode(msgpack.packb([MessageType.HELLO])) == Hello()
    assert decode(msgpack.packb([MessageType.ADD_REQUEST, "r", [1], []])) == AddRequest("r", [1], SamplingParams())
    assert decode(msgpack.packb([MessageType.ADD_REQUEST, "r", [1], [0.0, 1.0, 5]])).sampling_params == SamplingParams(
        temperature=0.0, top_k=5
    )
    out = decode(msgpack.packb([MessageType.ENGINE_OUTPUTS, 0, [["r", [1]]], []]))
    assert out == EngineOutputs(0, [RequestOutput("r", [1])], SchedulerStats())
    # A core from before EngineReady had a dtype: the field is empty, not an error.
    ready = decode(msgpack.packb([MessageType.ENGINE_READY, 0, "m", 128, 100, 10, 16, [2]]))
    assert ready == EngineReady(0, "m", 128, 100, 10, 16, [2]) and ready.dtype == ""


def test_float_fields_accept_ints():
    out = decode(msgpack.packb([MessageType.ADD_REQUEST, "r", [1], [1, 1], 5]))
    assert type(out.arrival_time) is float and type(out.sampling_params.temperature) is float


def _packed(*items):
    return msgpack.packb(list(items), use_bin_type=True)


def _with_grammar(structured: list) -> list:
    """A SamplingParams array with every field up to structured_outputs, which is `structured`."""
    return [1.0, 1.0, -1, 0.0, None, 16, 0, False, [], [], None, True, False, 1.0, 0.0, 0.0, [], None, [], [], None,
            structured]


REJECTS = {
    "empty": b"",
    "garbage": b"\xc1\xff\x00garbage",
    "truncated": encode(MESSAGES[0])[:-3],
    "trailing_bytes": encode(Hello()) + b"\x00",
    "not_an_array": msgpack.packb(4),
    "empty_array": msgpack.packb([]),
    "map_instead_of_array": msgpack.packb({"type": 4}),
    "map_as_field": _packed(MessageType.HELLO, {"a": 1}),
    "first_element_str": _packed("HELLO"),
    "first_element_bool": _packed(True),
    "first_element_float": _packed(4.0),
    "unknown_type": _packed(99),
    "bool_where_int": _packed(MessageType.ENGINE_OUTPUTS, True, [], []),
    "bool_token_id": _packed(MessageType.ADD_REQUEST, "r", [1, True], []),
    "negative_token_id": _packed(MessageType.ADD_REQUEST, "r", [-1], []),
    "float_token_id": _packed(MessageType.ADD_REQUEST, "r", [1.5], []),
    "int_where_str": _packed(MessageType.ADD_REQUEST, 7, [1], []),
    "request_id_too_long": _packed(MessageType.ADD_REQUEST, "r" * (codec.MAX_REQUEST_ID_LEN + 1), [1], []),
    "request_id_empty": _packed(MessageType.ABORT_REQUESTS, [""]),
    "too_many_abort_ids": _packed(MessageType.ABORT_REQUESTS, ["r"] * (codec.MAX_ABORT_REQUEST_IDS + 1)),
    "too_many_fields": _packed(MessageType.HELLO, "f", "extra"),
    "dtype_not_a_str": _packed(MessageType.ENGINE_READY, 0, "m", 128, 100, 10, 16, [2], 16),
    "dtype_too_long": _packed(MessageType.ENGINE_READY, 0, "m", 128, 100, 10, 16, [2], "x" * (codec.MAX_DTYPE_NAME_LEN + 1)),
    "too_few_fields": _packed(MessageType.ADD_REQUEST, "r", [1]),
    "nested_too_many_fields": _packed(MessageType.ADD_REQUEST, "r", [1], [1.0] * 14),
    "nested_not_array": _packed(MessageType.ADD_REQUEST, "r", [1], None),
    "bad_enum_value": _packed(MessageType.GENERATE_OUTPUT, "r", "", [], 42),
    "bool_temperature": _packed(MessageType.ADD_REQUEST, "r", [1], [True]),
    "str_stop_token_id": _packed(MessageType.ADD_REQUEST, "r", [1], [1.0, 1.0, -1, 0.0, None, 16, 0, False, ["2"]]),
    "bytes_where_str": _packed(MessageType.HELLO, b"frontend"),
    "ext_type": _packed(MessageType.HELLO, msgpack.ExtType(5, b"abc")),
    "timestamp_ext": _packed(MessageType.HELLO, msgpack.Timestamp(1, 0)),
    "invalid_utf8": b"\x92\x04\xa2\xff\xfe",
    "reasoning_end_too_long": _packed(MessageType.ADD_REQUEST, "r", [1], _with_grammar(
        [None, "[0-9]", None, None, False, True, [1] * (MAX_REASONING_END_TOKENS + 1)])),
    "reasoning_end_empty": _packed(MessageType.ADD_REQUEST, "r", [1], _with_grammar(
        [None, "[0-9]", None, None, False, True, []])),
    "too_many_outputs": _packed(
        MessageType.ENGINE_OUTPUTS, 0, [["r", []]] * (codec.MAX_OUTPUTS_PER_STEP + 1), []
    ),
}


@pytest.mark.parametrize("data", REJECTS.values(), ids=REJECTS.keys())
def test_rejects(data):
    with pytest.raises(DecodeError):
        decode(data)


@pytest.mark.parametrize("temperature", [-1.0, float("nan")])
def test_ranges_are_left_to_the_request_check(temperature):
    """The codec types and bounds; ranges fail the request by its id where it is handled."""
    from ipc.sampling_params import check_request

    msg = decode(_packed(MessageType.ADD_REQUEST, "r", [1], [temperature]))
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        check_request(msg.prompt_token_ids, msg.sampling_params, vocab_size=10, max_model_len=100)


def test_a_pooling_prompt_may_fill_the_context_a_generation_prompt_may_not():
    from ipc.pooling_params import POOLING_SAMPLING_PARAMS
    from ipc.sampling_params import check_request

    assert check_request([1] * 100, POOLING_SAMPLING_PARAMS, vocab_size=10, max_model_len=100,
                         is_pooling=True) is POOLING_SAMPLING_PARAMS
    with pytest.raises(ValueError, match="the input is 101 tokens"):
        check_request([1] * 101, POOLING_SAMPLING_PARAMS, vocab_size=10, max_model_len=100, is_pooling=True)
    with pytest.raises(ValueError, match="100 in the prompt, 1 for the completion"):
        check_request([1] * 100, POOLING_SAMPLING_PARAMS, vocab_size=10, max_model_len=100)


def test_rejects_oversized_bytes_before_unpacking():
    data = encode(AddRequest("r", list(range(1000)), SamplingParams()))
    with pytest.raises(DecodeError, match="exceeds the limit"):
        decode(data, max_bytes=len(data) - 1)
    assert decode(data, max_bytes=len(data)).prompt_token_ids[-1] == 999


def test_error_names_the_field():
    with pytest.raises(DecodeError, match=r"EngineOutputs\.outputs\[1\]\.new_token_ids\[0\]"):
        decode(_packed(MessageType.ENGINE_OUTPUTS, 0, [["a", [1]], ["b", ["x"]]], []))


def test_encode_refuses_non_messages():
    with pytest.raises(TypeError):
        encode(SamplingParams())


# ---------------------------------------------------------------- fuzzing

_leaves = st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=20)
_leaves |= st.binary(max_size=20)
_objects = st.recursive(
    _leaves,
    lambda kids: st.lists(kids, max_size=6) | st.dictionaries(st.text(max_size=5) | st.integers(-9, 9), kids, max_size=3),
    max_leaves=25,
)
_type_ids = st.sampled_from([int(t) for t in MessageType]) | st.integers(-5, 30)


def _decode_or_reject(data):
    try:
        decode(data)
    except DecodeError:
        pass


_fuzz = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_fuzz
@given(st.binary(max_size=200))
def test_fuzz_random_bytes(data):
    _decode_or_reject(data)


@_fuzz
@given(_type_ids, st.lists(_objects, max_size=8))
def test_fuzz_typed_msgpack_objects(type_id, fields):
    _decode_or_reject(msgpack.packb([type_id, *fields], use_bin_type=True))


@_fuzz
@given(st.sampled_from(MESSAGES), st.data())
def test_fuzz_mutated_messages(msg, data):
    raw = bytearray(encode(msg))
    for _ in range(data.draw(st.integers(1, 4))):
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    _decode_or_reject(bytes(raw[: data.draw(st.integers(0, len(raw)))]))


# ---------------------------------------------------------------- sockets


def test_router_dealer_exchange():
    ctx = zmq.Context()
    address = sockets.new_ipc_address("engine")
    router = sockets.bind_router(ctx, address)
    dealer = sockets.connect_dealer(ctx, address)
    try:
        path = address[len("ipc://") :]
        assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        with pytest.raises(zmq.Again):
            sockets.recv_message(dealer, flags=zmq.NOBLOCK)

        sockets.send_message(dealer, Hello("fe-1"))
        assert router.poll(5000)
        identity, hello = sockets.recv_routed_message(router)
        assert hello == Hello("fe-1")
        ready = EngineReady(0, "m", 128, 100, 10, 16, [2])
        sockets.send_message(router, ready, identity)
        assert dealer.poll(5000) and sockets.recv_message(dealer) == ready

        sockets.send_message(dealer, MESSAGES[0])
        assert router.poll(5000)
        assert sockets.recv_routed_message(router) == (identity, MESSAGES[0])
        outputs = EngineOutputs(0, [FULL_OUTPUT], SchedulerStats(1, 0, 2, 8, 0))
        sockets.send_message(router, outputs, identity)
        assert dealer.poll(5000) and sockets.recv_message(dealer, flags=zmq.NOBLOCK) == outputs

        dealer.send(b"\xc1")  # garbage from a peer is a DecodeError, and the socket stays usable
        assert router.poll(5000)
        with pytest.raises(DecodeError):
            sockets.recv_routed_message(router)
    finally:
        dealer.close()
        router.close()
        ctx.term()


def test_drain_messages_takes_everything_queued_and_returns_at_once_when_nothing_is():
    """The core's per-step drain: 0 without blocking on an empty socket (its EVENTS check, not a
    raised zmq.Again), every queued message dispatched in order, a malformed one to on_malformed."""
    ctx = zmq.Context()
    address = sockets.new_ipc_address("drain")
    router = sockets.bind_router(ctx, address)
    dealer = sockets.connect_dealer(ctx, address)
    seen, malformed = [], []
    handlers = {Hello: lambda identity, m: seen.append(m), Shutdown: lambda identity, m: seen.append(m)}
    try:
        assert sockets.drain_messages(router, handlers) == 0
        sockets.send_message(dealer, Hello("fe-1"))
        sockets.send_message(dealer, Shutdown("bye"))
        dealer.send(b"\xc1")
        sockets.send_message(dealer, Hello("fe-2"))
        assert router.poll(5000)
        deadline = time.monotonic() + 5
        num = 0
        while num < 4 and time.monotonic() < deadline:  # the four may land over more than one look
            num += sockets.drain_messages(router, handlers, lambda i, p, e: malformed.append(e))
        assert num == 4
        assert seen == [Hello("fe-1"), Shutdown("bye"), Hello("fe-2")] and len(malformed) == 1
        assert sockets.drain_messages(router, handlers) == 0
    finally:
        dealer.close()
        router.close()
        ctx.term()


def test_new_ipc_address_reuses_one_private_dir():
    a, b = sockets.new_ipc_address("x"), sockets.new_ipc_address("x")
    assert a != b and os.path.dirname(a) == os.path.dirname(b)
    with pytest.raises(ValueError):
        sockets.new_ipc_address("../escape")


@pytest.mark.parametrize("address", ["tcp://0.0.0.0:5555", "tcp://10.1.2.3:5555", "tcp://*:5555", "tcp://eth0:1"])
def test_check_bind_address_refuses_remote(address):
    with pytest.raises(ValueError):
        sockets.check_bind_address(address)
    sockets.check_bind_address(address, allow_remote=True)


@pytest.mark.parametrize(
    "address", ["tcp://127.0.0.1:5555", "tcp://127.5.0.1:1", "tcp://localhost:5555", "tcp://[::1]:5555", "ipc:///tmp/x"]
)
def test_check_bind_address_accepts_local(address):
    sockets.check_bind_address(address)


@pytest.mark.parametrize("address", ["udp://127.0.0.1:1", "127.0.0.1:5555", "tcp://127.0.0.1", "tcp://127.0.0.1:x"])
def test_check_bind_address_rejects_malformed(address):
    with pytest.raises(ValueError):
        sockets.check_bind_address(address, allow_remote=True)


def test_ipc_imports_neither_torch_nor_transformers():
    code = "import sys, ipc, ipc.codec, ipc.sockets; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_a_malformed_add_request_names_its_request_when_the_id_reads():
    import msgpack

    from ipc.codec import DecodeError, decode

    with pytest.raises(DecodeError) as bad_tokens:
        decode(msgpack.packb([1, "req-1", "not a token list"]))
    assert bad_tokens.value.request_id == "req-1"
    for payload in ([1, 7, [1, 2]], [1, "x" * 257, [1]], [2, "req-2", 3]):
        with pytest.raises(DecodeError) as bad:
            decode(msgpack.packb(payload))
        assert bad.value.request_id is None, payload


@pytest.mark.parametrize("msg", [
    AddRequest("emb-1", [1, 2], SamplingParams(max_tokens=1), 1.5, PoolingParams(PoolingType.MEAN, normalize=False)),
    EngineOutputs(0, [RequestOutput("emb-1", [], FinishReason.STOP, embedding=[0.25, -1.5, 3e-8])], SchedulerStats()),
    EngineReady(0, "m", 128, 100, 10, 16, [2], "float32", "", hidden_size=576, runner="pooling"),
], ids=lambda m: type(m).__name__)
def test_pooling_round_trip(msg):
    out = decode(encode(msg))
    assert out == msg and type(out) is type(msg)


def test_pooling_fields_round_trip_and_older_peers_decode():
    # An embedding request and its answer: the pooling record and the vector come back as sent.
    request = decode(encode(AddRequest("e", [3], SamplingParams(), 0.0, PoolingParams())))
    assert request.pooling_params == PoolingParams(PoolingType.LAST, True)
    assert type(request.pooling_params.pooling_type) is PoolingType
    output = decode(encode(EngineOutputs(0, [RequestOutput("e", [], FinishReason.STOP, embedding=[1.0, 0.5])],
                                         SchedulerStats())))
    assert output.outputs[0].embedding == [1.0, 0.5] and output.outputs[0].new_token_ids == []
    # A frontend or core from before pooling: no pooling record, no embedding, no hidden size.
    assert decode(msgpack.packb([MessageType.ADD_REQUEST, "r", [1], []])).pooling_params is None
    assert decode(msgpack.packb([MessageType.ENGINE_OUTPUTS, 0, [["r", [1]]], []])).outputs[0].embedding is None
    ready = decode(msgpack.packb([MessageType.ENGINE_READY, 0, "m", 128, 100, 10, 16, [2]]))
    assert ready.hidden_size == 0 and ready.runner == ""


def test_pooling_fields_are_bounded_and_typed():
    too_long = RequestOutput("e", [], FinishReason.STOP, embedding=[0.0] * (MAX_EMBEDDING_SIZE + 1))
    with pytest.raises(DecodeError):
        decode(encode(EngineOutputs(0, [too_long], SchedulerStats())))
    for bad_pooling in ([3, True], [1, 1], ["last", True], [1, True, 0]):  # unknown type, int bool, str, extra
        with pytest.raises(DecodeError):
            decode(msgpack.packb([MessageType.ADD_REQUEST, "r", [1], [], 0.0, bad_pooling]))
    with pytest.raises(DecodeError):  # a vector of strings is no embedding
        decode(msgpack.packb([MessageType.ENGINE_OUTPUTS, 0, [["r", [], 1, None, None, 0, None, 0, 0, ["x"]]], []]))
    with pytest.raises(ValueError, match="normalize"):
        PoolingParams(normalize=1).validate()


def test_an_image_round_trips_as_raw_bytes_within_its_bounds():
    from ipc.messages import MAX_IMAGE_BYTES, ImageInput, PixelDType

    image = ImageInput(bytes(range(256)) * 3, [1, 3, 16, 16], PixelDType.UINT8, "f" * 64, 4, 20, 1 / 255,
                       [0.5] * 3, [0.5] * 3)
    msg = AddRequest("img", [1] * 30, SamplingParams(), images=[image, image])
    assert decode(encode(msg)) == msg
    fields = msgpack.unpackb(encode(msg))  # ..., images, lora_request
    assert isinstance(fields[-2][0][0], bytes)  # msgpack bin: the pixels travel as raw bytes, never pickled
    for bad in ([0, 3, 16, 16], [1, 3, 16]):  # a zero dimension; not 4 dimensions
        fields[-2][0][1] = bad
        with pytest.raises(DecodeError):
            decode(msgpack.packb(fields))
    fields = msgpack.unpackb(encode(msg))
    fields[-2][0][0] = b"x" * (MAX_IMAGE_BYTES + 1)
    with pytest.raises(DecodeError):
        decode(msgpack.packb(fields), max_bytes=2 * MAX_IMAGE_BYTES)
def test_lora_request_round_trips_and_is_bounded():
    from ipc.messages import LoRARequest

    message = AddRequest("l", [3], SamplingParams(), 0.0, None, lora_request=LoRARequest("sql", 3, "/adapters/sql"))
    out = decode(encode(message))
    assert out == message and type(out.lora_request) is LoRARequest
    for bad in (["", 1, "/p"], ["a", 0, "/p"], ["a", 2**31, "/p"], ["a", "1", "/p"]):  # empty name, ids from 1
        with pytest.raises(Exception):
            decode(msgpack.packb([MessageType.ADD_REQUEST, "r", [1], [], 0.0, None, [], bad]))
