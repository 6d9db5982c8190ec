"""Top-1 agreement on a tiny Llama GGUF (issue #59): greedy output of a file served in its own
blocks against an fp32 forward on the file's dequantized weights, teacher-forced. Shared by
tests/models/test_gguf_agreement.py and scripts/bench/gguf_top1.py (which puts llama.cpp's own
agreement on the same file beside ours).

Why the model is shaped as it is: the kernels round the activations to 8 bits a block, as
llama.cpp does (0.5-1.5% of a block's scale), and every error is relative, so scaling a layer,
the head included, changes nothing. With all weights random the final hidden state is unrelated
to every head row: the logits are a cloud of near-equal values (the top two about 0.3 of their
spread apart), and that rounding flips 2.5-3.5% of the top-1s (measured on the first version of
this model, hidden 256, untied: 0.9675 Q8_0, 0.975 Q4_K over 2,000 positions). A trained model's
hidden state points at a few rows instead, so its top-1 stands far above the rest. Here:

- the head is tied to the embedding (as SmolLM2's and Llama-3.2-1B's are), in HEAD_TYPE in every
  file, and the layers' outputs (attn_output, ffn_down) are small beside the embedding, so the
  residual stream keeps the current token's embedding and the head reads it back about
  sqrt(hidden) times above a random row;
- the layers still move the top-1 away from the current token at 5-11% of the positions (at a
  std of 0.0105; 0.009 gave 1-4%, 0.012 gave 15-20% and 0.988 agreement): those positions are
  decided by attention and MLP in the file's type, and are where the rounding flips near ties;
- random K-quant and Q4_0 blocks are centred (gguf_writer.random_blocks): uncentred, a random
  min per 32 weights outweighs their spread, and every row leans the same way.
"""

from __future__ import annotations

from pathlib import Path

import torch

from scripts.lib.gguf_writer import q4_k_m_types, write_random_llama_gguf

SHAPE = dict(hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4, num_kv_heads=2)
LAYER_OUTPUT_STDS = {"attn_output": 0.0105, "ffn_down": 0.0105}  # the embedding's std is 0.05
# The tied embedding and head, in every file: one type, so the files differ only in their layers' type
# (llama.cpp too gives the output tensor more bits than the layers: Q6_K in its Q4_0/Q4_K files).
HEAD_TYPE = "Q8_0"
TYPES = ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "Q4_K_M"]
NUM_PROMPTS, PROMPT_LEN = 8, 251  # 8 x 250 = 2,000 teacher-forced positions


def write_tokenizer(folder: Path) -> int:
    """A byte-level BPE of 300 tokens (the tiny test Llama's recipe) saved in `folder`, as
    write_random_llama_gguf reads it; returns the vocabulary's size."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer(add_prefix_space=False)
    texts = ["The capital of France is Paris.", "What is the capital of France?", "hello world, hello tokens"] * 4
    bpe.train_from_iterator(texts, vocab_size=300, min_frequency=1, show_progress=False,
                            special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, bos_token="<|im_start|>",
                                        eos_token="<|im_end|>", unk_token="<|endoftext|>", pad_token="<|im_end|>")
    tokenizer.save_pretrained(folder)
    return len(tokenizer)


def tensor_types(type_name: str) -> dict[str, str]:
    """llama.cpp tensor name -> type: every layer's matmuls in `type_name` (or llama.cpp's Q4_K_M
    mix, Q6_K beside Q4_K), the tied embedding and head in HEAD_TYPE."""
    mix = q4_k_m_types(SHAPE["num_layers"])
    types = mix if type_name == "Q4_K_M" else {name: type_name for name in mix}
    types.pop("output")  # tied: the head is token_embd
    types["token_embd"] = HEAD_TYPE
    return types


def write_agreement_gguf(path: Path, tokenizer_folder: Path, type_name: str, vocab_size: int) -> Path:
    return write_random_llama_gguf(path, tokenizer_folder, vocab_size=vocab_size, **SHAPE,
                                   types=tensor_types(type_name), tie_word_embeddings=True,
                                   stds=LAYER_OUTPUT_STDS, centred=True)


def teacher_forced_prompts(vocab_size: int, num_prompts: int = NUM_PROMPTS,
                           prompt_len: int = PROMPT_LEN) -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, vocab_size, (num_prompts, prompt_len), generator=generator).tolist()


def our_top1(llm, token_ids: list[list[int]]) -> list[int]:
    """The engine's most likely next token at each teacher-forced position of each prompt."""
    from engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    outputs = llm.generate(token_ids, params, use_tqdm=False)
    return [entry.top_token_ids[0] for o in outputs for entry in o.prompt_logprobs[1:]]


def reference_top1(gguf_path: Path, work: Path, token_ids: list[list[int]]) -> list[int]:
    """transformers in fp32 on the file's dequantized weights (gguf-py's values), position by position."""
    from transformers import AutoModelForCausalLM

    from engine.loader.gguf_convert import convert_gguf

    folder = work / f"{gguf_path.stem}-fp32"
    convert_gguf(gguf_path, folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(torch.tensor(token_ids)).logits  # [prompts, tokens, vocab]
    return logits[:, :-1].argmax(-1).flatten().tolist()


def context_share(reference: list[int], token_ids: list[list[int]]) -> float:
    """The share of positions whose reference top-1 is not the current token: decided by the layers."""
    current = [t for ids in token_ids for t in ids[:-1]]
    return sum(a != b for a, b in zip(reference, current)) / len(reference)


def agreement(ours: list[int], reference: list[int]) -> float:
    return sum(a == b for a, b in zip(ours, reference)) / len(reference)


def context_agreement(ours: list[int], reference: list[int], token_ids: list[list[int]]) -> float:
    """Agreement on the positions the layers decide (the reference's top-1 is not the current
    token): where a wrong layer would show, and where the near ties are."""
    current = [t for ids in token_ids for t in ids[:-1]]
    pairs = [(a, b) for a, b, c in zip(ours, reference, current) if b != c]
    return sum(a == b for a, b in pairs) / max(len(pairs), 1)
