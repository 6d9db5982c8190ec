"""The batching modes plugged in: which scheduler and which model runner a config's `batching`
names. The one place that knows the baselines (engine/baselines/): engine/core/ and
engine/worker/ never import them, and the loop asks here once, at start."""

from __future__ import annotations

from dataclasses import dataclass

from engine.baselines.padded_static_runner import PaddedStaticRunner
from engine.baselines.padded_static_scheduler import PaddedStaticScheduler
from engine.baselines.static_scheduler import StaticScheduler
from engine.config import EngineConfig
from engine.core.scheduler import Scheduler
from engine.worker.model_runner import ModelRunner


@dataclass(frozen=True)
class BatchingMode:
    scheduler_class: type[Scheduler]
    runner_class: type[ModelRunner]
    speculates: bool  # proposals and verification; the static baselines keep one token per step


BATCHING_MODES = {
    "continuous": BatchingMode(Scheduler, ModelRunner, speculates=True),
    "static": BatchingMode(StaticScheduler, ModelRunner, speculates=False),
    "static-padded": BatchingMode(PaddedStaticScheduler, PaddedStaticRunner, speculates=False),
}


def batching_mode(config: EngineConfig) -> BatchingMode:
    return BATCHING_MODES[config.batching]
