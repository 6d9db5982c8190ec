"""The draft model's runner: a second ModelRunner beside the target's, for `{"method": "draft"}`.

`"model": "self-int4"` is the served checkpoint again, quantized to int4 by our own kernels
(engine/cpu/int4_linear.py) exactly as `--quantization int4` serves it: read from the same
folder, so the draft's weights are the checkpoint's, not a second rounding of a bf16 or
prepacked copy. `"model": PATH` is another Hugging Face folder (or a known name), run with the
target's dtype and quantization; its vocabulary must be the target's, token for token, or the
proposed ids would mean other words: it is refused at start, naming speculative_config.model.

Either way the draft runs in this process on rank 0 (no tensor parallelism, no torch.compile),
with a KV pool of the target's block count plus a few scratch blocks (engine.spec_decode.draft_proposer).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os

from engine.config import EngineConfig
from engine.loader.model_files import resolve_model
from engine.worker.model_runner import ModelRunner
from engine.models.config import ModelConfig
from ipc.engine_config import AUTO_DTYPE
from ipc.speculative_config import SELF_INT4, SpeculativeConfig

logger = logging.getLogger(__name__)


def draft_engine_config(config: EngineConfig, spec: SpeculativeConfig) -> EngineConfig:
    """The target's config with the draft's model and settings: in-process and eager, int4 on the
    checkpoint's own weights for self-int4 (fp32 activations, as dtype "auto" gives beside int4)."""
    changes: dict = dict(tensor_parallel_size=1, nnodes=1, node_rank=0, compile=False, speculative_config=None,
                         enable_lora=False)  # the draft proposes as the base; the target verifies under the adapter
    if spec.model == SELF_INT4:
        changes.update(quantization="int4", dtype=AUTO_DTYPE, kv_cache_dtype=AUTO_DTYPE)
    else:
        changes.update(model=spec.model)
    return dataclasses.replace(config, **changes)


def draft_model_config(config: EngineConfig, spec: SpeculativeConfig, target: ModelConfig) -> ModelConfig:
    """The draft's model config; raises ValueError naming speculative_config.model when the draft
    cannot stand in for the target (its vocabulary differs, or the folder is not a model)."""
    if spec.model == SELF_INT4:
        return target
    try:
        draft = ModelConfig.from_folder(resolve_model(spec.model))
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"speculative_config.model {spec.model!r}: {e}") from None
    check_same_vocabulary(target, draft, spec.model)
    return draft


def check_same_vocabulary(target: ModelConfig, draft: ModelConfig, name: str) -> None:
    """The draft's token ids must be the target's: the same vocabulary size and, where both folders
    carry a tokenizer.json, the same tokens at the same ids."""
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"speculative_config.model {name!r} has a vocabulary of {draft.vocab_size} tokens, "
                         f"the target's has {target.vocab_size}: a draft must share the target's vocabulary")
    target_tokens, draft_tokens = _tokenizer_vocabulary(target.path), _tokenizer_vocabulary(draft.path)
    if target_tokens is not None and draft_tokens is not None and target_tokens != draft_tokens:
        different = sorted(set(target_tokens.items()) ^ set(draft_tokens.items()), key=lambda item: item[1])[:3]
        raise ValueError(f"speculative_config.model {name!r} has another tokenizer than the target's "
                         f"(first differing (token, id) pairs: {different}): a draft must share the target's vocabulary")


def _tokenizer_vocabulary(folder: str) -> dict[str, int] | None:
    """token -> id of a folder's tokenizer.json (its model's vocabulary and its added tokens); None without one."""
    path = os.path.join(folder, "tokenizer.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        tokenizer = json.load(f)
    vocab = tokenizer.get("model", {}).get("vocab") or {}
    # BPE and WordPiece map token -> id; unigram models list (token, score) pairs by id.
    vocabulary = {token: i for i, (token, _) in enumerate(vocab)} if isinstance(vocab, list) else dict(vocab)
    vocabulary.update({added["content"]: added["id"] for added in tokenizer.get("added_tokens", [])})
    return vocabulary


def load_draft_runner(config: EngineConfig, spec: SpeculativeConfig, target: ModelConfig, num_kv_blocks: int,
                      max_model_len: int) -> ModelRunner:
    """The draft's ModelRunner with a pool of `num_kv_blocks` blocks of the target's block size."""
    draft_config = draft_engine_config(config, spec)
    model_config = draft_model_config(config, spec, target)
    runner = ModelRunner(draft_config, model_config, num_kv_blocks, max_model_len)
    logger.info("draft model %s: %s weights, KV pool of %d blocks", spec.model,
                draft_config.quantization or str(runner.dtype).removeprefix("torch."), num_kv_blocks)
    return runner
