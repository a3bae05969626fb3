"""The `pdserve` command: one entry point for every role (flags, or PDSERVE_* / REDIS_URL)."""

from __future__ import annotations

import logging
import os
import socket
from typing import Annotated

import typer

app = typer.Typer(help="Prefill/decode disaggregated LLM serving.", no_args_is_help=True)


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


# Options every worker takes; envvar names match the Helm chart's ConfigMap.
RedisUrl = Annotated[str, typer.Option(envvar="REDIS_URL", help="Worker registry.")]
Model = Annotated[str, typer.Option(envvar="PDSERVE_MODEL", help="Model name, .gguf or HF dir.")]
DType = Annotated[
    str,
    typer.Option(
        envvar="PDSERVE_DTYPE",
        help="auto (bf16 on CUDA, fp32 on CPU) | float32 | bfloat16 | float16.",
    ),
]
Threads = Annotated[int, typer.Option(envvar="PDSERVE_THREADS", help="Torch threads; 0 = all.")]
Host = Annotated[str, typer.Option(envvar="PDSERVE_HOST", help="Bind address.")]
Advertise = Annotated[
    str, typer.Option(envvar="PDSERVE_ADVERTISE_HOST", help="Address peers use; default: host.")
]
WorkerId = Annotated[str, typer.Option(envvar="PDSERVE_WORKER_ID", help="Default: hostname-pid.")]
KVBackend = Annotated[str, typer.Option(envvar="PDSERVE_KV_BACKEND", help="auto | nixl | tcp.")]
ChunkSize = Annotated[int, typer.Option(envvar="PDSERVE_CHUNK_SIZE", help="Prefill chunk.")]
NumBlocks = Annotated[int, typer.Option(envvar="PDSERVE_NUM_BLOCKS", help="KV cache blocks.")]
Grace = Annotated[float, typer.Option(envvar="PDSERVE_DRAIN_GRACE_S", help="Drain on SIGTERM.")]
TTL = Annotated[float, typer.Option(envvar="PDSERVE_REGISTRY_TTL_S", help="Registry key TTL.")]
LogLevel = Annotated[str, typer.Option(envvar="PDSERVE_LOG_LEVEL")]
MaxSeqs = Annotated[
    int, typer.Option(envvar="PDSERVE_MAX_NUM_SEQS", help="Requests in the batch at once.")
]
MaxRpcs = Annotated[
    int,
    typer.Option(
        envvar="PDSERVE_MAX_CONCURRENT_RPCS",
        help="Requests in flight at once; past it: RESOURCE_EXHAUSTED at once.",
    ),
]


def _check_device(value: str) -> str:
    """A device that does not exist here fails at parse time, naming the devices there are."""
    from engine.config import resolve_device
    from engine.errors import InvalidRequestError

    try:
        resolve_device(value)
    except InvalidRequestError as e:
        raise typer.BadParameter(str(e)) from e
    return value


Device = Annotated[
    str,
    typer.Option(
        envvar="PDSERVE_DEVICE", callback=_check_device,
        help="auto (CUDA when torch sees a GPU) | cpu | cuda | cuda:N.",
    ),
]  # fmt: skip
CudaGraphs = Annotated[
    bool,
    typer.Option(envvar="PDSERVE_CUDA_GRAPHS", help="Replay decode steps as CUDA graphs (CUDA)."),
]
Attention = Annotated[
    str,
    typer.Option(envvar="PDSERVE_ATTENTION_BACKEND", help="auto | flashinfer | flash_attn | sdpa."),
]
Quantization = Annotated[
    str,
    typer.Option(
        envvar="PDSERVE_QUANTIZATION",
        help="none | int8 | int4 (weight-only int8 / group-wise int4 linears; int4 CPU-only).",
    ),
]
KVCacheDtype = Annotated[
    str,
    typer.Option(
        envvar="PDSERVE_KV_CACHE_DTYPE",
        help="auto (the model's dtype) | int8 (per-token scales; prefill and decode must agree).",
    ),
]
PeerFetch = Annotated[
    bool,
    typer.Option(
        envvar="PDSERVE_PEER_FETCH",
        help="Prefix reuse across workers: decode lets prefill read the prompt prefix it holds; "
        "prefill reads it instead of computing it when the transfer is faster.",
    ),
]
TlsCert = Annotated[str, typer.Option(envvar="PDSERVE_TLS_CERT_FILE", help="PEM; empty = no TLS.")]
TlsKey = Annotated[str, typer.Option(envvar="PDSERVE_TLS_KEY_FILE", help="PEM private key.")]
TlsCa = Annotated[
    str, typer.Option(envvar="PDSERVE_TLS_CA_FILE", help="PEM CA: peers must present certs.")
]


def _worker_settings(role, *, redis_url, model, dtype, threads, host, port, advertise_host,
                     metrics_port, worker_id, kv_backend, chunk_size, num_blocks, drain_grace_s,
                     registry_ttl_s, warmup, tls_cert_file, tls_key_file, tls_ca_file,
                     max_concurrent_rpcs, max_num_seqs, device, cuda_graphs,
                     attention_backend, quantization="none", kv_cache_dtype="auto",
                     peer_fetch):  # fmt: skip
    from engine import EngineConfig
    from pdserve.tls import TLSFiles
    from pdserve.worker_runtime import WorkerSettings

    return WorkerSettings(
        role=role,
        worker_id=worker_id or f"{role}-{socket.gethostname()}-{os.getpid()}",
        redis_url=redis_url,
        host=host,
        port=port,
        advertise_host=advertise_host or None,
        metrics_port=metrics_port,
        kv_backend=kv_backend,
        registry_ttl_s=registry_ttl_s,
        drain_grace_s=drain_grace_s,
        max_concurrent_rpcs=max_concurrent_rpcs,
        warmup=warmup,
        peer_fetch=peer_fetch,
        tls=TLSFiles(tls_cert_file or None, tls_key_file or None, tls_ca_file or None),
        engine=EngineConfig(
            model=model, dtype=dtype, chunk_size=chunk_size, num_blocks=num_blocks,
            num_threads=threads or None, max_num_seqs=max_num_seqs, device=device,
            cuda_graphs=cuda_graphs, attention_backend=attention_backend,
            quantization=quantization, kv_cache_dtype=kv_cache_dtype,
        ),
    )  # fmt: skip


@app.command()
def prefill(
    redis_url: RedisUrl = "redis://127.0.0.1:6379/0",
    model: Model = "smollm2-135m",
    dtype: DType = "auto",
    threads: Threads = 0,
    host: Host = "127.0.0.1",
    port: Annotated[int, typer.Option(envvar="PDSERVE_PORT", help="gRPC; 0 = any.")] = 50061,
    advertise_host: Advertise = "",
    metrics_port: Annotated[int, typer.Option(envvar="PDSERVE_METRICS_PORT")] = 9400,
    worker_id: WorkerId = "",
    kv_backend: KVBackend = "auto",
    chunk_size: ChunkSize = 512,
    num_blocks: NumBlocks = 1024,
    drain_grace_s: Grace = 30.0,
    registry_ttl_s: TTL = 6.0,
    warmup: Annotated[bool, typer.Option(help="Warm each length bucket first.")] = True,
    tls_cert_file: TlsCert = "",
    tls_key_file: TlsKey = "",
    tls_ca_file: TlsCa = "",
    max_concurrent_rpcs: MaxRpcs = 128,
    max_num_seqs: MaxSeqs = 64,
    device: Device = "auto",
    cuda_graphs: CudaGraphs = True,
    attention_backend: Attention = "auto",
    quantization: Quantization = "none",
    kv_cache_dtype: KVCacheDtype = "auto",
    peer_fetch: PeerFetch = True,
    log_level: LogLevel = "info",
) -> None:
    """Run a prefill worker."""
    from prefill_service.server import start

    _setup_logging(log_level)
    settings = _worker_settings(
        "prefill",
        redis_url=redis_url, model=model, dtype=dtype, threads=threads, host=host, port=port,
        advertise_host=advertise_host, metrics_port=metrics_port, worker_id=worker_id,
        kv_backend=kv_backend, chunk_size=chunk_size, num_blocks=num_blocks,
        drain_grace_s=drain_grace_s, registry_ttl_s=registry_ttl_s, warmup=warmup,
        tls_cert_file=tls_cert_file, tls_key_file=tls_key_file, tls_ca_file=tls_ca_file,
        max_concurrent_rpcs=max_concurrent_rpcs, max_num_seqs=max_num_seqs, device=device,
        cuda_graphs=cuda_graphs, attention_backend=attention_backend, quantization=quantization,
        kv_cache_dtype=kv_cache_dtype, peer_fetch=peer_fetch,
    )  # fmt: skip
    raise typer.Exit(start(settings).serve_forever())


@app.command()
def decode(
    redis_url: RedisUrl = "redis://127.0.0.1:6379/0",
    model: Model = "smollm2-135m",
    dtype: DType = "auto",
    threads: Threads = 0,
    host: Host = "127.0.0.1",
    port: Annotated[int, typer.Option(envvar="PDSERVE_PORT", help="gRPC; 0 = any.")] = 50062,
    advertise_host: Advertise = "",
    metrics_port: Annotated[int, typer.Option(envvar="PDSERVE_METRICS_PORT")] = 9401,
    worker_id: WorkerId = "",
    kv_backend: KVBackend = "auto",
    chunk_size: ChunkSize = 512,
    num_blocks: NumBlocks = 1024,
    drain_grace_s: Grace = 30.0,
    registry_ttl_s: TTL = 6.0,
    warmup: Annotated[bool, typer.Option(help="Warm each length bucket first.")] = True,
    tls_cert_file: TlsCert = "",
    tls_key_file: TlsKey = "",
    tls_ca_file: TlsCa = "",
    max_concurrent_rpcs: MaxRpcs = 128,
    max_num_seqs: MaxSeqs = 64,
    device: Device = "auto",
    cuda_graphs: CudaGraphs = True,
    attention_backend: Attention = "auto",
    quantization: Quantization = "none",
    kv_cache_dtype: KVCacheDtype = "auto",
    peer_fetch: PeerFetch = True,
    prefill_timeout_s: Annotated[float, typer.Option(envvar="PDSERVE_PREFILL_TIMEOUT_S")] = 60.0,
    local_prefill_fallback: Annotated[
        bool, typer.Option(envvar="PDSERVE_LOCAL_PREFILL_FALLBACK")
    ] = False,
    aggregated: Annotated[
        bool,
        typer.Option(
            envvar="PDSERVE_AGGREGATED",
            help="Prefill every request here, chunked into the decode batch (no prefill pool).",
        ),
    ] = False,
    log_level: LogLevel = "info",
) -> None:
    """Run a decode worker (--aggregated: one that also prefills, taking whole requests)."""
    from decode_service.server import start
    from decode_service.service import DecodeSettings

    _setup_logging(log_level)
    decode_settings = DecodeSettings(
        prefill_timeout_s=prefill_timeout_s, local_prefill_fallback=local_prefill_fallback,
        aggregated=aggregated,
    )  # fmt: skip
    settings = _worker_settings(
        "aggregated" if aggregated else "decode",
        redis_url=redis_url, model=model, dtype=dtype, threads=threads, host=host, port=port,
        advertise_host=advertise_host, metrics_port=metrics_port, worker_id=worker_id,
        kv_backend=kv_backend, chunk_size=chunk_size, num_blocks=num_blocks,
        drain_grace_s=drain_grace_s, registry_ttl_s=registry_ttl_s, warmup=warmup,
        tls_cert_file=tls_cert_file, tls_key_file=tls_key_file, tls_ca_file=tls_ca_file,
        max_concurrent_rpcs=max_concurrent_rpcs, max_num_seqs=max_num_seqs, device=device,
        cuda_graphs=cuda_graphs, attention_backend=attention_backend, quantization=quantization,
        kv_cache_dtype=kv_cache_dtype, peer_fetch=peer_fetch,
    )  # fmt: skip
    raise typer.Exit(start(settings, decode_settings).serve_forever())


@app.command()
def generate(
    prompt: str,
    model: Model = "smollm2-135m",
    max_tokens: int = 64,
    temperature: float = 0.0,
    chat: Annotated[bool, typer.Option(help="Wrap the prompt in the chat template.")] = True,
) -> None:
    """Generate once with the engine in this process (no servers)."""
    from engine import LLM, SamplingParams

    llm = LLM(model=model)
    text = (
        llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}]) if chat else prompt
    )
    out = llm.generate([text], SamplingParams(max_tokens=max_tokens, temperature=temperature))[0]
    typer.echo(out.text)


# The router's defaults live in its settings classes; the options below only expose them.
def _router_defaults():
    from router.settings import AdmissionSettings, RouterSettings

    return RouterSettings(redis_url=""), AdmissionSettings()


_R, _A = _router_defaults()
Policy = Annotated[
    str, typer.Option(envvar="PDSERVE_ROUTING_POLICY", help="watermark | round_robin | hash.")
]
Admission = Annotated[str, typer.Option(envvar="PDSERVE_ADMISSION", help="length_aware | fifo.")]


@app.command()
def router(
    redis_url: RedisUrl = "redis://127.0.0.1:6379/0",
    model: Model = _R.model,
    host: Host = _R.host,
    http_port: Annotated[int, typer.Option(envvar="PDSERVE_HTTP_PORT", help="0 = any.")] = 8000,
    grpc_port: Annotated[int, typer.Option(envvar="PDSERVE_GRPC_PORT", help="0 = any.")] = 50051,
    api_key: Annotated[
        str, typer.Option(envvar="PDSERVE_API_KEY", help="Bearer key clients must send.")
    ] = "",
    routing_policy: Policy = _R.routing.policy,
    admission: Admission = _A.mode,
    prefill_token_budget: Annotated[
        int, typer.Option(envvar="PDSERVE_PREFILL_TOKEN_BUDGET", help="Per prefill worker.")
    ] = _A.prefill_token_budget,
    max_queued_requests: Annotated[
        int, typer.Option(envvar="PDSERVE_MAX_QUEUED_REQUESTS")
    ] = _A.max_queued_requests,
    ttft_slo_s: Annotated[
        float,
        typer.Option(
            envvar="PDSERVE_TTFT_SLO_S",
            help="Predicted TTFT above this: 429. 0 = 30 s, or none when only "
            "--max-queue-wait-s is set.",
        ),
    ] = 0.0,
    max_queue_wait_s: Annotated[
        float,
        typer.Option(envvar="PDSERVE_MAX_QUEUE_WAIT_S", help="Estimated; 429 above. 0 = off."),
    ] = 0.0,
    queue_timeout_s: Annotated[
        float, typer.Option(envvar="PDSERVE_QUEUE_TIMEOUT_S")
    ] = _A.queue_timeout_s,
    short_below: Annotated[
        int, typer.Option(envvar="PDSERVE_SHORT_BELOW", help="Short: fewer prompt tokens.")
    ] = _A.buckets.short_below,
    long_above: Annotated[
        int, typer.Option(envvar="PDSERVE_LONG_ABOVE", help="Long: more prompt tokens.")
    ] = _A.buckets.long_above,
    medium_delay_s: Annotated[float, typer.Option(help="Aging delay.")] = _A.medium_delay_s,
    long_delay_s: Annotated[float, typer.Option(help="Aging delay.")] = _A.long_delay_s,
    watermark_a: float = _R.routing.watermark_a,
    watermark_b: float = _R.routing.watermark_b,
    prefix_prefill_weight: Annotated[
        float,
        typer.Option(
            envvar="PDSERVE_PREFIX_PREFILL_WEIGHT",
            help="Watermark policy: weight of the prefill seconds a worker's prefix cache "
            "saves (0 = load only).",
        ),
    ] = _R.routing.prefix_prefill_weight,
    prefix_decode_weight: Annotated[
        float,
        typer.Option(
            envvar="PDSERVE_PREFIX_DECODE_WEIGHT",
            help="Watermark policy: weight of the prompt KV fraction a decode worker holds "
            "(0 = load only).",
        ),
    ] = _R.routing.prefix_decode_weight,
    default_prefill_tokens_per_s: Annotated[
        float, typer.Option(help="For workers that have not measured yet.")
    ] = _A.default_prefill_tokens_per_s,
    max_prompt_tokens: Annotated[int, typer.Option(help="0 = the context minus one.")] = 0,
    max_body_bytes: int = _R.max_body_bytes,
    tls_cert_file: TlsCert = "",
    tls_key_file: TlsKey = "",
    tls_ca_file: TlsCa = "",
    worker_ca_file: Annotated[str, typer.Option(envvar="PDSERVE_WORKER_TLS_CA_FILE")] = "",
    worker_cert_file: Annotated[str, typer.Option(envvar="PDSERVE_WORKER_TLS_CERT_FILE")] = "",
    worker_key_file: Annotated[str, typer.Option(envvar="PDSERVE_WORKER_TLS_KEY_FILE")] = "",
    threads: Threads = 0,
    drain_grace_s: Grace = _R.drain_grace_s,
    request_timeout_s: Annotated[
        float, typer.Option(envvar="PDSERVE_REQUEST_TIMEOUT_S", help="Deadline per request.")
    ] = _R.request_timeout_s,
    max_migrations: Annotated[
        int, typer.Option(envvar="PDSERVE_MAX_MIGRATIONS", help="Moves to another decode worker.")
    ] = _R.max_migrations,
    log_level: LogLevel = "info",
) -> None:
    """Run the router: OpenAI-compatible HTTP and public gRPC in front of the worker pools."""
    import asyncio

    from pdserve.lengths import LengthBuckets
    from pdserve.tls import TLSFiles
    from router.server import serve
    from router.settings import AdmissionSettings, RouterSettings, RoutingSettings

    _setup_logging(log_level)
    settings = RouterSettings(
        redis_url=redis_url, model=model, host=host, http_port=http_port, grpc_port=grpc_port,
        api_key=api_key or None, max_body_bytes=max_body_bytes,
        max_prompt_tokens=max_prompt_tokens or None, drain_grace_s=drain_grace_s,
        num_threads=threads or None, request_timeout_s=request_timeout_s,
        max_migrations=max_migrations,
        tls=TLSFiles(tls_cert_file or None, tls_key_file or None, tls_ca_file or None),
        worker_tls=TLSFiles(worker_cert_file or None, worker_key_file or None,
                            worker_ca_file or None),
        admission=AdmissionSettings(
            mode=admission, buckets=LengthBuckets(short_below, long_above),
            medium_delay_s=medium_delay_s, long_delay_s=long_delay_s,
            prefill_token_budget=prefill_token_budget, max_queued_requests=max_queued_requests,
            ttft_slo_s=ttft_slo_s or None, max_queue_wait_s=max_queue_wait_s or None,
            queue_timeout_s=queue_timeout_s,
            default_prefill_tokens_per_s=default_prefill_tokens_per_s,
        ),
        routing=RoutingSettings(
            routing_policy, watermark_a, watermark_b, prefix_prefill_weight, prefix_decode_weight
        ),
    )  # fmt: skip
    asyncio.run(serve(settings))


def _restart_defaults():
    from pdserve.launcher import RestartPolicy

    return RestartPolicy()


_RESTART = _restart_defaults()


@app.command()
def up(
    num_prefill: Annotated[int, typer.Option("--prefill", help="Prefill workers.")] = 1,
    num_decode: Annotated[int, typer.Option("--decode", help="Decode workers.")] = 1,
    num_aggregated: Annotated[
        int, typer.Option("--aggregated", help="Aggregated workers (prefill + decode in one).")
    ] = 0,
    model: Model = "smollm2-135m",
    dtype: DType = "auto",
    kv_backend: KVBackend = "auto",
    host: Host = "127.0.0.1",
    http_port: Annotated[int, typer.Option(help="Router HTTP; 0 = any.")] = 8000,
    grpc_port: Annotated[int, typer.Option(help="Router gRPC; 0 = any.")] = 50051,
    cores: Annotated[int, typer.Option(help="Cores to divide among workers; 0 = all.")] = 0,
    warmup: Annotated[bool, typer.Option(help="Workers warm each length bucket.")] = True,
    routing_policy: Policy = _R.routing.policy,
    admission: Admission = _A.mode,
    log_dir: Annotated[str, typer.Option(help="Child logs; default: a new temp dir.")] = "",
    restart_backoff_s: Annotated[
        float, typer.Option(envvar="PDSERVE_RESTART_BACKOFF_S", help="First restart delay.")
    ] = _RESTART.backoff_s,
    max_restart_backoff_s: Annotated[
        float,
        typer.Option(envvar="PDSERVE_MAX_RESTART_BACKOFF_S", help="Cap of a crash loop's delay."),
    ] = _RESTART.max_backoff_s,
) -> None:
    """Run a whole local cluster: Redis, the workers and the router (PDSERVE_API_KEY, when
    set, protects the router). A process that dies is restarted with backoff; Ctrl-C or
    SIGTERM stops it all."""
    from pathlib import Path

    from pdserve.launcher import ClusterSpec, LocalCluster, RestartPolicy, run_until_signalled

    restart = RestartPolicy(restart_backoff_s, max_restart_backoff_s, _RESTART.stable_after_s)
    spec = ClusterSpec(
        num_prefill=num_prefill, num_decode=num_decode, num_aggregated=num_aggregated,
        model=model, dtype=dtype,
        kv_backend=kv_backend, host=host, http_port=http_port, grpc_port=grpc_port,
        num_cores=cores, warmup=warmup, log_dir=Path(log_dir) if log_dir else None,
        router_args=("--routing-policy", routing_policy, "--admission", admission),
        restart=restart,
    )  # fmt: skip
    raise typer.Exit(run_until_signalled(LocalCluster(spec), typer.echo))


from sim.cli import app as sim_app  # noqa: E402 (light: each study imports its own modules)

app.add_typer(sim_app, name="sim", help="Cluster simulator (docs/simulator.md).")


if __name__ == "__main__":
    app()
