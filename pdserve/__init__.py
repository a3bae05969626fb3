"""pdserve's shared pieces: the CLI, the worker registry, the worker runtime, the local launcher.

The generated gRPC stubs live in pdserve.v1 (public API) and pdserve.worker.v1 (internal);
`python -m proto.build` writes them from proto/.
"""
