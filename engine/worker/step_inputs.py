"""A scheduled step turned into the model's and the sampler's inputs: Python lists first
(`StepInputs`, which rank 0 also sends to tensor-parallel workers), then tensors.

    scheduled:    A: prompt positions 2-3 of 6 (a chunk)    B: a decode at 7, with 2 proposed tokens
    input_ids:    a2 a3 | b7 p1 p2
    positions:     2  3 |  7  8  9
    sample_rows:          2  3  4     B's last token's row, and one per proposal; A's chunk samples none
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec
import torch

from engine.attention.metadata import AttentionMetadata
from engine.lora.lora_layers import NO_SLOT
from engine.lora.parallel_lora import LoRASlot
from engine.sample.logits_processing import LogitsProcessingState, bad_word_bans
from engine.models.config import ModelConfig
from engine.worker.pooler import plan_pooling
from engine.sample.prompt_logprobs import PromptLogprobRows, PromptLogprobsCollector
from engine.core.request import Request
from engine.sample.sampler import SamplingBatch
from engine.core.scheduler_output import SchedulerOutput
from ipc.messages import ImageInput, PixelDType

STEP_INPUTS_TAG = 3
Ints = list[int]


class StepInputs(msgspec.Struct, array_like=True, forbid_unknown_fields=True, tag=STEP_INPUTS_TAG):
    """One step's flat batch as Python lists; every rank builds the same tensors from it (rank 0 sends
    it to its workers as one of engine.executor.messages' records, tagged like them)."""

    input_ids: Ints  # [num_tokens]
    positions: Ints  # [num_tokens]
    slot_mapping: Ints  # [num_tokens]: block_id * block_size + offset
    query_start_loc: Ints  # [num_seqs + 1]
    seq_lens: Ints  # [num_seqs]
    query_lens: Ints  # [num_seqs]
    block_tables: list[Ints]  # [num_seqs][max_num_blocks], padded with block 0
    sample_rows: Ints  # [num_sampled]: the rows whose logits are sampled
    # [num_pooled]: rows whose final hidden states an embedding request pools (engine.worker.pooler); they
    # leave the last layer after the sampled rows, so every rank must select them too
    pooling_rows: Ints = msgspec.field(default_factory=list)
    # [num_seqs]: each sequence's LoRA pool slot (engine.lora; NO_SLOT: the base), empty when no row has one
    lora_slots: Ints = msgspec.field(default_factory=list)
    # Under tensor parallelism: the step's adapters and their slots, for the workers' pools to match rank 0's
    lora_adapters: list[LoRASlot] = msgspec.field(default_factory=list)

    @property
    def has_lora_rows(self) -> bool:
        return any(slot != NO_SLOT for slot in self.lora_slots)


@dataclass
class PreparedStep:
    """One step made ready for the model: its inputs, and where its logits rows go."""

    inputs: StepInputs
    sampled_requests: list[Request]  # in the order of their rows
    sampled_rows: list[int]  # indices into inputs.sample_rows: the sampled ones (the rest: prompt log-probs)
    prompt_plans: list[PromptLogprobRows]
    pooling_plans: list  # engine.worker.pooler's, for the rows in inputs.pooling_rows
    image_slices: list[ImageSlice] = field(default_factory=list)  # the images whose tokens the step computes
    # An M-RoPE model's step with image tokens: every token's (temporal, height, width) positions [3, num_tokens].
    mrope_positions: list[list[int]] | None = None


@dataclass
class ImageSlice:
    """The part of one image a step computes: its placeholder tokens' rows in the flat batch, which take
    the image's embedding rows first_embed_row, first_embed_row + 1, ... (engine.worker.encoder_cache)."""

    request_id: str
    image: ImageInput
    rows: list[int]
    first_embed_row: int
    reaches_end: bool  # the chunk computes the image's last token


def slice_images(request: Request, start: int, end: int, first_row: int, image_token_id: int) -> list[ImageSlice]:
    """The image slices of `request`'s chunk start..end-1, whose first token is the batch's row `first_row`."""
    slices = []
    token_ids = request.all_token_ids
    for image in request.images:
        image_end = image.offset + image.length
        if image.offset >= end or image_end <= start:
            continue
        lo, hi = max(start, image.offset), min(end, image_end)
        first_embed_row = sum(1 for t in token_ids[image.offset : lo] if t == image_token_id)
        rows = [first_row + p - start for p in range(lo, hi) if token_ids[p] == image_token_id]
        slices.append(ImageSlice(request.request_id, image, rows, first_embed_row, hi == image_end))
    return slices


def pixels_to_tensor(image: ImageInput, device: torch.device) -> torch.Tensor:
    """[frames, C, H, W] float32 pixels of an image as the wire carries them. uint8 ones are normalised
    here with the very operations of transformers' numpy image processors (rescale in float64, then
    (x - mean) / std in float32), so the encoder sees the processor's bits."""
    if image.dtype == PixelDType.FLOAT32:
        return torch.frombuffer(bytearray(image.data), dtype=torch.float32).view(image.shape).to(device)
    pixels = torch.frombuffer(bytearray(image.data), dtype=torch.uint8).view(image.shape)
    pixels = (pixels.double() * image.rescale_factor).float()  # [frames, C, H, W]
    mean = torch.tensor(image.image_mean, dtype=torch.float32).view(1, -1, 1, 1)
    std = torch.tensor(image.image_std, dtype=torch.float32).view(1, -1, 1, 1)
    return ((pixels - mean) / std).to(device)


def image_rows_to_tensor(slices: list[ImageSlice], device: torch.device) -> torch.Tensor:
    """[num image tokens in the step] int64: the batch rows of the slices' tokens, in order."""
    return torch.tensor([row for s in slices for row in s.rows], dtype=torch.int64, device=device)


class ChunkBatch:
    """A step's flat batch, built a sequence's chunk at a time: its tokens at positions start..,
    their KV slots in its block table."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.input_ids: list[int] = []
        self.positions: list[int] = []
        self.slot_mapping: list[int] = []
        self.query_start_loc = [0]
        self.seq_lens: list[int] = []
        self.query_lens: list[int] = []
        self.block_tables: list[list[int]] = []

    def add(self, token_ids: list[int], start: int, block_ids: list[int]) -> None:
        append_chunk(self, token_ids, start, block_ids, self.block_size)

    def to_inputs(self, sample_rows: list[int]) -> StepInputs:
        return StepInputs(self.input_ids, self.positions, self.slot_mapping, self.query_start_loc, self.seq_lens,
                          self.query_lens, pad_block_tables(self.block_tables), sample_rows)


def append_chunk(batch: ChunkBatch | StepInputs, token_ids: list[int], start: int, block_ids: list[int],
                 block_size: int) -> None:
    """One sequence's tokens at positions start.. onto a batch's flat lists (a ChunkBatch being
    built, or a built step's StepInputs: the padded baseline's pad rows), KV slots from `block_ids`."""
    end = start + len(token_ids)
    batch.input_ids.extend(token_ids)
    batch.positions.extend(range(start, end))
    batch.slot_mapping.extend(block_ids[p // block_size] * block_size + p % block_size for p in range(start, end))
    batch.query_start_loc.append(len(batch.input_ids))
    batch.query_lens.append(len(token_ids))
    batch.seq_lens.append(end)
    batch.block_tables.append(block_ids)


def pad_block_tables(block_tables: list[list[int]]) -> list[list[int]]:
    """Every table as long as the longest, padded with block 0 (never read: seq_lens bound it)."""
    max_num_blocks = max(map(len, block_tables))
    return [table + [0] * (max_num_blocks - len(table)) for table in block_tables]


def prepare_step(scheduler_output: SchedulerOutput, block_size: int, prompt_logprobs: PromptLogprobsCollector,
                 image_token_id: int | None = None) -> PreparedStep:
    """The step's flat batch as lists (every rank builds the same tensors from them), which
    logits rows go where, and (a vision-language model's: `image_token_id`) which rows take images."""
    batch = ChunkBatch(block_size)
    logits_rows: list[int] = []  # rows whose logits come back: prompt log-prob rows, then the sampled row
    sampled_requests: list[Request] = []
    sampled_rows: list[int] = []  # indices into logits_rows
    prompt_plans: list[PromptLogprobRows] = []
    has_pooling = False
    image_slices: list[ImageSlice] = []
    for scheduled in scheduler_output.scheduled:
        request = scheduled.request
        start = request.num_computed_tokens
        end = start + scheduled.num_new_tokens
        spec_token_ids = scheduled.spec_token_ids  # proposed tokens, after the request's last one
        first_row = len(batch.input_ids)
        batch.add(request.all_token_ids[start : end - len(spec_token_ids)] + spec_token_ids, start, request.block_ids)
        if request.images and image_token_id is not None:
            image_slices.extend(slice_images(request, start, end, first_row, image_token_id))
        has_pooling = has_pooling or request.pooling_params is not None
        prompt_positions = (prompt_logprobs.positions_to_compute(request, start, end)
                            if request.sampling_params.prompt_logprobs is not None else None)
        if prompt_positions:
            prompt_plans.append(PromptLogprobRows(request, len(logits_rows), prompt_positions.start,
                                                  len(prompt_positions)))
            logits_rows.extend(first_row - start + p for p in prompt_positions)
        if scheduled.is_sampling:  # its last token's row, and one per proposed token
            num_rows = 1 + len(spec_token_ids)
            sampled_rows.extend(range(len(logits_rows), len(logits_rows) + num_rows))
            logits_rows.extend(range(len(batch.input_ids) - num_rows, len(batch.input_ids)))
            sampled_requests.append(request)
    inputs = batch.to_inputs(logits_rows)
    pooling_plans = []
    if has_pooling:  # embedding requests in the step
        inputs.pooling_rows, pooling_plans = plan_pooling(scheduler_output.scheduled)
    return PreparedStep(inputs, sampled_requests, sampled_rows, prompt_plans, pooling_plans, image_slices)


def selects_output_rows(inputs: StepInputs) -> bool:
    """Whether the model's last layer runs on the selected rows alone (sampled, then pooled): not when a
    decode step samples every row in order, nor when a step samples none (a prompt's middle chunk, run
    whole so that no matmul or all-reduce ever sees zero rows). Pooled rows are always named."""
    return bool(inputs.pooling_rows) or len(inputs.sample_rows) not in (0, len(inputs.input_ids))


def token_lora_slots(inputs: StepInputs) -> tuple[list[int], list[int] | None]:
    """The LoRA pool slot of each of the step's tokens ([] when no row has an adapter), and of each
    output row where the last layer runs on those alone (engine.lora.lora_layers.LoRAStepState)."""
    if not inputs.has_lora_rows:
        return [], None
    token_slots = [slot for slot, n in zip(inputs.lora_slots, inputs.query_lens) for _ in range(n)]  # [num_tokens]
    output_slots = None
    if selects_output_rows(inputs):
        output_slots = [token_slots[r] for r in inputs.sample_rows + inputs.pooling_rows]
    return token_slots, output_slots


def to_tensors(inputs: StepInputs, device: torch.device):
    """(input ids, positions, attention metadata, the sampled then pooled rows) on `device`."""
    pin = device.type == "cuda"

    def to_device(values, dtype):
        # Pinned host memory lets the copy overlap with the previous step's kernels.
        return torch.tensor(values, dtype=dtype, pin_memory=pin).to(device, non_blocking=True)

    metadata = AttentionMetadata(
        slot_mapping=to_device(inputs.slot_mapping, torch.int64),  # [num_tokens]
        query_start_loc=to_device(inputs.query_start_loc, torch.int32),  # [num_seqs + 1]
        seq_lens=to_device(inputs.seq_lens, torch.int32),  # [num_seqs]
        block_tables=to_device(inputs.block_tables, torch.int32),  # [num_seqs, max_num_blocks]
        max_query_len=max(inputs.query_lens),
        max_seq_len=max(inputs.seq_lens),
        query_lens_cpu=inputs.query_lens,
        seq_lens_cpu=inputs.seq_lens,
    )
    return (
        to_device(inputs.input_ids, torch.int64),  # [num_tokens]
        to_device(inputs.positions, torch.int64),  # [num_tokens]
        metadata,
        to_device(inputs.sample_rows + inputs.pooling_rows, torch.int64),  # [num_sampled + num_pooled]
    )


def to_row_tensors(inputs: StepInputs, device: torch.device):
    """The step with each token its own row, for the decode stack (DecodeStack.forward_rows): a
    sequence's j-th token attends to its table's first seq_len - query_len + j + 1 positions.
    (input ids, positions, slot mapping, a block table per row, a sequence length per row) on `device`."""
    tables: list[list[int]] = []
    seq_lens: list[int] = []
    for table, seq_len, query_len in zip(inputs.block_tables, inputs.seq_lens, inputs.query_lens):
        tables.extend([table] * query_len)
        seq_lens.extend(range(seq_len - query_len + 1, seq_len + 1))
    return (
        torch.tensor(inputs.input_ids, dtype=torch.int64, device=device),  # [num_tokens]
        torch.tensor(inputs.positions, dtype=torch.int64, device=device),  # [num_tokens]
        torch.tensor(inputs.slot_mapping, dtype=torch.int64, device=device),  # [num_tokens]
        torch.tensor(tables, dtype=torch.int32, device=device),  # [num_tokens, max_num_blocks]
        torch.tensor(seq_lens, dtype=torch.int32, device=device),  # [num_tokens]
    )


def is_plain_greedy(request: Request) -> bool:
    """Whether the request's next token is its logits' argmax and nothing more: no log-probs, no
    logits pipeline (bans, biases, grammar, penalties), no EOS ban for min_tokens. A step of such
    rows skips the SamplingBatch (Sampler.sample_greedy)."""
    params = request.sampling_params
    return (params.is_greedy and params.logprobs is None and not params.needs_logits_processing
            and request.num_output_tokens >= params.min_tokens)


def make_sampling_batch(requests: list[Request], model_config: ModelConfig, device: torch.device,
                        generators: dict[str, torch.Generator], logits_state: LogitsProcessingState) -> SamplingBatch:
    """One row per request (or per position to verify); `generators` keeps each seeded request's across steps."""
    vocab_size = model_config.vocab_size
    eos_ids = model_config.eos_token_ids
    temperatures, top_ks, top_ps, min_ps, generators_used, banned, num_logprobs = [], [], [], [], [], [], []
    for request in requests:
        params = request.sampling_params
        temperatures.append(0.0 if params.is_greedy else float(params.temperature))
        top_ks.append(params.top_k if params.top_k > 0 else vocab_size)
        top_ps.append(float(params.top_p))
        min_ps.append(float(params.min_p))
        generators_used.append(generator_for(request, generators))
        needs_more = request.num_output_tokens < params.min_tokens
        stop_ids = ([] if params.ignore_eos else eos_ids) + list(params.stop_token_ids)
        banned.append((stop_ids if needs_more else []) + (bad_word_bans(request) if params.bad_words_token_ids else []))
        num_logprobs.append(params.logprobs)
    return SamplingBatch(
        temperatures=torch.tensor(temperatures, device=device),  # [num_rows]
        top_ks=torch.tensor(top_ks, device=device),
        top_ps=torch.tensor(top_ps, device=device),
        min_ps=torch.tensor(min_ps, device=device),
        generators=generators_used,
        banned_token_ids=banned,
        num_logprobs=num_logprobs,
        is_all_greedy=all(t == 0.0 for t in temperatures),
        needs_top_k=any(k < vocab_size for k in top_ks),
        needs_top_p=any(p < 1.0 for p in top_ps),
        needs_min_p=any(p > 0.0 for p in min_ps),
        # A step without rows that ask for the logits pipeline builds none (engine.sample.logits_processing).
        processing=(logits_state.prepare(requests)
                    if any(r.sampling_params.needs_logits_processing for r in requests) else None),
    )

def generator_for(request: Request, generators: dict[str, torch.Generator]) -> torch.Generator | None:
    seed = request.sampling_params.seed
    if seed is None or request.sampling_params.is_greedy:
        return None
    generator = generators.get(request.request_id)
    if generator is None:
        generator = generators[request.request_id] = torch.Generator().manual_seed(seed)
    return generator
