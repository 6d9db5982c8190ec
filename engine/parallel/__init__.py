"""Tensor and pipeline parallelism below the models: one model split across ranks over torch.distributed.

- `parallel_state`: rendezvous (a TCP store, as torchrun), the process group, the collectives.
- `peer_wait`: rank 0 waits on a collective in slices, asking the executor whether every rank lives.
- `parallel_layers`: row-parallel linears, the vocab-parallel embedding, checkpoint sharding.
- `pipeline`: pipeline stages (consecutive layers), the hand-off between them.

The processes that run the ranks are engine/executor/'s, a floor above the model runner.
"""
