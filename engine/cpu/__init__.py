"""How the CPU runs a model: oneDNN-prepacked and slab matmuls (packing.py), fused element-wise
ops (fused.py), int8 and int4 linears (int8_linear.py, int4_linear.py, quantized_plan.py), decode
steps in one C++ call (decode_stack.py), applied to a built model from outside (fast_paths.py),
and the host it runs on (host.py). The model runner comes in through one door,
execution_plan.py: a plan made before the weights load, applied once they have.
engine/models/ says what the network computes and imports nothing from here."""
