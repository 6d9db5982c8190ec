"""The ranks' processes, above the model runner: rank 0 drives workers that each run a runner.

- `executor`: rank 0's side: starts and watches the workers, sends each step's inputs;
  `ray_executor`: the same with the workers as Ray actors; `backends` picks one.
- `messages`: the records rank 0 sends its workers (msgpack, no pickle).
- `worker_process`: a worker rank's process: receive a step, run it, repeat.
- `process_checks`: a worker dies with its parent; the rendezvous address is checked.

The layers the models split with are engine/parallel/'s, a floor below the models.
"""
