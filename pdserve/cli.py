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
DType = Annotated[str, typer.Option(envvar="PDSERVE_DTYPE", help="float32 | bfloat16 | float16.")]
Threads = Annotated[int, typer.Option(envvar="PDSERVE_THREADS", help="Torch threads; 0 = all.")]
Host = Annotated[str, typer.Option(help="Bind address.")]
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


def _worker_settings(role, *, redis_url, model, dtype, threads, host, port, advertise_host,
                     metrics_port, worker_id, kv_backend, chunk_size, num_blocks, drain_grace_s,
                     registry_ttl_s, warmup):  # fmt: skip
    from engine import EngineConfig
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
        warmup=warmup,
        engine=EngineConfig(
            model=model, dtype=dtype, chunk_size=chunk_size, num_blocks=num_blocks,
            num_threads=threads or None,
        ),
    )  # fmt: skip


@app.command()
def prefill(
    redis_url: RedisUrl = "redis://127.0.0.1:6379/0",
    model: Model = "smollm2-135m",
    dtype: DType = "float32",
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
    )  # fmt: skip
    start(settings).serve_forever()


@app.command()
def decode(
    redis_url: RedisUrl = "redis://127.0.0.1:6379/0",
    model: Model = "smollm2-135m",
    dtype: DType = "float32",
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
    prefill_timeout_s: Annotated[float, typer.Option(envvar="PDSERVE_PREFILL_TIMEOUT_S")] = 60.0,
    local_prefill_fallback: Annotated[
        bool, typer.Option(envvar="PDSERVE_LOCAL_PREFILL_FALLBACK")
    ] = False,
    log_level: LogLevel = "info",
) -> None:
    """Run a decode worker."""
    from decode_service.server import start
    from decode_service.service import DecodeSettings

    _setup_logging(log_level)
    decode_settings = DecodeSettings(
        prefill_timeout_s=prefill_timeout_s, local_prefill_fallback=local_prefill_fallback
    )
    settings = _worker_settings(
        "decode",
        redis_url=redis_url, model=model, dtype=dtype, threads=threads, host=host, port=port,
        advertise_host=advertise_host, metrics_port=metrics_port, worker_id=worker_id,
        kv_backend=kv_backend, chunk_size=chunk_size, num_blocks=num_blocks,
        drain_grace_s=drain_grace_s, registry_ttl_s=registry_ttl_s, warmup=warmup,
    )  # fmt: skip
    start(settings, decode_settings).serve_forever()


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


if __name__ == "__main__":
    app()
