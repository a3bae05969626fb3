"""Aggregated serving on real processes: `pdserve up --prefill 0 --decode 0 --aggregated 1`
serves through one worker that prefills and decodes, with the engine's own greedy tokens; a
prefill and a decode worker joining make it a mixed cluster, where short prompts still go
whole to the aggregated worker and longer ones split across the P/D pools."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import grpc
import httpx
import pytest
from router_harness import one_torch_thread, pdserve_up

from engine import SamplingParams
from pdserve.redis_server import free_port
from pdserve.v1 import generation_pb2 as pb
from pdserve.v1 import generation_pb2_grpc
from tests.cluster import Cluster, sample_value
from tests.waiting import wait_until

# For `up`'s children: the router's short bucket (what a mixed cluster sends whole) and the
# aggregated worker's prefill chunk, so the medium prompt is prefilled in four chunks; the
# fp32 weights of the reference engine (the llm fixture).
UP_ENV = {"PDSERVE_SHORT_BELOW": "64", "PDSERVE_CHUNK_SIZE": "128", "PDSERVE_QUANTIZATION": "none"}
NUM_TOKENS = 8
SHORT = "The capital of France is"
MEDIUM = " ".join(f"Crate {i} held {i * 7} apples." for i in range(40))  # ~400 tokens


class Up:
    def __init__(self, http_url: str, grpc_address: str, redis_url: str) -> None:
        self.http_url, self.grpc_address, self.redis_url = http_url, grpc_address, redis_url

    def metric(self, name: str, **labels: str) -> float:
        return sample_value(httpx.get(f"{self.http_url}/metrics", timeout=10).text, name, **labels)

    def wait_for_workers(self, counts: dict[str, int]) -> None:
        """Until the router's /health counts these workers of each role."""
        wait_until(
            lambda: httpx.get(f"{self.http_url}/health", timeout=10).json()["workers"] == counts,
            timeout_s=180, interval_s=0.2, message=f"the router to see {counts}",
        )  # fmt: skip

    def generate(self, prompt_ids: list[int]) -> list[int]:
        params = pb.SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True)
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt_ids), params=params)
        with grpc.insecure_channel(self.grpc_address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            return [t for m in stub.Generate(request, timeout=300) for t in m.token_ids]


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    http_port, grpc_port = free_port(), free_port()
    with pdserve_up(
        "--prefill", "0", "--decode", "0", "--aggregated", "1",
        "--http-port", str(http_port), "--grpc-port", str(grpc_port),
        "--no-warmup", "--kv-backend", "tcp", "--cores", "1",
        "--log-dir", str(tmp_path_factory.mktemp("pdserve-up-aggregated")), env=UP_ENV,
    ) as (banner, redis_url):  # fmt: skip
        assert "pdserve is up: 0 prefill + 0 decode + 1 aggregated worker(s)" in banner, banner
        yield Up(f"http://127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}", redis_url)


@pytest.fixture(scope="module")
def reference(llm) -> Callable[[list[int]], list[int]]:
    def run(prompt_ids: list[int]) -> list[int]:
        params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
        with one_torch_thread():
            return llm.generate([prompt_ids], params)[0].token_ids

    return run


def test_aggregated_cluster_gives_the_engines_greedy_tokens(up, llm, reference):
    health = httpx.get(f"{up.http_url}/health", timeout=10)
    assert health.status_code == 200
    assert health.json() == {"status": "ok", "workers": {"prefill": 0, "decode": 0,
                                                         "aggregated": 1}}  # fmt: skip
    medium = llm.tokenizer.encode(MEDIUM)
    assert 384 < len(medium) < 512  # four 128-token chunks; the medium bucket

    # The module's other tests send requests too: counters are compared with their values now.
    def counters() -> list[float]:
        routed = [up.metric("pdserve_router_routed_total", role=role, worker="aggregated-0")
                  for role in ("aggregated", "prefill")]  # fmt: skip
        kinds = ("predicted", "prediction_error")
        observed = [up.metric(f"pdserve_router_queue_wait_{kind}_seconds_count",
                              length_bucket=bucket)
                    for kind in kinds for bucket in ("short", "medium")]  # fmt: skip
        return routed + observed

    before = counters()
    for prompt in (llm.tokenizer.encode(SHORT), medium):
        assert up.generate(prompt) == reference(prompt)
    # Both went whole to the aggregated worker, none through a prefill pool; every dispatched
    # request's predicted wait is observed beside its actual one, once per bucket.
    assert [a - b for a, b in zip(counters(), before, strict=True)] == [2, 0, 1, 1, 1, 1]


def test_n_samples_on_the_aggregated_worker(up, llm):
    """Sample 0 prefills, its first token forks the others onto its cached prompt blocks;
    seeded, sample i is the engine's n = 1 output seeded seed + i."""
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=1.0, seed=99, n=3)
    with one_torch_thread():
        want = llm.generate([SHORT] * 3, [params.sample(i) for i in range(3)])
    request = pb.GenerateRequest(text=SHORT, params=pb.SamplingParams(
        max_tokens=NUM_TOKENS, temperature=1.0, seed=99, n=3,
    ))  # fmt: skip
    with grpc.insecure_channel(up.grpc_address) as channel:
        whole = generation_pb2_grpc.GenerationStub(channel).Complete(request, timeout=300)
    assert [list(c.token_ids) for c in whole.choices] == [w.token_ids for w in want]
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert whole.usage.completion_tokens == sum(len(w.token_ids) for w in want)


def test_mixed_cluster_sends_short_prompts_whole_and_longer_ones_split(up, llm, reference):
    workers = Cluster(redis=_Attached(up.redis_url))  # type: ignore[arg-type]
    try:
        prefill = workers.start("prefill", "--chunk-size", "128", wait=False)
        decode = workers.start("decode", wait=False)
        workers.wait_all_registered()
        up.wait_for_workers({"prefill": 1, "decode": 1, "aggregated": 1})
        short, medium = llm.tokenizer.encode(SHORT), llm.tokenizer.encode(MEDIUM)
        routed = lambda role, worker: up.metric(  # noqa: E731
            "pdserve_router_routed_total", role=role, worker=worker
        )
        before = routed("aggregated", "aggregated-0")
        assert up.generate(short) == reference(short)
        assert routed("aggregated", "aggregated-0") == before + 1
        assert up.generate(medium) == reference(medium)  # medium bucket: split
        assert routed("aggregated", "aggregated-0") == before + 1
        assert routed("prefill", prefill.worker_id) == 1
        assert routed("decode", decode.worker_id) == 1
    finally:
        workers.stop()
        # Killed, the joined workers would stay listed until their entries expire: unlist them
        # (as a drained worker does) so the module's other tests see the aggregated cluster.
        for w in workers.workers:
            workers.registry.remove(w.role, w.worker_id)
        up.wait_for_workers({"prefill": 0, "decode": 0, "aggregated": 1})


class _Attached:
    """The `up` cluster's Redis for tests.cluster.Cluster, which stops only what it started."""

    def __init__(self, url: str) -> None:
        self.url = url

    def stop(self) -> None:
        pass
