"""A capacity simulator: the engine's real Scheduler, StaticScheduler, PaddedStaticScheduler and BlockManager,
stepped on a simulated clock by a runner that prices each step instead of running it.

    model_shape.py       bytes and FLOPs per step from a config.json
    hardware_profile.py  peak rates, efficiencies, KV memory, overheads (profiles/*.json)
    step_cost.py         one step's price from its tokens, sequences, contexts and chunks
    simulated_runner.py  the model runner that does no math
    simulator.py         the simulated clock around the real scheduler
    calibration.py       this machine's profile from micro-benchmarks and measured steps
    capacity.py          the highest request rate within an SLO

`scripts/simulate/run.py` is the command line.
"""
