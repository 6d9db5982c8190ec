"""What the scripts (and tests) share: workloads, latency arithmetic, a local server, result tables,
plots, a headless browser, the live view and the fake engine core."""
