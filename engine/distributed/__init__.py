"""Tensor parallelism over torch.distributed: one model's layers split across ranks.

- `parallel_state`: rendezvous (a TCP store, as torchrun), the process group, the collectives.
- `parallel_layers`: row-parallel linears, the vocab-parallel embedding, checkpoint sharding.
- `messages`: the records rank 0 sends its workers (msgpack, no pickle).
- `executor`: rank 0's side: starts and watches the workers, sends each step's inputs.
- `worker`: a worker rank's process: receive a step, run it, repeat.
"""
