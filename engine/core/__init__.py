"""The engine core: the busy loop and its process (core_process, engine_core), the scheduler and
block manager, and the records a step passes around (request, scheduler_output, step_outputs,
step_stats). Plain objects: nothing here imports the worker, the models or the baselines."""
