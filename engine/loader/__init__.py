"""Model files: a name or path resolved to a local folder (model_files), GGUF files read and their
blocks kept (gguf_convert, gguf_blocks)."""
