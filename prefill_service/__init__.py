"""gRPC prefill worker: chunked prefill, each finished chunk's KV shipped to the decode worker."""
