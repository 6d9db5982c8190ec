"""CUDA graphs for decode steps (engine/worker/cuda_graphs.py).

On the CPU: bucket choice, padding a decode batch into the static buffers, the
synthetic validation batch, the cases that leave graphs off, and the forward a
graph captures (padded rows, num_splits and max_seq_len fixed for max_model_len)
against the eager forward, under Triton's interpreter. With a fake graph (replay
reruns that forward) the runner's whole flow goes through the engine: capture,
validation, replayed decode steps, and the fall-back to eager on a mismatch or a
capture error. On a GPU: real graphs give enforce_eager's greedy tokens.
"""

import os
from types import SimpleNamespace

import torch

# As in test_kernels.py: the interpreter must be chosen before triton is first imported.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from engine.worker.cuda_graphs import (  # noqa: E402
    PAD_BLOCK_ID,
    PAD_SEQ_LEN,
    PAD_SLOT_ID,
    CudaGraphRunner,
    DecodeInputs,
    bucket_for,
    capture_sizes,
    decode_forward,
    disabled_reason,
    pad_decode_inputs,
)
from engine.worker.cuda_graph_check import check_replays, make_validation_batch, max_row_error  # noqa: E402
from tests.helpers.models import make_tiny_model  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"

@pytest.fixture(scope="module")
def tiny_model_path(tmp_path_factory) -> str:
    """A random 2-layer Llama, GQA groups of 2 (head_dim 16)."""
    path, _ = make_tiny_model(tmp_path_factory.mktemp("graphs"), "LlamaForCausalLM", vocab_size=128, hidden_size=64,
                              intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                              rms_norm_eps=1e-6)
    return path


def test_capture_sizes():
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 32, 64]
    assert capture_sizes(48) == [1, 2, 4, 8, 16, 32, 48]  # max_num_seqs itself is the last bucket
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(1) == [1]
    assert capture_sizes(4096)[-2:] == [256, 512]  # capped: big batches run eagerly


@pytest.mark.parametrize(
    "num_seqs, bucket", [(1, 1), (2, 2), (3, 4), (5, 8), (8, 8), (17, 32), (33, 48), (48, 48), (49, None)]
)
def test_bucket_for(num_seqs, bucket):
    assert bucket_for(num_seqs, capture_sizes(48)) == bucket


def test_pad_decode_inputs_copies_real_rows_and_pads_the_rest():
    static = DecodeInputs.padding(8, 5, "cpu")
    # A previous, larger batch left every row and column stale.
    for tensor in (static.input_ids, static.positions, static.slot_mapping, static.seq_lens, static.block_tables):
        tensor.fill_(7)
    input_ids = torch.tensor([11, 12, 13])
    positions = torch.tensor([40, 3, 17])
    slot_mapping = torch.tensor([104, 51, 33])
    seq_lens = torch.tensor([41, 4, 18], dtype=torch.int32)
    block_tables = torch.tensor([[9, 6], [3, 0], [2, 5]], dtype=torch.int32)

    pad_decode_inputs(static, input_ids, positions, slot_mapping, seq_lens, block_tables, num_padded=4)

    assert static.input_ids[:3].tolist() == [11, 12, 13]
    assert static.positions[:3].tolist() == [40, 3, 17]
    assert static.slot_mapping[:3].tolist() == [104, 51, 33]
    assert static.seq_lens[:3].tolist() == [41, 4, 18]
    assert torch.equal(static.block_tables[:3, :2], block_tables)
    # Row 3 is padding: writes nothing, reads one token of block 0.
    assert static.input_ids[3] == 0 and static.positions[3] == 0
    assert static.slot_mapping[3] == PAD_SLOT_ID == -1
    assert static.seq_lens[3] == PAD_SEQ_LEN == 1
    assert static.block_tables[3, 0] == PAD_BLOCK_ID == 0
    # Past the bucket and past each row's width nothing is touched (never read).
    assert static.input_ids[4:].eq(7).all() and static.slot_mapping[4:].eq(7).all()
    assert static.block_tables[:3, 2:].eq(7).all() and static.block_tables[4:].eq(7).all()
    assert static.query_start_loc.tolist() == list(range(9))


def test_pad_decode_inputs_exact_bucket_and_limits():
    static = DecodeInputs.padding(4, 3, "cpu")
    ids = torch.arange(4)
    lens = torch.ones(4, dtype=torch.int32)
    pad_decode_inputs(static, ids, ids, ids, lens, torch.ones(4, 3, dtype=torch.int32), num_padded=4)
    assert static.slot_mapping.tolist() == [0, 1, 2, 3]  # a full bucket has no padding row
    with pytest.raises(AssertionError):  # wider block tables than the buffers hold
        pad_decode_inputs(static, ids, ids, ids, lens, torch.ones(4, 4, dtype=torch.int32), num_padded=4)
    with pytest.raises(AssertionError):  # more rows than the bucket
        pad_decode_inputs(static, ids, ids, ids, lens, torch.ones(4, 3, dtype=torch.int32), num_padded=2)


def test_decode_inputs_metadata_is_decode_only_views():
    static = DecodeInputs.padding(8, 4, "cpu")
    metadata = static.metadata(4, [64] * 4)
    assert metadata.is_decode_only and metadata.num_seqs == 4 and metadata.max_seq_len == 64
    assert metadata.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert metadata.block_tables.shape == (4, 4)
    assert metadata.slot_mapping.data_ptr() == static.slot_mapping.data_ptr()  # a view: graphs see updates


@pytest.mark.parametrize(
    "device_type, backend_name, enforce_eager, is_disabled",
    [
        ("cuda", "triton", False, False),
        ("cuda", "triton", True, True),
        ("cuda", "torch", False, True),
        ("cpu", "torch", False, True),
        ("cpu", "triton", False, True),
    ],
)
def test_disabled_reason(device_type, backend_name, enforce_eager, is_disabled):
    assert (disabled_reason(device_type, backend_name, enforce_eager) is not None) == is_disabled


def test_runner_off_with_torch_backend_does_nothing():
    # On a CUDA device with the torch backend: nothing is captured and nothing touches CUDA.
    model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=1024))
    runner = CudaGraphRunner(
        model, [], SimpleNamespace(name="torch"), device=torch.device("cuda"), block_size=16,
        max_num_seqs=8, max_model_len=256, enforce_eager=False,
    )
    runner.capture(check_replays)
    assert not runner.is_enabled and "torch" in runner.disabled_reason
    assert not runner.can_run(DecodeInputs.padding(1, 1, "cpu").metadata(1, [1]))


@pytest.mark.parametrize(
    "kwargs", [dict(device="cpu"), dict(device=DEVICE, attention_backend="triton", enforce_eager=True)]
)
def test_engine_runs_eagerly_on_cpu_or_when_told(tiny_model_path, kwargs):
    llm = LLM(tiny_model_path, skip_tokenizer_init=True, num_kv_blocks=8, **kwargs)
    runner = llm.engine.model_runner.cuda_graphs
    assert not runner.is_enabled and runner.disabled_reason is not None
    outputs = llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert len(outputs[0].token_ids) == 2


@pytest.mark.parametrize("num_seqs, num_kv_blocks", [(1, 1), (1, 4), (5, 6), (33, 40)])
def test_make_validation_batch(num_seqs, num_kv_blocks):
    block_size, max_model_len = 16, 100
    batch, seq_lens = make_validation_batch(
        num_seqs, block_size, max_model_len, num_kv_blocks, vocab_size=50, generator=torch.Generator().manual_seed(0)
    )
    assert batch.seq_lens.tolist() == seq_lens and len(seq_lens) == num_seqs
    assert all(1 <= n <= max_model_len for n in seq_lens)
    assert batch.block_tables.max() < num_kv_blocks
    assert batch.input_ids.max() < 50
    assert batch.positions.tolist() == [n - 1 for n in seq_lens]
    written_blocks = (batch.slot_mapping // block_size).tolist()
    assert written_blocks == list(range(num_seqs))  # distinct: no two sequences write one slot
    for i, n in enumerate(seq_lens):
        num_blocks = -(-n // block_size)
        row = batch.block_tables[i, :num_blocks].tolist()
        # The new token's slot is where the block table puts position n - 1 ...
        assert batch.slot_mapping[i] == row[-1] * block_size + (n - 1) % block_size
        # ... and no sequence reads a block another one writes.
        assert not set(row) & (set(written_blocks) - {i})
    if num_kv_blocks > num_seqs:
        assert seq_lens[0] == max_model_len  # the full context, every split of the decode kernel


def test_max_row_error():
    expected = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    assert max_row_error(expected, expected) == 0.0
    assert max_row_error(torch.tensor([[1.0, 0.0], [0.0, 2.2]]), expected) == pytest.approx(0.1)
    assert max_row_error(torch.tensor([[float("nan"), 0.0], [0.0, 2.0]]), expected) != 0.0  # NaN fails `<= tol`


def test_captured_forward_matches_eager(tiny_model_path):
    """What a graph captures, run directly: padded rows, num_splits and max_seq_len fixed for
    max_model_len. Real rows must match the eager forward; padded rows must write nothing."""
    pytest.importorskip("triton")
    from engine.attention.triton_backend import TritonAttentionBackend
    from engine.kernels.decode_attention import choose_num_splits
    from engine.kernels.store_kv import store_kv_kernel
    from engine.models import load_model
    from engine.models.config import ModelConfig

    if not HAS_CUDA and type(store_kv_kernel).__name__ != "InterpretedFunction":
        pytest.skip("engine.kernels was imported before TRITON_INTERPRET=1 was set; run this file alone")
    block_size, max_model_len, num_kv_blocks, num_seqs, bucket = 16, 512, 6, 3, 4
    assert choose_num_splits(bucket, 2, max_model_len) == 2  # so the split-K path is the one checked
    model_config = ModelConfig.from_folder(tiny_model_path)
    model = load_model(model_config, torch.float32, torch.device(DEVICE))
    generator = torch.Generator().manual_seed(0)
    shape = (num_kv_blocks, block_size, model_config.num_kv_heads, model_config.head_dim)
    kv_caches = [
        tuple(torch.randn(shape, generator=generator).to(DEVICE) for _ in ("k", "v"))
        for _ in range(model_config.num_layers)
    ]
    # Contexts up to 300 tokens: eager picks one split for them, the capture two for 512.
    batch, seq_lens = make_validation_batch(num_seqs, block_size, 300, num_kv_blocks, 128, generator)
    assert choose_num_splits(num_seqs, 2, max(seq_lens)) == 1
    batch = batch.to(DEVICE)
    static = DecodeInputs.padding(8, -(-max_model_len // block_size), DEVICE)
    with torch.inference_mode():
        backend = TritonAttentionBackend()
        backend.prepare(batch.metadata(num_seqs, seq_lens))
        eager = model(batch.input_ids, batch.positions, kv_caches, backend)  # [num_seqs, hidden_size]
        after_eager = [(k.clone(), v.clone()) for k, v in kv_caches]
        pad_decode_inputs(static, batch.input_ids, batch.positions, batch.slot_mapping, batch.seq_lens,
                          batch.block_tables, bucket)
        captured = decode_forward(model, kv_caches, static, bucket, max_model_len)  # [bucket, hidden_size]
    assert captured.shape == (bucket, model_config.hidden_size)
    assert max_row_error(captured[:num_seqs], eager) < 1e-4
    assert torch.isfinite(captured).all()
    # The padded run wrote the same new K/V as the eager one, and nothing else.
    for (k, v), (k_eager, v_eager) in zip(kv_caches, after_eager):
        torch.testing.assert_close(k, k_eager, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v, v_eager, rtol=1e-5, atol=1e-5)


class FakeGraph:
    """A captured graph's stand-in on the CPU: replay reruns the captured forward into its output."""

    def __init__(self, forward) -> None:
        self.forward = forward
        self.output = forward()  # [size, hidden_size]

    def replay(self) -> None:
        self.output.copy_(self.forward())


@pytest.fixture
def fake_cuda_graphs(monkeypatch):
    """Lets CudaGraphRunner run its whole flow (capture, validate, pad and replay) on the CPU."""
    import engine.worker.cuda_graphs as cuda_graphs

    def fake_capture(self, size):
        graph = FakeGraph(lambda: decode_forward(self.model, self.kv_caches, self.static, size, self.max_model_len))
        return graph, graph.output

    monkeypatch.setattr(cuda_graphs, "disabled_reason", lambda *args: None)
    monkeypatch.setattr(CudaGraphRunner, "_capture", fake_capture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    if not HAS_CUDA:
        from engine.kernels.store_kv import store_kv_kernel

        if type(store_kv_kernel).__name__ != "InterpretedFunction":
            pytest.skip("engine.kernels was imported before TRITON_INTERPRET=1 was set; run this file alone")
    return cuda_graphs


def count_calls(monkeypatch, cls, name) -> dict:
    calls = {"n": 0}
    method = getattr(cls, name)

    def counting(self, *args):
        calls["n"] += 1
        return method(self, *args)

    monkeypatch.setattr(cls, name, counting)
    return calls


PROMPT_LENGTHS = (3, 20, 9)
MAX_TOKENS = (4, 6, 3)  # staggered ends: decode batches of 3, 2, 1


def greedy_tokens(path, max_tokens=MAX_TOKENS, **kwargs) -> tuple[list[list[int]], LLM]:
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 128, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    llm = LLM(path, skip_tokenizer_init=True, attention_backend="triton", **kwargs)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [o.token_ids for o in outputs], llm


def test_engine_with_fake_graphs_matches_eager(tiny_model_path, fake_cuda_graphs, monkeypatch):
    """The runner's whole flow through the engine, on the CPU: capture, validation, then
    decode steps padded into the static buffers and "replayed"; prefills stay eager."""
    import engine.kernels.decode_attention as decode_attention

    replays = count_calls(monkeypatch, FakeGraph, "replay")
    # Split contexts from 32 tokens on, so the captures (for 128) use 4 splits, 2 for the
    # bucket of 8, while these short contexts get 1 eagerly: both decode-kernel paths meet.
    monkeypatch.setattr(decode_attention, "_MIN_TOKENS_PER_SPLIT", 32)
    kwargs = dict(device=DEVICE, dtype="float32", max_num_seqs=4, max_model_len=128, num_kv_blocks=24)
    eager_tokens, _ = greedy_tokens(tiny_model_path, enforce_eager=True, **kwargs)
    replays["n"] = 0
    graph_tokens, llm = greedy_tokens(tiny_model_path, **kwargs)
    runner = llm.engine.model_runner.cuda_graphs
    assert runner.is_enabled and runner.capture_sizes == [1, 2, 4]
    assert decode_attention.choose_num_splits(4, 2, 128) > 1
    num_validation_replays = len(runner.capture_sizes)
    assert replays["n"] > num_validation_replays  # decode steps replayed too
    assert graph_tokens == eager_tokens


def test_mismatching_replay_turns_graphs_off(tiny_model_path, fake_cuda_graphs, monkeypatch, caplog):
    replay = FakeGraph.replay

    def corrupted_replay(self):
        replay(self)
        self.output[0] += 1.0  # e.g. a stale address: the first row is wrong

    monkeypatch.setattr(FakeGraph, "replay", corrupted_replay)
    with caplog.at_level("WARNING", logger="engine.worker.cuda_graphs"):
        tokens, llm = greedy_tokens(tiny_model_path, max_tokens=(2, 2, 2), device=DEVICE, dtype="float32",
                                    max_num_seqs=2, max_model_len=64, num_kv_blocks=16)
    runner = llm.engine.model_runner.cuda_graphs
    assert not runner.is_enabled and "differs from the eager forward" in runner.disabled_reason
    assert "CUDA graphs off" in caplog.text
    assert not runner.can_run(DecodeInputs.padding(1, 1, "cpu").metadata(1, [1]))
    assert [len(t) for t in tokens] == [2, 2, 2]  # eager from then on


def test_capture_error_turns_graphs_off(tiny_model_path, fake_cuda_graphs, monkeypatch):
    def failing_capture(self, size):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(CudaGraphRunner, "_capture", failing_capture)
    tokens, llm = greedy_tokens(tiny_model_path, max_tokens=(2, 2, 2), device=DEVICE, dtype="float32",
                                max_num_seqs=2, num_kv_blocks=16)
    runner = llm.engine.model_runner.cuda_graphs
    assert not runner.is_enabled and "not permitted" in runner.disabled_reason
    assert runner.static is None and not runner.outputs
    assert [len(t) for t in tokens] == [2, 2, 2]


@pytest.mark.skipif(not HAS_CUDA, reason="CUDA graphs need a GPU")
def test_engine_graphs_match_enforce_eager(tiny_model_path, monkeypatch):
    replays = count_calls(monkeypatch, CudaGraphRunner, "run")
    tokens = {}
    for enforce_eager in (False, True):
        # float32: graphs and eager differ only in summation order (split-K for contexts
        # up to 1024, padded matmuls), far below what flips this model's greedy choices.
        replays["n"] = 0
        tokens[enforce_eager], llm = greedy_tokens(
            tiny_model_path, dtype="float32", max_num_seqs=16, enforce_eager=enforce_eager
        )
        assert llm.engine.model_runner.cuda_graphs.is_enabled == (not enforce_eager)
        assert (replays["n"] > 0) == (not enforce_eager)  # decode steps went through the graphs
    assert tokens[False] == tokens[True]


@pytest.mark.skipif(not HAS_CUDA, reason="CUDA graphs need a GPU")
def test_engine_graphs_on_by_default_in_bf16(tiny_model_path):
    # The default CUDA set-up: bf16, Triton backend, graphs captured and validated.
    tokens, llm = greedy_tokens(tiny_model_path, max_num_seqs=4)
    runner = llm.engine.model_runner
    assert runner.dtype == torch.bfloat16 and runner.backend.name == "triton"
    assert runner.cuda_graphs.is_enabled, runner.cuda_graphs.disabled_reason
    assert runner.cuda_graphs.capture_sizes == [1, 2, 4]
    assert [len(t) for t in tokens] == list(MAX_TOKENS)
