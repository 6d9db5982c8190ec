"""Text on both sides of the engine: tokenizer, chat template, detokenizer, stop strings.

The server's frontend and the offline `engine.llm.LLM` both turn token ids into text
through this package (`output_processor.OutputProcessor`), so the two paths cannot
disagree. Like the rest of `ipc/`, it imports neither torch nor transformers.
"""
