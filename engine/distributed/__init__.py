"""Tensor and pipeline parallelism over torch.distributed: one model split across ranks.

- `parallel_state`: rendezvous (a TCP store, as torchrun), the process group, the collectives.
- `peer_wait`: rank 0 waits on a collective in slices, asking the executor whether every rank lives.
- `parallel_layers`: row-parallel linears, the vocab-parallel embedding, checkpoint sharding.
- `messages`: the records rank 0 sends its workers (msgpack, no pickle).
- `pipeline`: pipeline stages (consecutive layers), the hand-off between them.
- `executor`: rank 0's side: starts and watches the workers, sends each step's inputs;
  `ray_executor`: the same with the workers as Ray actors.
- `worker`: a worker rank's process: receive a step, run it, repeat.
"""
