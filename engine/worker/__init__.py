"""The worker: the model runner, which owns the model, the KV pool and every conversion from a
scheduled step's Python lists to tensors (step_inputs), and the ways a step runs on a device
(CUDA graphs, torch.compile, pooling)."""
