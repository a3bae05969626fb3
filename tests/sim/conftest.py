"""A cost model simple enough to work TTFTs out by hand, and small cluster builders."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from engine import EngineConfig
from engine.config import ModelConfig
from router.settings import AdmissionSettings, RoutingSettings
from sim.cluster import ClusterConfig
from sim.costs import StepShape
from sim.worker import WorkerSpec

TINY_MODEL = ModelConfig(
    hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2, num_kv_heads=1,
    head_dim=32, vocab_size=50000, rms_norm_eps=1e-5, rope_theta=10000.0,
    max_position_embeddings=4096, tie_word_embeddings=True, attention_bias=False,
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class LinearCost:
    """step = 10 ms + 1 ms per prefill token + 2 ms per decode; KV send 5 ms; hop 1 ms; a
    block of 16 tokens (65,536 bytes) copied to or from the host tier 1 ms."""

    overhead_s: float = 0.010
    per_prefill_token_s: float = 0.001
    per_decode_s: float = 0.002
    transfer_s: float = 0.005
    hop_s: float = 0.001
    host_copy_bytes_per_s: float = 65_536_000.0
    kv_bytes_per_token: int = 4096
    step_overhead_tokens: int = 0  # packs bursts, as a GPU; tests of the split set their own
    model: ModelConfig = field(default=TINY_MODEL)

    def step_s(self, shape: StepShape) -> float:
        return (self.overhead_s + self.per_prefill_token_s * shape.num_prefill_tokens
                + self.per_decode_s * shape.num_decode)  # fmt: skip

    def kv_transfer_s(self, num_tokens: int) -> float:
        return self.transfer_s


@pytest.fixture
def cost() -> LinearCost:
    return LinearCost()


def pd_cluster(num_prefill: int = 2, num_decode: int = 1, *, slow: float = 1.0,
               admission: AdmissionSettings | None = None, policy: str = "watermark",
               decode_blocks: int = 1024) -> ClusterConfig:  # fmt: skip
    """The last prefill worker is `slow` times slower."""
    specs = tuple(
        WorkerSpec(f"p{i}", "prefill", slow if i == num_prefill - 1 else 1.0)
        for i in range(num_prefill)
    ) + tuple(WorkerSpec(f"d{i}", "decode") for i in range(num_decode))
    return ClusterConfig(
        specs, EngineConfig(), EngineConfig(num_blocks=decode_blocks),
        admission or AdmissionSettings(), RoutingSettings(policy=policy),
    )  # fmt: skip
