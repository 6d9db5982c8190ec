"""--speculative-config: vLLM's JSON, checked once, each bad field named."""

import pytest

from ipc.engine_config import EngineConfig
from ipc.speculative_config import SpeculativeConfig


def test_ngram_and_draft_configs_parse_with_vllms_defaults():
    config = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4}')
    assert (config.method, config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max) == \
        ("ngram", 4, 1, 4)
    draft = EngineConfig(speculative_config={"method": "draft", "model": "self-int4", "num_speculative_tokens": 3})
    assert draft.speculative == SpeculativeConfig("draft", 3, model="self-int4")
    assert SpeculativeConfig.parse(draft.speculative.to_json()) == draft.speculative
    assert EngineConfig().speculative is None


@pytest.mark.parametrize("value, field", [
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": -1}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 17}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
    ({"method": "medusa", "num_speculative_tokens": 2}, "method"),
    ({"method": "draft", "num_speculative_tokens": 2}, "model"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 2},
     "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "tokens": 3}, "unknown field"),
    ("{not json", "JSON"),
])
def test_bad_configs_are_refused_naming_the_field(value, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(speculative_config=value)
