"""Vision-language speed (issue #57): time to first token with one image against transformers' eager
`generate`, a repeated image's TTFT against a cold one, and decode tok/s with and without an image.

    flock /tmp/bench.lock .venv/bin/python -m scripts.bench.vision --json results/vision.json
    flock /tmp/bench.lock .venv/bin/python -m scripts.bench.vision --model /models/SmolVLM-256M-Instruct

Without --model it builds a random-weight checkpoint of SmolVLM-256M's shape (SigLIP-B/16 at 512 px,
pixel shuffle 4, SmolLM2-135M's text model: scripts/lib/vision_model.py) with crops of 512 and, by
default, --longest-edge 512: a 512 x 512 image is then one frame of 64 image tokens (SmolVLM's own
processor config says 2048, which makes the same image 4 x 4 crops plus the global view, 17 frames).
Each round, in one process and in turn:

    ours cold          a fresh image (new pixels: no encoder or prefix cache helps), max_tokens 1
    ours int8 cold     the same, with --vision-quantization int8 (a second engine in this process)
    ours same image    the same image and question again (prefix cache and encoder cache)
    ours new question  the same image, another question (encoder cache; the prefix up to the image)
    transformers       the processor and `generate(max_new_tokens=1)` on the cold request, eager fp32
    decode             --output-len tokens with and without the image (the text-only prompt is the question)
    llama.cpp          with --llama-server-bin: `llama-server --mmproj -t --threads` on f32 GGUFs converted from
                       the same folder (scripts/lib/llama_mmproj.py), a 1-token chat answer to the cold image

TTFT is wall time from the call to the first token, preprocessing included, for both engines.
Medians over --repeats rounds; the host is shared, so compare within one run.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
import os
from pathlib import Path

import numpy as np

from scripts.lib.bench_report import machine_info, require_at_least_one, run_and_report

logger = logging.getLogger("bench_vision")

QUESTION_WORDS = "Describe the picture in detail: what objects, colours and shapes does it show, and where are they"


def question(num_tokens: int, tokenizer, salt: str = "") -> str:
    """A question of about `num_tokens` tokens."""
    words = (salt + " " + QUESTION_WORDS).split()
    text = ""
    while len(tokenizer.encode(text)) < num_tokens:
        text += " " + words[len(text.split()) % len(words)]
    return text.strip() + "?"


def chat_prompt(text: str) -> str:
    return f"User:<image>{text}<end_of_utterance>\nAssistant:"


def picture(seed: int, size: int):
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8))


def timed(llm, prompt, max_tokens: int) -> tuple[float, float | None]:
    """(TTFT s, decode tok/s or None) of one request, wall clock from the call."""
    from engine import SamplingParams

    start = time.time()
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)[0]
    first, finish = out.metrics.first_token_time, out.metrics.finish_time
    rate = (len(out.token_ids) - 1) / (finish - first) if len(out.token_ids) > 1 and finish > first else None
    return first - start, rate


def hf_ttft(hf_model, processor, token_ids: list[int], image) -> float:
    import torch

    start = time.time()
    pixels = processor(images=[[image]], return_tensors="pt")
    with torch.no_grad():
        hf_model.generate(input_ids=torch.tensor([token_ids]), pixel_values=pixels["pixel_values"],
                          pixel_attention_mask=pixels["pixel_attention_mask"], max_new_tokens=1, do_sample=False)
    return time.time() - start


def start_llama(args: argparse.Namespace, path: str, tmp: Path):
    from scripts.lib.llama_mmproj import LlamaMmprojServer, convert

    text_gguf, mmproj = convert(path, tmp / "gguf", args.llama_server_bin, args.sentencepiece_dir)
    return LlamaMmprojServer(args.llama_server_bin, text_gguf, mmproj, args.threads, tmp / "llama-server.log")


def run(args: argparse.Namespace) -> dict:
    import torch
    import transformers
    from transformers import Idefics3ImageProcessorPil

    from engine import LLM
    from scripts.lib.vision_model import SMOLVLM_256M_TEXT, SMOLVLM_256M_VISION, make_tiny_smolvlm

    with tempfile.TemporaryDirectory() as tmp:
        if args.model:
            path = args.model
            hf_model = transformers.Idefics3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
        else:
            path, hf_model = make_tiny_smolvlm(Path(tmp), crop_size=512, longest_edge=args.longest_edge,
                                               vision=SMOLVLM_256M_VISION, text=SMOLVLM_256M_TEXT, scale_factor=4,
                                               name="SmolVLM-256M-shape")
        hf_model.config._attn_implementation = "eager"
        kwargs = dict(dtype="float32", max_num_batched_tokens=2048, max_num_encoder_input_tokens=4096)
        llm = LLM(path, **kwargs)
        llm_int8 = LLM(path, vision_quantization="int8", **kwargs) if args.int8 else None
        llama = start_llama(args, path, Path(tmp)) if args.llama_server_bin else None
        vision = llm._vision_processor()
        processor = Idefics3ImageProcessorPil(size={"longest_edge": vision.preprocessing.longest_edge},
                                              max_image_size={"longest_edge": vision.preprocessing.crop_size},
                                              resample=vision.preprocessing.resample)
        text = question(args.question_len, llm.tokenizer)
        other = question(args.question_len, llm.tokenizer, salt="Now")
        for engine in (llm, llm_int8):
            if engine is not None:
                timed(engine, {"prompt": chat_prompt(text), "multi_modal_data": {"image": picture(999, args.image_size)}}, 2)
        if llama is not None:
            llama.ttft(text, picture(998, args.image_size))
        rounds = []
        for i in range(args.repeats):
            image = picture(i, args.image_size)
            request = {"prompt": chat_prompt(text), "multi_modal_data": {"image": image}}
            cold, _ = timed(llm, request, 1)
            same, _ = timed(llm, request, 1)
            new_question, _ = timed(llm, {"prompt": chat_prompt(other), "multi_modal_data": {"image": image}}, 1)
            token_ids, records = vision.process(chat_prompt(text), [image])
            hf = hf_ttft(hf_model, processor, token_ids, image)
            extra = {}
            if llm_int8 is not None:  # its own fresh image: the same pixels as the fp32 engine's cold one
                extra["ttft_cold_int8_s"], _ = timed(llm_int8, request, 1)
            if llama is not None:
                extra["ttft_llama_cpp_s"], extra["llama_cpp_prompt_tokens"] = llama.ttft(text, image)
            llm.reset_prefix_cache()
            _, with_image = timed(llm, {"prompt": chat_prompt(text), "multi_modal_data": {"image": picture(
                1000 + i, args.image_size)}}, args.output_len)
            _, without_image = timed(llm, f"User:{text}<end_of_utterance>\nAssistant:", args.output_len)
            rounds.append({"ttft_cold_s": cold, "ttft_same_image_s": same, "ttft_new_question_s": new_question,
                           "ttft_transformers_s": hf, "decode_tok_s_with_image": with_image,
                           "decode_tok_s_without_image": without_image, "num_prompt_tokens": len(token_ids),
                           "num_image_tokens": records[0].length, **extra})
            logger.info("round %d: %s", i, rounds[-1])
        encoder_runs = llm.engine.model_runner.encoder_cache.num_encoder_runs
        llm.shutdown()
        if llm_int8 is not None:
            llm_int8.shutdown()
        llama_version = llama.version(args.llama_server_bin) if llama is not None else None
        if llama is not None:
            llama.stop()
    median = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
    return {
        "model": args.model or "random SmolVLM-256M shape", "image_size": args.image_size,
        "longest_edge": args.longest_edge, "question_len": args.question_len, "output_len": args.output_len,
        "median": median,
        "ttft_speedup_vs_transformers": median["ttft_transformers_s"] / median["ttft_cold_s"],
        **({"ttft_int8_speedup_vs_transformers": median["ttft_transformers_s"] / median["ttft_cold_int8_s"]}
           if "ttft_cold_int8_s" in median else {}),
        **({"ttft_speedup_vs_llama_cpp": median["ttft_llama_cpp_s"] / median["ttft_cold_s"],
            "llama_cpp_version": llama_version} if "ttft_llama_cpp_s" in median else {}),
        "ttft_same_image_vs_cold": median["ttft_same_image_s"] / median["ttft_cold_s"],
        "ttft_new_question_vs_cold": median["ttft_new_question_s"] / median["ttft_cold_s"],
        "decode_with_vs_without_image": median["decode_tok_s_with_image"] / median["decode_tok_s_without_image"],
        "num_encoder_runs": encoder_runs, "rounds": rounds, "machine": machine_info(),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a SmolVLM (Idefics3) folder; default: random weights of SmolVLM-256M's shape")
    p.add_argument("--image-size", type=int, default=512, help="the square test image's side")
    p.add_argument("--longest-edge", type=int, default=512, help="the built checkpoint's processor size (2048: SmolVLM's)")
    p.add_argument("--question-len", type=int, default=32, help="the question's tokens")
    p.add_argument("--output-len", type=int, default=64, help="tokens for the decode rate")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-int8", dest="int8", action="store_false",
                   help="skip the second engine with --vision-quantization int8")
    p.add_argument("--llama-server-bin", type=Path, default=None, metavar="PATH",
                   help="also time llama.cpp: <llama.cpp tree>/build/bin/llama-server (its converter is in the tree)")
    p.add_argument("--sentencepiece-dir", default=None, help="a folder holding sentencepiece, for llama.cpp's converter")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="llama-server -t")
    p.add_argument("--json", help="also write the report here")
    args = p.parse_args(argv)
    require_at_least_one(p, args, ("repeats", "question_len", "output_len", "image_size"))
    return args


def main(argv: list[str] | None = None) -> None:
    run_and_report(parse_args, run, argv, logger)


if __name__ == "__main__":
    main()
