"""Soak: a bounded run of mixed requests over a local cluster while it is hurt on purpose.

A LocalCluster (2 prefill + 2 decode workers, one thread each, and the router) runs in this
process, supervised as `pdserve up` supervises it. Several client streams send --requests
requests of mixed prompt length (70% short, 30% long) through both front doors (OpenAI HTTP
with SSE, and the router's gRPC Generate), most of them greedy. Meanwhile:
  - about --disconnect-fraction of the requests are closed by their client mid-way (after a
    random delay, or after a random number of streamed chunks);
  - every --kill-every-s seconds one live worker is killed with SIGKILL (the launcher restarts
    it);
  - once, when half the requests have ended, Redis is killed (the launcher restarts it on the
    same port and the workers' heartbeats register them again).

Every request must end as completed, or a clean error (an HTTP 4xx/5xx with an OpenAI error
body, an in-band SSE error event, or a gRPC status other than UNKNOWN), and none may hang past
--request-timeout-s. A client that got a clean error pauses (Retry-After, else 1 s) before its
next request, as a real one would, instead of spending the workload on a burst of instant 503s
while the cluster recovers; each error still counts. Completed greedy requests are compared
with the single-process engine (engine.LLM, same model, fp32 activations and the workers'
--quantization, default auto: what users get; computed before the soak): gRPC
token by token, HTTP by text, finish reason and completion-token count. Once the load is over
and the workers idle, every worker's KV blocks are read from its /metrics: a block still in use
is leaked.

Anything else is reported, not hidden: unclean errors (a 5xx without an error body, a stream
that just ends, a dropped connection, gRPC UNKNOWN) count separately. The last line of stdout
is one JSON object: completed, clean_errors, unclean_errors, hung, leaked_blocks,
token_mismatches, requests, disconnects, worker_kills, redis_restarts, duration_s, errors (by
kind), examples and the configuration.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import signal
import sys
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

# bench/engine.py would shadow the engine package: import from the repository root instead.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

import grpc  # noqa: E402
import httpx  # noqa: E402

from bench.serve import percentile, word_ids  # noqa: E402
from engine.model_files import resolve_model  # noqa: E402
from engine.tokenizer import TextTokenizer  # noqa: E402
from pdserve.launcher import ClusterSpec, LocalCluster  # noqa: E402
from pdserve.registry import Registry, WorkerInfo  # noqa: E402
from pdserve.v1 import generation_pb2 as pb  # noqa: E402
from pdserve.v1 import generation_pb2_grpc  # noqa: E402

Api = Literal["http", "grpc"]
Kind = Literal["completed", "clean_error", "unclean_error", "hung", "disconnected"]
SHORT_TOKENS, LONG_TOKENS, LONG_FRACTION = (20, 150), (150, 600), 0.3
CLIENT_PAUSE_S = 1.0  # after an error without Retry-After


@dataclass(frozen=True, slots=True)
class Job:
    index: int
    api: Api
    prompt_token_ids: list[int]
    max_tokens: int
    temperature: float  # 0: greedy, compared with the engine
    ignore_eos: bool
    disconnect_after_s: float | None = None  # the client closes after this long...
    disconnect_after_chunks: int | None = None  # ...or after this many streamed text chunks

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(slots=True)
class Outcome:
    kind: Kind
    error: str = ""  # the error's kind, e.g. http_503, in_band:service_unavailable
    detail: str = ""
    text: str = ""
    token_ids: list[int] | None = None  # gRPC only: HTTP streams carry text
    finish_reason: str = ""
    num_completion_tokens: int | None = None
    saw_token: bool = False
    retry_after_s: float | None = None  # the server's Retry-After, on a 429 / 503
    ttft_s: float | None = None
    e2e_s: float | None = None


@dataclass(frozen=True, slots=True)
class Reference:
    token_ids: list[int]
    text: str
    finish_reason: str


@dataclass(slots=True)
class Chaos:
    worker_kills: list[str] = field(default_factory=list)
    redis_kills: int = 0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--concurrency", type=int, default=6)
    parser.add_argument("--prefill", type=int, default=2)
    parser.add_argument("--decode", type=int, default=2)
    parser.add_argument("--cores", type=int, default=2, help="divided among the workers")
    parser.add_argument("--kv-backend", default="auto")
    parser.add_argument("--quantization", default="auto", help="workers and the reference")
    parser.add_argument("--min-tokens", type=int, default=16, help="max_tokens, low end")
    parser.add_argument("--max-tokens", type=int, default=48, help="max_tokens, high end")
    parser.add_argument("--greedy-fraction", type=float, default=0.8)
    parser.add_argument("--grpc-fraction", type=float, default=0.25)
    parser.add_argument("--disconnect-fraction", type=float, default=0.1)
    parser.add_argument("--kill-every-s", type=float, default=20.0, help="0: no kills")
    parser.add_argument("--no-redis-restart", action="store_true")
    parser.add_argument("--request-timeout-s", type=float, default=300.0, help="then: hung")
    parser.add_argument("--idle-timeout-s", type=float, default=300.0)
    parser.add_argument("--ref-threads", type=int, default=1, help="2 thrash on busy cores")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


# ---- the workload -----------------------------------------------------------------------------
def workload(args: argparse.Namespace, words: list[int]) -> list[Job]:
    rng = random.Random(args.seed)
    jobs = []
    for index in range(args.requests):
        low, high = LONG_TOKENS if rng.random() < LONG_FRACTION else SHORT_TOKENS
        prompt = [rng.choice(words) for _ in range(rng.randint(low, high))]
        max_tokens = rng.randint(args.min_tokens, args.max_tokens)
        greedy = rng.random() < args.greedy_fraction
        after_s = after_chunks = None
        if rng.random() < args.disconnect_fraction:
            if rng.random() < 0.5:  # often before the first token: during the remote prefill
                after_s = rng.uniform(0.05, 3.0)
            else:
                after_chunks = rng.randint(1, max_tokens - 1)
        jobs.append(Job(
            index, "grpc" if rng.random() < args.grpc_fraction else "http", prompt, max_tokens,
            0.0 if greedy else 0.8, rng.random() < 0.5, after_s, after_chunks,
        ))  # fmt: skip
    return jobs


def references(jobs: list[Job], threads: int, quantization: str) -> dict[int, Reference]:
    """The single-process engine's outputs for the greedy jobs, in one batch (batched == alone,
    as tests/engine asserts)."""
    from engine import LLM, SamplingParams

    greedy = [j for j in jobs if j.is_greedy]
    llm = LLM(dtype="float32", num_threads=threads, quantization=quantization)
    params = [SamplingParams(max_tokens=j.max_tokens, temperature=0, ignore_eos=j.ignore_eos)
              for j in greedy]  # fmt: skip
    outputs = llm.generate([j.prompt_token_ids for j in greedy], params)
    return {
        j.index: Reference(list(o.token_ids), o.text, o.finish_reason or "")
        for j, o in zip(greedy, outputs, strict=True)
    }


# ---- clients ------------------------------------------------------------------------------------
async def send(job: Job, http: httpx.AsyncClient, grpc_stub, urls: dict[str, str],
               timeout_s: float) -> Outcome:  # fmt: skip
    """One request, bounded by timeout_s (past it: hung) and by its planned disconnect."""
    outcome = Outcome("completed")
    started = time.monotonic()
    request = _send_http(job, http, urls["http"], outcome, started) if job.api == "http" else (
        _send_grpc(job, grpc_stub, outcome, started)
    )  # fmt: skip
    task = asyncio.ensure_future(_unexpected_is_unclean(request, outcome))
    close_s = job.disconnect_after_s
    try:
        if close_s is not None and close_s < timeout_s:
            done, _ = await asyncio.wait({task}, timeout=close_s)
            if not done:
                await _cancel(task)
                outcome.kind = "disconnected"
                return outcome
        await asyncio.wait_for(asyncio.shield(task), timeout_s - (time.monotonic() - started))
    except TimeoutError:
        await _cancel(task)
        return Outcome("hung", "hung", f"no end after {timeout_s:.0f} s",
                       saw_token=outcome.saw_token)  # fmt: skip
    outcome.e2e_s = time.monotonic() - started
    return outcome


async def _unexpected_is_unclean(request, out: Outcome) -> None:
    """A response this client cannot parse is the server's fault, and must not end the run."""
    try:
        await request
    except (ValueError, KeyError, TypeError) as e:
        _set_error(out, "unclean_error", f"unparsable_response:{type(e).__name__}", str(e))


async def _cancel(task: asyncio.Future) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def _send_http(job: Job, client: httpx.AsyncClient, url: str, out: Outcome,
                     started: float) -> None:  # fmt: skip
    body = {"prompt": job.prompt_token_ids, "max_tokens": job.max_tokens,
            "temperature": job.temperature, "ignore_eos": job.ignore_eos, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                _http_error(out, response.status_code, await response.aread())
                retry_after = response.headers.get("retry-after", "")
                out.retry_after_s = float(retry_after) if retry_after.isdigit() else None
                return
            num_chunks, done = 0, False
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                event = json.loads(line[6:])
                if "error" in event:  # the 200 status line was sent: errors come in-band
                    _set_error(out, "clean_error", f"in_band:{event['error'].get('type')}",
                               event["error"].get("message", ""))  # fmt: skip
                    return
                if event.get("usage"):
                    out.num_completion_tokens = event["usage"]["completion_tokens"]
                for choice in event.get("choices", []):
                    if choice["text"]:
                        num_chunks += 1
                        _saw_token(out, started)
                    out.text += choice["text"]
                    out.finish_reason = choice.get("finish_reason") or out.finish_reason
                if job.disconnect_after_chunks is not None and num_chunks >= (
                    job.disconnect_after_chunks
                ):
                    out.kind = "disconnected"  # leaving the block closes the connection
                    return
            if not done:
                _set_error(out, "unclean_error", "http_stream_truncated",
                           "the SSE stream ended without [DONE] or an error event")  # fmt: skip
    except httpx.HTTPError as e:
        _set_error(out, "unclean_error", f"http_connection:{type(e).__name__}", str(e))


def _http_error(out: Outcome, status: int, raw: bytes) -> None:
    try:
        error = json.loads(raw)["error"]
        clean = isinstance(error.get("message"), str) and isinstance(error.get("type"), str)
    except (ValueError, KeyError, TypeError, AttributeError):
        clean = False
    if clean:
        _set_error(out, "clean_error", f"http_{status}", error["message"])
    else:
        _set_error(
            out, "unclean_error", f"http_{status}_no_error_body", raw[:200].decode("replace")
        )


async def _send_grpc(job: Job, stub, out: Outcome, started: float) -> None:
    request = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=job.prompt_token_ids),
        params=pb.SamplingParams(
            max_tokens=job.max_tokens, temperature=job.temperature, ignore_eos=job.ignore_eos
        ),  # fmt: skip
    )
    call = stub.Generate(request)
    out.token_ids = []
    num_chunks = 0
    try:
        async for message in call:
            if message.token_ids:
                num_chunks += 1
                _saw_token(out, started)
            out.token_ids.extend(message.token_ids)
            out.text += message.text
            out.finish_reason = message.finish_reason or out.finish_reason
            if message.HasField("usage"):
                out.num_completion_tokens = message.usage.completion_tokens
            if job.disconnect_after_chunks is not None and num_chunks >= (
                job.disconnect_after_chunks
            ):
                call.cancel()
                out.kind = "disconnected"
                return
        if not out.finish_reason:
            _set_error(out, "unclean_error", "grpc_stream_truncated",
                       "the stream ended without a finish reason")  # fmt: skip
    except grpc.aio.AioRpcError as e:
        code = e.code()
        # UNKNOWN is what gRPC says when a handler raised: no one chose that status.
        kind: Kind = "unclean_error" if code == grpc.StatusCode.UNKNOWN else "clean_error"
        _set_error(out, kind, f"grpc_{code.name}", e.details() or "")
    except asyncio.CancelledError:
        call.cancel()
        raise


def _saw_token(out: Outcome, started: float) -> None:
    if not out.saw_token:
        out.saw_token = True
        out.ttft_s = time.monotonic() - started


def _set_error(out: Outcome, kind: Kind, error: str, detail: str) -> None:
    out.kind, out.error, out.detail = kind, error, detail[:300]


# ---- load and faults ----------------------------------------------------------------------------
async def run_load(jobs: list[Job], cluster: LocalCluster, args: argparse.Namespace,
                   chaos: Chaos) -> dict[int, Outcome]:  # fmt: skip
    assert cluster.router is not None
    urls = {"http": cluster.router.http_url}
    pending = iter(jobs)
    outcomes: dict[int, Outcome] = {}
    half_done = asyncio.Event()

    async def client_stream(http: httpx.AsyncClient, stub) -> None:
        for job in pending:  # one shared iterator: each job is sent once
            outcome = outcomes[job.index] = await send(job, http, stub, urls,
                                                       args.request_timeout_s)  # fmt: skip
            if len(outcomes) >= len(jobs) // 2:
                half_done.set()
            if len(outcomes) % 20 == 0:
                kinds = dict(Counter(o.kind for o in outcomes.values()))
                print(f"  {len(outcomes)}/{len(jobs)} requests ended: {kinds}", flush=True)
            if outcome.kind == "clean_error":
                # As a real client would: pause before the next request, rather than burn
                # the workload in a burst of instant 503s. Each error still counts.
                await asyncio.sleep(min(outcome.retry_after_s or CLIENT_PAUSE_S, 5.0))

    limits = httpx.Limits(max_connections=args.concurrency + 2)
    timeout = httpx.Timeout(args.request_timeout_s + 30, connect=30)
    async with (
        httpx.AsyncClient(timeout=timeout, limits=limits) as http,
        grpc.aio.insecure_channel(cluster.router.grpc_address) as channel,
    ):
        stub = generation_pb2_grpc.GenerationStub(channel)
        faults = asyncio.ensure_future(inject_faults(cluster, args, chaos, half_done))
        try:
            await asyncio.gather(*(client_stream(http, stub) for _ in range(args.concurrency)))
        finally:
            await _cancel(faults)
    return outcomes


async def inject_faults(cluster: LocalCluster, args: argparse.Namespace, chaos: Chaos,
                        half_done: asyncio.Event) -> None:  # fmt: skip
    rng = random.Random(args.seed + 1)
    workers = [f"prefill-{i}" for i in range(args.prefill)] + [
        f"decode-{i}" for i in range(args.decode)
    ]

    async def kill_workers() -> None:
        while args.kill_every_s > 0:
            await asyncio.sleep(args.kill_every_s)
            for name in rng.sample(workers, len(workers)):  # a live one, at random
                pid = cluster.signal_child(name, signal.SIGKILL)
                if pid is not None:
                    chaos.worker_kills.append(name)
                    print(f"  [chaos] kill -9 {name} (pid {pid})", flush=True)
                    break

    async def restart_redis() -> None:
        await half_done.wait()
        pid = cluster.signal_child("redis", signal.SIGKILL)
        if pid is not None:
            chaos.redis_kills += 1
            print(f"  [chaos] kill -9 redis (pid {pid})", flush=True)

    tasks = [kill_workers()] + ([] if args.no_redis_restart else [restart_redis()])
    await asyncio.gather(*tasks)


# ---- after the load -----------------------------------------------------------------------------
def kv_blocks_when_idle(cluster: LocalCluster, args: argparse.Namespace) -> dict[str, Any]:
    """Waits until every worker is up, registered and idle, then until its KV blocks are all
    free (or the bound passes); each worker's blocks and quarantine as its /metrics says."""
    registry = Registry(cluster.redis_url)
    wanted = args.prefill + args.decode
    deadline = time.monotonic() + args.idle_timeout_s
    blocks: dict[str, dict[str, float]] = {}
    while True:
        infos = _registered(registry)
        idle = len(infos) == wanted and all(
            i.load.running_requests == 0 and i.load.waiting_requests == 0 for i in infos
        )
        if idle:
            blocks = {i.worker_id: _kv_metrics(i) for i in infos}
            if all(b["used"] == 0 for b in blocks.values()):
                break
        if time.monotonic() > deadline:
            print(f"  not idle with every block free after {args.idle_timeout_s:.0f} s: "
                  f"{len(infos)}/{wanted} workers registered", flush=True)  # fmt: skip
            blocks = blocks or {i.worker_id: _kv_metrics(i) for i in infos}
            break
        time.sleep(1.0)
    infos = _registered(registry)
    return {"workers": blocks, "wanted": wanted,
            "kv_backends": sorted({i.kv_backend for i in infos})}  # fmt: skip


def _registered(registry: Registry) -> list[WorkerInfo]:
    try:
        return registry.workers("prefill") + registry.workers("decode")
    except Exception:  # Redis still coming back
        return []


def _kv_metrics(info: WorkerInfo) -> dict[str, float]:
    try:
        text = urllib.request.urlopen(info.metrics_url, timeout=5).read().decode()
    except OSError:
        return {"free": -1, "used": -1, "quarantined": -1}
    values = {}
    for name in ("free", "used", "quarantined"):
        match = re.search(rf"^pdserve_kv_blocks_{name} (\S+)$", text, re.MULTILINE)
        values[name] = float(match.group(1)) if match else -1  # -1: unknown, as when unreachable
    return values


def compare(jobs: list[Job], outcomes: dict[int, Outcome],
            refs: dict[int, Reference]) -> tuple[int, list[dict]]:  # fmt: skip
    """Completed greedy requests vs the engine: (number compared, mismatches)."""
    compared, mismatches = 0, []
    for job in jobs:
        out, ref = outcomes[job.index], refs.get(job.index)
        if ref is None or out.kind != "completed":
            continue
        compared += 1
        if job.api == "grpc":
            same = out.token_ids == ref.token_ids and out.finish_reason == ref.finish_reason
        else:
            same = (out.text == ref.text and out.finish_reason == ref.finish_reason
                    and out.num_completion_tokens == len(ref.token_ids))  # fmt: skip
        if not same:
            mismatches.append({
                "request": job.index, "api": job.api, "prompt_tokens": len(job.prompt_token_ids),
                "got": {"tokens": out.token_ids, "text": out.text[:120],
                        "finish_reason": out.finish_reason, "n": out.num_completion_tokens},
                "want": {"tokens": ref.token_ids, "text": ref.text[:120],
                         "finish_reason": ref.finish_reason, "n": len(ref.token_ids)},
            })  # fmt: skip
    return compared, mismatches


def summarize(jobs: list[Job], outcomes: dict[int, Outcome], refs: dict[int, Reference],
              kv: dict[str, Any], chaos: Chaos, cluster: LocalCluster,
              duration_s: float) -> dict[str, Any]:  # fmt: skip
    kinds = Counter(o.kind for o in outcomes.values())
    errors = Counter(o.error for o in outcomes.values() if o.error)
    examples: dict[str, str] = {}
    for o in outcomes.values():
        if o.error and o.error not in examples:
            examples[o.error] = o.detail
    compared, mismatches = compare(jobs, outcomes, refs)
    disconnected = [o for o in outcomes.values() if o.kind == "disconnected"]
    used = [b["used"] for b in kv["workers"].values()]
    done = [o for o in outcomes.values() if o.kind == "completed"]
    ttfts = [o.ttft_s for o in done if o.ttft_s is not None]
    e2es = [o.e2e_s for o in done if o.e2e_s is not None]
    return {
        "completed": kinds["completed"],
        "clean_errors": kinds["clean_error"],
        "unclean_errors": kinds["unclean_error"],
        "hung": kinds["hung"],
        # A worker that could not be read, or that never came back, counts as unknown, not 0.
        "leaked_blocks": int(sum(u for u in used if u > 0)),
        "kv_unreadable_workers": sum(u < 0 for u in used) + kv["wanted"] - len(used),
        "quarantined_blocks": int(sum(max(0, b["quarantined"]) for b in kv["workers"].values())),
        "token_mismatches": len(mismatches),
        "greedy_compared": compared,
        "requests": len(outcomes),
        "disconnects": len(disconnected),
        "disconnects_before_first_token": sum(not o.saw_token for o in disconnected),
        "worker_kills": len(chaos.worker_kills),
        "worker_kills_by_role": dict(Counter(n.split("-")[0] for n in chaos.worker_kills)),
        "redis_restarts": cluster.redis_restarts.num_restarts,
        "launcher_restarts": {
            c.name: c.restarts.num_restarts for c in cluster.children if c.restarts.num_restarts
        },  # fmt: skip
        "duration_s": round(duration_s, 1),
        "errors": dict(errors),
        "error_examples": examples,
        "mismatch_examples": mismatches[:3],
        "kv_blocks": kv["workers"],
        "kv_backends": kv["kv_backends"],
        "ttft_p50_s": _round(percentile(ttfts, 50)),
        "ttft_p99_s": _round(percentile(ttfts, 99)),
        "e2e_p50_s": _round(percentile(e2es, 50)),
        "e2e_p99_s": _round(percentile(e2es, 99)),
    }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def main() -> None:
    args = parse_args()
    tokenizer = TextTokenizer.load(resolve_model("smollm2-135m"))
    jobs = workload(args, word_ids(tokenizer))
    started = time.monotonic()
    refs = references(jobs, args.ref_threads, args.quantization)  # before the workers start
    print(f"{len(refs)} engine references in {time.monotonic() - started:.0f} s", flush=True)
    spec = ClusterSpec(
        num_prefill=args.prefill, num_decode=args.decode, kv_backend=args.kv_backend,
        num_cores=args.cores, warmup=False, http_port=0, grpc_port=0,
        router_args=("--log-level", "warning"), worker_args=("--quantization", args.quantization),
    )  # fmt: skip
    cluster = LocalCluster(spec).start()
    cluster.watch(lambda line: print(f"  [launcher] {line.splitlines()[0]}", flush=True))
    chaos = Chaos()
    try:
        load_started = time.monotonic()
        outcomes = asyncio.run(run_load(jobs, cluster, args, chaos))
        duration_s = time.monotonic() - load_started
        kv = kv_blocks_when_idle(cluster, args)
        summary = summarize(jobs, outcomes, refs, kv, chaos, cluster, duration_s)
    finally:
        cluster.stop()
    print(f"({time.monotonic() - started:.0f} s in all; cluster logs in {cluster.log_dir})")
    config = vars(args) | {
        "short_tokens": SHORT_TOKENS, "long_tokens": LONG_TOKENS, "long_fraction": LONG_FRACTION,
    }  # fmt: skip
    print(json.dumps(summary | {"config": config}), flush=True)


if __name__ == "__main__":
    main()
