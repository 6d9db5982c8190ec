"""The frontend's side of prefix caching: usage's cached_tokens, /metrics, the reset fan-out, the flags."""

from __future__ import annotations

import asyncio

import pytest

from engine.loop.core_process import parse_args
from frontend.engine_client import AsyncEngineClient, EngineClientConfig
from frontend.metrics import FrontendMetrics
from frontend.server_args import engine_args_from, make_parser
from frontend.serving_utils import Usage
from ipc.engine_config import engine_config_from_args
from ipc.messages import SchedulerStats
from ipc.text.output_processor import RequestDelta
from scripts.lib.fake_engine import FAKE_ENGINE_ARGV, read_event_log

pytestmark = pytest.mark.timeout(60)


def delta(index: int, num_cached_tokens: int) -> RequestDelta:
    return RequestDelta(index, "", [1], None, None, num_prompt_tokens=40, num_output_tokens=1,
                        num_cached_tokens=num_cached_tokens)


def test_usage_reports_cached_tokens_once_per_prompt():
    usage = Usage(n=2)
    for d in (delta(0, 0), delta(1, 32), delta(2, 16), delta(3, 16)):  # two prompts, two choices each
        usage.add(d)
    assert usage.to_dict() == {
        "prompt_tokens": 80, "completion_tokens": 4, "total_tokens": 84,
        "prompt_tokens_details": {"cached_tokens": 48},
        "completion_tokens_details": {"accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0},
    }


def test_metrics_show_prefix_cache_counters():
    stats = SchedulerStats(num_prefix_cache_queries=100, num_prefix_cache_hits=64, num_cached_blocks=7)
    text = FrontendMetrics("m").render(stats, is_healthy=True)
    assert 'tokenloom_prefix_cache_queries_total{model_name="m"} 100' in text
    assert 'tokenloom_prefix_cache_hits_total{model_name="m"} 64' in text
    assert 'tokenloom_prefix_cache_blocks{model_name="m"} 7' in text


@pytest.mark.parametrize("argv, engine_argv, is_on", [
    ([], [], True),
    (["--enable-prefix-caching"], ["--enable-prefix-caching"], True),
    (["--no-enable-prefix-caching"], ["--no-enable-prefix-caching"], False),
])  # fmt: skip
def test_the_switch_passes_through_to_the_core(argv, engine_argv, is_on):
    assert engine_args_from(make_parser().parse_args(argv))[:-2] == engine_argv  # then --log-level info
    assert engine_config_from_args(parse_args(["--address", "ipc:///tmp/x", *engine_argv])).enable_prefix_caching is is_on


def test_reset_reaches_every_core(model_folder, tmp_path):
    event_log = tmp_path / "events"

    async def main():
        config = EngineClientConfig(model=str(model_folder), num_local_engines=2,
                                    engine_args=["--event-log", str(event_log)],
                                    engine_command=FAKE_ENGINE_ARGV, ready_timeout_s=20)
        client = await AsyncEngineClient.start(config)
        try:
            client.reset_prefix_cache()
            for _ in range(50):
                if len(read_event_log(event_log, "reset_prefix_cache")) == 2:
                    break
                await asyncio.sleep(0.1)
            assert sorted(read_event_log(event_log, "reset_prefix_cache")) == ["0", "1"]
        finally:
            await client.shutdown()

    asyncio.run(asyncio.wait_for(main(), 30))
