"""Greedy drift from fp32 of int8 schemes, simulated in transformers and run by the engine.

The metric is tests/models/test_bf16_fidelity.py's: over its chat questions, the mean
number of leading tokens (of 32, EOS ignored) equal to transformers' fp32 greedy answer.
Simulated schemes fake-quantize every linear's weight and input in fp32 transformers:

  channel      one weight scale per output feature, one activation scale per token
  q8_0         llama.cpp's Q8_0: blocks of 32 along K for both, fp16 scales
  g64          blocks of 64 along K for both, fp32 scales (what --quantization int8 runs)
  g64_fp16     the same with fp16 scales
  g128         blocks of 128 for both, fp32 scales (half the kernel's epilogues; not what it runs)
  g64_token    weights in blocks of 64, one activation scale per token (not what it runs)
  channel_a64  one weight scale per output feature, activations in blocks of 64 (not what it runs)

`engine` is the real path: LLM(quantization="int8") on our vpdpbusd kernel (`--quantization
int4` for int4; `--engine-model x.gguf` to run a GGUF's own blocks, engine/loader/gguf_blocks.py,
against the same fp32 reference of --model).

The greedy score swings by several tokens with any rounding change (one early near-tie
sends a whole answer elsewhere). Two smoother scores come from one teacher-forced pass
over each prompt followed by fp32's answer: the share of those 32 positions whose top
token is fp32's (`top1_agreement`) and the mean negative log-likelihood of fp32's tokens
(`answer_nll`; fp32's own is the floor).

    python -m scripts.bench.probes.quant_drift --schemes channel,q8_0,g64,engine --json results/quant_drift.json
    python -m scripts.bench.probes.quant_drift --schemes q8_0,engine --engine-model .peers/gguf/smollm2-q8_0.gguf
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from engine.loader.model_files import DEFAULT_MODEL, resolve_model
from scripts.lib.bench_report import write_report
from scripts.lib.greedy_drift import NUM_NEW_TOKENS, QUESTIONS, hf_greedy, leading_matches

SCHEMES = {  # name: (weight group, activation group, fp16 scales); None: the whole row
    "channel": (None, None, False),
    "q8_0": (32, 32, True),
    "g64": (64, 64, False),
    "g64_fp16": (64, 64, True),
    "g128": (128, 128, False),
    "g64_token": (64, None, False),
    "channel_a64": (None, 64, False),
}


def fake_quantize(x: torch.Tensor, group: int | None, fp16_scales: bool) -> torch.Tensor:
    """Symmetric int8 along the last dim in groups of `group` (zero-padded to a multiple), back in fp32."""
    k = x.shape[-1]
    size = group or k
    padded = F.pad(x, (0, -k % size))  # [..., groups * size]
    g = padded.reshape(*x.shape[:-1], -1, size)  # [..., groups, size]
    scales = g.abs().amax(-1, keepdim=True) / 127  # [..., groups, 1]
    if fp16_scales:
        scales = scales.half().float()
    scales = torch.where(scales == 0, torch.ones_like(scales), scales)
    q = (g / scales).round().clamp(-127, 127) * scales
    return q.reshape(*x.shape[:-1], -1)[..., :k]


def simulated_model(path: str, scheme: str | None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if scheme is not None:
        w_group, a_group, fp16 = SCHEMES[scheme]
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):  # the LM head too, as the engine quantizes it
                weight = fake_quantize(module.weight.data, w_group, fp16)  # a copy: a tied embedding keeps fp32
                module.forward = (lambda w: lambda x: F.linear(fake_quantize(x, a_group, fp16), w))(weight)
        if model.config.tie_word_embeddings:  # the engine reads a tied embedding back from the head's int8
            embedding = model.get_input_embeddings()
            embedding.weight.data = fake_quantize(embedding.weight.data, w_group, fp16)
    return model


def simulated_answers(path: str, prompts: list[list[int]], scheme: str | None) -> list[list[int]]:
    model = simulated_model(path, scheme)
    return [hf_greedy(model, p, NUM_NEW_TOKENS) for p in prompts]


def simulated_forced(model, prompt: list[int], answer: list[int]) -> tuple[list[int], list[float]]:
    """(top token, -log p(answer token)) at each answer position, teacher-forced."""
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt + answer])).logits[0, len(prompt) - 1 : -1]  # [32, vocab]
    logprobs = logits.float().log_softmax(-1)
    nll = -logprobs.gather(1, torch.tensor(answer)[:, None])[:, 0]  # [32]
    return logprobs.argmax(-1).tolist(), nll.tolist()


def engine_results(path: str, prompts: list[list[int]], answers: list[list[int]], quantization: str = "int8",
                   kv_cache_dtype: str = "auto"):
    """(greedy answers, teacher-forced top tokens and NLLs) of LLM(path, quantization=..., kv_cache_dtype=...)."""
    from engine import LLM, SamplingParams

    llm = LLM(path, quantization=quantization, kv_cache_dtype=kv_cache_dtype)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    greedy = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    forced_params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    forced = []
    for prompt, answer, out in zip(prompts, answers, llm.generate([p + a for p, a in zip(prompts, answers)],
                                                                  forced_params, use_tqdm=False)):
        rows = out.prompt_logprobs[len(prompt):]  # one per answer token
        forced.append(([r.top_token_ids[0] for r in rows], [-r.logprob for r in rows]))
    return greedy, forced


def scores(answers, forced, reference) -> dict:
    per_question = [leading_matches(a, r) for a, r in zip(answers, reference)]
    agree = [t == r for (tops, _), ref in zip(forced, reference) for t, r in zip(tops, ref)]
    nll = [v for _, values in forced for v in values]
    return {"mean_leading_matches": sum(per_question) / len(per_question), "per_question": per_question,
            "top1_agreement": sum(agree) / len(agree), "answer_nll": sum(nll) / len(nll)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--schemes", default="channel,q8_0,g64,engine")
    p.add_argument("--json", default=None, help="write the scores here too")
    p.add_argument("--quantization", default="int8", choices=["int8", "int4"], help="the engine scheme's")
    p.add_argument("--engine-model", default=None,
                   help="what the engine scheme loads (a GGUF file, say); default: --model")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="the engine scheme's KV cache (auto: bf16 beside int8/int4 where the CPU has native bf16)")
    args = p.parse_args(argv)
    from transformers import AutoTokenizer

    path = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False) for q in QUESTIONS]
    fp32 = simulated_model(path, None)
    reference = [hf_greedy(fp32, p, NUM_NEW_TOKENS) for p in prompts]
    results = {"fp32": scores(reference, [simulated_forced(fp32, p, a) for p, a in zip(prompts, reference)],
                              reference)}
    del fp32
    for scheme in args.schemes.split(","):
        if scheme == "engine":
            answers, forced = engine_results(args.engine_model or path, prompts, reference, args.quantization,
                                             args.kv_cache_dtype)
        else:
            model = simulated_model(path, scheme)
            answers = [hf_greedy(model, p, NUM_NEW_TOKENS) for p in prompts]
            forced = [simulated_forced(model, p, a) for p, a in zip(prompts, reference)]
        results[scheme] = scores(answers, forced, reference)
        print(scheme, json.dumps(results[scheme]), flush=True)
    write_report(args.json, {"model": args.model, "engine_model": args.engine_model or args.model,
                             "quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype,
                             "num_new_tokens": NUM_NEW_TOKENS,
                             "schemes": results}, indent=2)


if __name__ == "__main__":
    main()
