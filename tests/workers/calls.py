"""What the worker tests share: their prompts, and Decode.Generate called directly."""

from __future__ import annotations

import grpc

from pdserve.v1 import generation_pb2 as pb
from pdserve.worker.v1 import worker_pb2 as wpb
from pdserve.worker.v1 import worker_pb2_grpc

# A long text, and token ids giving several seconds of prefill on one thread (time for a fault
# to land mid-request).
LONG_PROMPT = " ".join(
    f"Note {i}: the warehouse shipped {i * 11} crates of apples to the harbour on day {i}."
    for i in range(70)
)
LONG = [(13 * i) % 5000 + 200 for i in range(3000)]
# Eight short prompts, for tests that send a batch of streams at once.
PROMPTS = [
    "The capital of France is",
    "def add(a, b):\n    return",
    "Once upon a time, in a small village,",
    "The three primary colours are",
    "Water boils at a temperature of",
    "Translate to French: good morning, my friend.",
    "A list of prime numbers: 2, 3, 5,",
    "The quick brown fox",
]


def generate(
    decode_address: str, prompt_ids: list[int], prefill_address: str = "",
    prefill_here: bool = False, **params,
):  # fmt: skip
    """Calls Decode.Generate directly; returns the stream's messages."""
    stub = worker_pb2_grpc.DecodeStub(grpc.insecure_channel(decode_address))
    request = wpb.DecodeRequest(
        prompt_token_ids=prompt_ids,
        params=pb.SamplingParams(**params),
        prefill_address=prefill_address,
        prefill_here=prefill_here,
    )
    return list(stub.Generate(request, timeout=300))


def token_ids(messages) -> list[int]:
    return [t for m in messages for t in m.token_ids]
