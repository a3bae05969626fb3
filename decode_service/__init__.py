"""gRPC decode worker: owns each request's KV from the first byte, drives its prefill on a
prefill worker, then decodes it in the continuous batch and streams the tokens."""
