"""Output text from token ids: incremental detokenizing and stop strings.

Pure Python (no torch, no transformers) and shared by both sides that turn tokens
into text: the frontend's per-request state and the offline `engine.LLM`. Neither
`engine` nor `frontend` imports the other, so this logic lives beside them.
"""
