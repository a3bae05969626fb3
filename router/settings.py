"""The router's configuration: listeners, security, admission limits and routing weights."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from pdserve.lengths import LengthBucket, LengthBuckets
from pdserve.tls import TLSFiles

PolicyName = Literal["watermark", "round_robin", "hash"]
AdmissionMode = Literal["length_aware", "fifo", "pass_through"]
PrefillOverflow = Literal["queue", "decode"]
POLICY_NAMES: tuple[PolicyName, ...] = ("watermark", "round_robin", "hash")
ADMISSION_MODES: tuple[AdmissionMode, ...] = ("length_aware", "fifo", "pass_through")
PREFILL_OVERFLOWS: tuple[PrefillOverflow, ...] = ("queue", "decode")


class SettingsError(ValueError):
    """A router setting that can never work (reported at start-up, with the value)."""


@dataclass(frozen=True, slots=True)
class AdmissionSettings:
    # length_aware: the bucket queues below; fifo: one arrival order. pass_through: what a
    # plain Kubernetes Service in front of the workers gives, a baseline: every request goes
    # to a worker at once, with no prefill budget, KV room or KV headroom checked here.
    mode: AdmissionMode = "length_aware"
    buckets: LengthBuckets = field(default_factory=LengthBuckets)
    # Aging: a medium/long request is served as if it had arrived this much later than it did,
    # so short ones overtake it, but only for this long (its wait stays bounded).
    medium_delay_s: float = 5.0
    long_delay_s: float = 20.0
    # Prompt tokens one prefill worker may hold at once (queued + computing); the rest wait in
    # the router, where the bucket order applies. An idle worker always takes one request.
    prefill_token_budget: int = 2048
    # When every prefill worker is at its budget: queue: the request waits here for one;
    # decode: a decode worker with room computes the prompt itself, within the same budget of
    # its own (Dynamo's conditional disaggregation; its decode steps then carry prompt chunks).
    prefill_overflow: PrefillOverflow = "queue"
    max_queued_requests: int = 256
    # A request whose predicted time to first token (everything in front of it at the
    # measured prefill speed, corrected by what earlier requests saw) is over this is
    # rejected at once (429). None, the default: no objective; requests queue, bounded by
    # max_queued_requests and queue_timeout_s, as in vLLM and SGLang.
    ttft_slo_s: float | None = None
    max_queue_wait_s: float | None = None  # estimated router queue wait above this: 429
    queue_timeout_s: float = 120.0  # a queued request that waited this long gets a 429
    default_prefill_tokens_per_s: float = 500.0  # until a worker of the role has measured
    # A request holds its prompt plus this many output tokens of decode KV at admission; the
    # decode engine grows and preempts beyond it.
    kv_output_reserve_tokens: int = 128
    kv_reject_below_ratio: float = 0.05  # decode pool free fraction under which new work is 429

    def __post_init__(self) -> None:
        if self.mode not in ADMISSION_MODES:
            raise SettingsError(f"admission mode must be one of {ADMISSION_MODES}: {self.mode!r}")
        if self.prefill_overflow not in PREFILL_OVERFLOWS:
            raise SettingsError(
                f"prefill overflow must be one of {PREFILL_OVERFLOWS}: {self.prefill_overflow!r}"
            )
        positive = {
            "prefill_token_budget": self.prefill_token_budget,
            "ttft_slo_s": 1.0 if self.ttft_slo_s is None else self.ttft_slo_s,
            "max_queue_wait_s": 1.0 if self.max_queue_wait_s is None else self.max_queue_wait_s,
            "queue_timeout_s": self.queue_timeout_s,
            "default_prefill_tokens_per_s": self.default_prefill_tokens_per_s,
        }
        problems = [f"{name}={value} must be > 0" for name, value in positive.items() if value <= 0]
        non_negative = {
            "max_queued_requests": self.max_queued_requests,
            "medium_delay_s": self.medium_delay_s,
            "long_delay_s": self.long_delay_s,
            "kv_output_reserve_tokens": self.kv_output_reserve_tokens,
        }
        problems += [f"{name}={value} must be >= 0" for name, value in non_negative.items()
                     if value < 0]  # fmt: skip
        if not 0.0 <= self.kv_reject_below_ratio < 1.0:
            problems.append(f"kv_reject_below_ratio={self.kv_reject_below_ratio} not in [0, 1)")
        if problems:
            raise SettingsError("admission settings: " + "; ".join(problems))

    def delays_s(self) -> dict[LengthBucket, float]:
        """Per-bucket aging delay; FIFO is the same queue with every delay 0 (and so is pass
        through, whose queue never holds a request)."""
        if self.mode != "length_aware":
            return {"short": 0.0, "medium": 0.0, "long": 0.0}
        return {"short": 0.0, "medium": self.medium_delay_s, "long": self.long_delay_s}


@dataclass(frozen=True, slots=True)
class RoutingSettings:
    policy: PolicyName = "watermark"
    # Watermark T = a * queued_tokens / tokens_per_s + b * queued_requests.
    watermark_a: float = 0.6
    watermark_b: float = 0.4
    # The watermark policy's prefix scorers (0: load only). Prefill: seconds of prefill the
    # worker's cache saves (cached prompt tokens / its speed) count this much against the
    # watermark's T; equal to watermark_a, a cached token weighs as much as a queued one.
    # Decode: the fraction of the prompt's KV the worker holds counts this much against its
    # KV usage + running-requests cost (each in [0, 1]).
    prefix_prefill_weight: float = 0.6
    prefix_decode_weight: float = 0.5

    def __post_init__(self) -> None:
        if self.policy not in POLICY_NAMES:
            raise SettingsError(f"routing policy must be one of {POLICY_NAMES}: {self.policy!r}")
        weights = {"prefix_prefill_weight": self.prefix_prefill_weight,
                   "prefix_decode_weight": self.prefix_decode_weight}  # fmt: skip
        problems = [f"{name}={value} must be >= 0" for name, value in weights.items()
                    if not value >= 0]  # fmt: skip
        if problems:
            raise SettingsError("routing settings: " + "; ".join(problems))


@dataclass(frozen=True, slots=True)
class RouterSettings:
    redis_url: str
    model: str = "smollm2-135m"  # the name clients send, and the tokenizer the router loads
    host: str = "127.0.0.1"
    http_port: int = 8000  # 0: the OS picks
    grpc_port: int = 50051
    api_key: str | None = None
    tls: TLSFiles = field(default_factory=TLSFiles)  # the public listeners
    worker_tls: TLSFiles = field(default_factory=TLSFiles)  # router -> decode worker calls
    max_body_bytes: int = 4 << 20
    max_prompt_tokens: int | None = None  # None: the workers' context minus one
    registry_refresh_s: float = 0.5
    drain_grace_s: float = 10.0
    num_threads: int | None = None  # tokenization threads; None: Python's default pool
    # One deadline per request, from its arrival: the decode call (prefill and KV landing
    # included) gets what is left of it, or less when a gRPC client's own deadline is sooner.
    request_timeout_s: float = 600.0
    # Times a request moves to another decode worker when its worker is lost mid-stream.
    max_migrations: int = 1
    admission: AdmissionSettings = field(default_factory=AdmissionSettings)
    routing: RoutingSettings = field(default_factory=RoutingSettings)

    def __post_init__(self) -> None:
        problems = []
        if not self.request_timeout_s > 0:
            problems.append(f"request_timeout_s={self.request_timeout_s} must be > 0")
        if self.max_migrations < 0:
            problems.append(f"max_migrations={self.max_migrations} must be >= 0")
        if problems:
            raise SettingsError("router settings: " + "; ".join(problems))
