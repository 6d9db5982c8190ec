"""The baselines continuous batching is measured against, on the same model code: static batching
and padded static batching. Plugged in by config; engine.core never imports them."""
