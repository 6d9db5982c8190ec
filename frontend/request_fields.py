"""What happens to each request field that tokenloom does not honour: refused, or accepted and logged.

Nothing is ignored silently. A field that would change what the answer must be, and
that tokenloom does not do, gets a 400 naming it (unless it holds its "off" value).
A field that changes nothing about the answer (bookkeeping, routing hints) is
accepted and its name logged once. A name nobody knows is accepted and logged once,
as vLLM does, so a client that sends a newer harmless field keeps working. Every
field honoured is a declared field of the bodies in frontend.protocol; docs/request_fields.md
lists the decision for each.
"""

from __future__ import annotations

import logging
from typing import Any

from frontend.errors import InvalidRequestError

logger = logging.getLogger(__name__)

# field -> the values that mean "not used" (anything else: 400)
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "suffix": (None, ""),
    "functions": (None, []),  # the legacy form of tools
    "function_call": (None, "none"),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "web_search_options": (None,),
    "reasoning_effort": (None,),
    "verbosity": (None,),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1, 1.0),
    "truncate_prompt_tokens": (None,),
    "chat_template": (None,),
    "continue_final_message": (None, False),
    "documents": (None,),
    "mm_processor_kwargs": (None,),
    "logits_processors": (None,),
    "structural_tag": (None,),
    "guided_whitespace_pattern": (None,),
    "return_tokens_as_token_ids": (None, False),
    "return_token_ids": (None, False),
    "kv_transfer_params": (None,),
    "vllm_xargs": (None,),
    "add_special_tokens": (None, False),  # chat: the template writes the special tokens
    "spaces_between_special_tokens": (None, True),
    "guided_decoding_backend": (None, "xgrammar", "auto"),
    "echo": (None, False),  # chat completions (completions honour it)
}
# Accepted, logged once: they change nothing about the answer.
NO_EFFECT = frozenset({
    "user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key", "priority",
    "request_id", "cache_salt",
})

_logged: set[str] = set()


def check_extra_fields(extra: dict[str, Any] | None, unsupported: dict[str, tuple[Any, ...]] = UNSUPPORTED) -> None:
    """`extra`: the body's fields that are not declared on it (pydantic's model_extra); `unsupported`:
    the API's table of refused fields (this module's for OpenAI's completions and chat)."""
    for name, value in (extra or {}).items():
        if name in unsupported:
            if value not in unsupported[name]:
                raise InvalidRequestError(f"{name} is not supported")
            continue
        if name not in _logged:
            _logged.add(name)
            reason = "it changes nothing here" if name in NO_EFFECT else "an unknown field"
            logger.info("request field %r accepted and not used (%s); logged once", name, reason)
