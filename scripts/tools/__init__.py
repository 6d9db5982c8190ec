"""Tools that look at the code itself: which of our files a request passes through (request_path),
and the tracer it runs both server processes under (trace_files)."""
