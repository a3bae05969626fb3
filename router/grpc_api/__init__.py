"""The public gRPC API (pdserve.v1.Generation) with health checking and reflection."""
