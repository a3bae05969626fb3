"""The front door: OpenAI-compatible HTTP and public gRPC, length-aware admission, routing to
a prefill and a decode worker, and backpressure (HTTP 429 / gRPC RESOURCE_EXHAUSTED).

Data path: client -> http_api | grpc_api -> gateway (tokenize, limits) -> admission (queues,
budgets) -> routing (pick workers) -> upstream (Decode.Generate) -> tokens stream back.
"""
