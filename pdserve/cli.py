"""The `pdserve` command: one entry point for every role (flags, or PDSERVE_* / REDIS_URL)."""

from __future__ import annotations

import inspect
import logging
import os
import socket
from collections.abc import Callable, Sequence
from dataclasses import MISSING, dataclass, fields, replace
from typing import Annotated, Any

import typer

# Torch-free modules: the router command must not load torch (tests/router/test_router_torch_free).
from decode_service.settings import DecodeSettings
from engine.config import EngineConfig
from pdserve.launcher import RestartPolicy
from pdserve.lengths import LengthBuckets
from pdserve.tls import TLSFiles
from pdserve.worker_settings import WorkerSettings
from router.settings import AdmissionSettings, RouterSettings, RoutingSettings

# Before any command loads torch (a worker's --device check does, as it parses): OpenMP's
# default team, that of every thread but an engine's stepping thread (whose size --threads sets,
# engine/model_runner.py), is one thread. Otherwise a worker's main thread, which builds the
# engine, and its RPC and KV-transfer threads that touch tensors would each start a team as
# large as the machine, and with more OpenMP threads than cores every team's barriers sleep
# instead of spinning: a 2-thread decode step took 1.4x as long. A user's own value is kept.
os.environ.setdefault("OMP_NUM_THREADS", "1")

app = typer.Typer(help="Prefill/decode disaggregated LLM serving.", no_args_is_help=True)

Scalar = bool | int | float | str


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


def _field_default(cls: type, name: str) -> Scalar:
    """A settings field's default, read without building the class (EngineConfig's
    __post_init__ resolves the device, which loads torch)."""
    (found,) = [f for f in fields(cls) if f.name == name]
    assert found.default is not MISSING, f"{cls.__name__}.{name} has no default"
    return found.default


@dataclass(frozen=True, slots=True)
class Option:
    """One setting on the command line, declared once: `--name` (dashes for underscores), its
    env var and help. An option `of` a settings class sets that class's field `name` and takes
    its default from it. `own_default` is the command line's own: where no class field has
    the name, where the command line spells the field's None as 0 or "", or (the workers'
    fixed ports) where it deliberately differs."""

    name: str
    env: str | None
    help: str | None
    of: type | None = None
    own_default: Scalar | None = None
    callback: Callable[[str], str] | None = None

    @property
    def default(self) -> Scalar:
        if self.own_default is not None:
            return self.own_default
        assert self.of is not None, f"--{self.name} needs a default"
        return _field_default(self.of, self.name)

    def typer_option(self) -> Any:
        return typer.Option(envvar=self.env, help=self.help, callback=self.callback)

    def parameter(self) -> inspect.Parameter:
        # The flag's type is its default's: every default here is a bool, int, float or str.
        return inspect.Parameter(
            self.name, inspect.Parameter.KEYWORD_ONLY, default=self.default,
            annotation=Annotated[type(self.default), self.typer_option()],
        )  # fmt: skip


def _takes(options: Sequence[Option]) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Gives a command `def f(**values)` one keyword parameter per option: typer builds a
    command's flags from its function's signature, so this one is built from the table."""

    def with_signature(command: Callable[..., None]) -> Callable[..., None]:
        command.__signature__ = inspect.Signature([o.parameter() for o in options])  # type: ignore[attr-defined]
        return command

    return with_signature


def _settings_of(cls: type, options: Sequence[Option], values: dict[str, Any], **rest: Any) -> Any:
    """cls from the values of the options that set its fields (`of=cls`), plus `rest`."""
    return cls(**{o.name: values[o.name] for o in options if o.of is cls}, **rest)


def _none_for_minus_1(value: int) -> int | None:
    """The command line spells EngineConfig's None (the device's default) as -1; any other
    negative value reaches EngineConfig, which refuses it."""
    return None if value == -1 else value


def _tls(cert_file: str, key_file: str, ca_file: str) -> TLSFiles:
    return TLSFiles(cert_file or None, key_file or None, ca_file or None)  # "": no file


def _check_device(value: str) -> str:
    """A device that does not exist here fails at parse time, naming the devices there are."""
    from engine.config import resolve_device
    from engine.errors import InvalidRequestError

    try:
        resolve_device(value)
    except InvalidRequestError as e:
        raise typer.BadParameter(str(e)) from e
    return value


# ---- the options, each declared once; env var names match the Helm chart's ConfigMap --------
REDIS_URL = Option(
    "redis_url", "REDIS_URL", "Worker registry.", own_default="redis://127.0.0.1:6379/0"
)
MODEL = Option("model", "PDSERVE_MODEL", "Model name, .gguf or HF dir.", EngineConfig)
DTYPE = Option(
    "dtype", "PDSERVE_DTYPE", "auto (bf16 on CUDA, fp32 on CPU) | float32 | bfloat16 | float16.",
    EngineConfig,
)  # fmt: skip
THREADS = Option("threads", "PDSERVE_THREADS", "Torch threads; 0 = all.", own_default=0)
HOST = Option("host", "PDSERVE_HOST", "Bind address.", WorkerSettings)
KV_BACKEND = Option("kv_backend", "PDSERVE_KV_BACKEND", "auto | nixl | tcp.", WorkerSettings)
DRAIN_GRACE = Option("drain_grace_s", "PDSERVE_DRAIN_GRACE_S", "Drain on SIGTERM.", WorkerSettings)
WARMUP = Option("warmup", None, "Warm each length bucket first.", WorkerSettings)
TLS = (
    Option("tls_cert_file", "PDSERVE_TLS_CERT_FILE", "PEM; empty = no TLS.", own_default=""),
    Option("tls_key_file", "PDSERVE_TLS_KEY_FILE", "PEM private key.", own_default=""),
    Option(
        "tls_ca_file", "PDSERVE_TLS_CA_FILE", "PEM CA: peers must present certs.", own_default=""
    ),
)
LOG_LEVEL = Option("log_level", "PDSERVE_LOG_LEVEL", None, own_default="info")
# The router queues and routes by these buckets, the workers label their metrics and warm up by
# them: one setting each, so that one env var sets both sides alike.
LENGTH_BUCKETS = (
    Option("short_below", "PDSERVE_SHORT_BELOW", "Short: fewer prompt tokens.", LengthBuckets),
    Option("long_above", "PDSERVE_LONG_ABOVE", "Long: more prompt tokens.", LengthBuckets),
)
ROUTING_POLICY = Option(
    "routing_policy", "PDSERVE_ROUTING_POLICY", "watermark | round_robin | hash.",
    own_default=_field_default(RoutingSettings, "policy"),
)  # fmt: skip
ADMISSION = Option(
    "admission", "PDSERVE_ADMISSION", "length_aware | fifo | pass_through.",
    own_default=_field_default(AdmissionSettings, "mode"),
)  # fmt: skip
PREFILL_OVERFLOW = Option(
    "prefill_overflow", "PDSERVE_PREFILL_OVERFLOW",
    "Every prefill worker at its budget: queue (wait for one) | decode (a decode worker with "
    "room computes the prompt itself).", AdmissionSettings,
)  # fmt: skip


def _worker_options(port: int, metrics_port: int) -> tuple[Option, ...]:
    """What prefill and decode workers share; they differ in their fixed default ports only
    (WorkerSettings' 0 lets the OS pick, for tests; users and the chart rely on these)."""
    return (
        REDIS_URL, MODEL, DTYPE, THREADS, HOST,
        Option("port", "PDSERVE_PORT", "gRPC; 0 = any.", WorkerSettings, own_default=port),
        Option("advertise_host", "PDSERVE_ADVERTISE_HOST", "Address peers use; default: host.",
               own_default=""),
        Option("metrics_port", "PDSERVE_METRICS_PORT", None, WorkerSettings,
               own_default=metrics_port),
        Option("worker_id", "PDSERVE_WORKER_ID", "Default: hostname-pid.", own_default=""),
        KV_BACKEND,
        Option("chunk_size", "PDSERVE_CHUNK_SIZE", "Prefill chunk.", EngineConfig),
        Option("step_overhead_tokens", "PDSERVE_STEP_OVERHEAD_TOKENS",
               "A step's fixed cost in prompt tokens' compute, to split a burst of prompts over "
               "steps by; 0 = never split; -1 = the device's (16 on a CPU, 0 on a GPU).",
               own_default=-1),
        Option("num_blocks", "PDSERVE_NUM_BLOCKS", "KV cache blocks.", EngineConfig),
        DRAIN_GRACE,
        Option("registry_ttl_s", "PDSERVE_REGISTRY_TTL_S", "Registry key TTL.", WorkerSettings),
        WARMUP, *TLS,
        Option("max_concurrent_rpcs", "PDSERVE_MAX_CONCURRENT_RPCS",
               "Requests in flight at once; past it: RESOURCE_EXHAUSTED at once.", WorkerSettings),
        Option("max_num_seqs", "PDSERVE_MAX_NUM_SEQS", "Requests in the batch at once.",
               EngineConfig),
        Option("device", "PDSERVE_DEVICE",
               "auto (CUDA when torch sees a GPU) | cpu | cuda | cuda:N.", EngineConfig,
               callback=_check_device),
        Option("cuda_graphs", "PDSERVE_CUDA_GRAPHS", "Replay decode steps as CUDA graphs (CUDA).",
               EngineConfig),
        Option("attention_backend", "PDSERVE_ATTENTION_BACKEND",
               "auto | cpu_paged | flashinfer | flash_attn | sdpa.", EngineConfig),
        Option("quantization", "PDSERVE_QUANTIZATION",
               "auto (int4 for a Q4_1 GGUF on the CPU, else none) | none (the weights in dtype: "
               "fp32 on the CPU) | int8 | int4 (weight-only int8 / group-wise int4; CPU-only).",
               EngineConfig),
        Option("kv_cache_dtype", "PDSERVE_KV_CACHE_DTYPE",
               "auto (the model's dtype) | int8 (per-token scales; prefill and decode must agree).",
               EngineConfig),
        Option("kv_offload_gb", "PDSERVE_KV_OFFLOAD_GB",
               "Host KV tier in GiB: prefix blocks the pool evicts are kept there and loaded "
               "back on a hit; 0 = off.", EngineConfig),
        Option("kv_offload_path", "PDSERVE_KV_OFFLOAD_PATH",
               "A local directory for the host tier's file; empty = host memory.",
               own_default=""),
        Option("peer_fetch", "PDSERVE_PEER_FETCH",
               "Prefix reuse across workers: decode lets prefill read the prompt prefix it holds; "
               "prefill reads it instead of computing it when the transfer is faster.",
               WorkerSettings),
        *LENGTH_BUCKETS,
    )  # fmt: skip


PREFILL_OPTIONS = (*_worker_options(port=50061, metrics_port=9400), LOG_LEVEL)
DECODE_OPTIONS = (
    *_worker_options(port=50062, metrics_port=9401),
    Option("prefill_timeout_s", "PDSERVE_PREFILL_TIMEOUT_S",
           "The whole prefill phase (every attempt and the KV landing).", DecodeSettings),
    Option("local_prefill_fallback", "PDSERVE_LOCAL_PREFILL_FALLBACK",
           "Prefill here when no prefill worker succeeds.", DecodeSettings),
    Option("aggregated", "PDSERVE_AGGREGATED",
           "Prefill every request here, chunked into the decode batch (no prefill pool).",
           DecodeSettings),
    LOG_LEVEL,
)  # fmt: skip


def _worker_settings(
    role: str, options: Sequence[Option], values: dict[str, Any]
) -> WorkerSettings:
    engine = _settings_of(
        EngineConfig, options, values, num_threads=values["threads"] or None,
        kv_offload_path=values["kv_offload_path"] or None,
        step_overhead_tokens=_none_for_minus_1(values["step_overhead_tokens"]),
    )  # fmt: skip
    return _settings_of(
        WorkerSettings, options, values, role=role, redis_url=values["redis_url"],
        worker_id=values["worker_id"] or f"{role}-{socket.gethostname()}-{os.getpid()}",
        advertise_host=values["advertise_host"] or None, engine=engine,
        tls=_tls(values["tls_cert_file"], values["tls_key_file"], values["tls_ca_file"]),
        length_buckets=_settings_of(LengthBuckets, options, values),
    )  # fmt: skip


@app.command()
@_takes(PREFILL_OPTIONS)
def prefill(**values: Any) -> None:
    """Run a prefill worker."""
    from prefill_service.server import start

    _setup_logging(values["log_level"])
    settings = _worker_settings("prefill", PREFILL_OPTIONS, values)
    raise typer.Exit(start(settings).serve_forever())


@app.command()
@_takes(DECODE_OPTIONS)
def decode(**values: Any) -> None:
    """Run a decode worker (--aggregated: one that also prefills, taking whole requests)."""
    from decode_service.server import start

    _setup_logging(values["log_level"])
    decode_settings = _settings_of(DecodeSettings, DECODE_OPTIONS, values)
    role = "aggregated" if decode_settings.aggregated else "decode"
    settings = _worker_settings(role, DECODE_OPTIONS, values)
    raise typer.Exit(start(settings, decode_settings).serve_forever())


@app.command()
def generate(
    prompt: str,
    model: Annotated[str, MODEL.typer_option()] = MODEL.default,
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


ROUTER_OPTIONS = (
    REDIS_URL, replace(MODEL, of=RouterSettings), replace(HOST, of=RouterSettings),
    Option("http_port", "PDSERVE_HTTP_PORT", "0 = any.", RouterSettings),
    Option("grpc_port", "PDSERVE_GRPC_PORT", "0 = any.", RouterSettings),
    Option("api_key", "PDSERVE_API_KEY", "Bearer key clients must send.", own_default=""),
    ROUTING_POLICY, ADMISSION,
    Option("prefill_token_budget", "PDSERVE_PREFILL_TOKEN_BUDGET", "Per prefill worker.",
           AdmissionSettings),
    PREFILL_OVERFLOW,
    Option("max_queued_requests", "PDSERVE_MAX_QUEUED_REQUESTS", None, AdmissionSettings),
    Option("ttft_slo_s", "PDSERVE_TTFT_SLO_S",
           "Predicted TTFT (corrected by what requests saw, to their 99th percentile) above "
           "this: 429. 0 = no objective: requests queue.", own_default=0.0),
    Option("max_queue_wait_s", "PDSERVE_MAX_QUEUE_WAIT_S", "Estimated; 429 above. 0 = off.",
           own_default=0.0),
    Option("queue_timeout_s", "PDSERVE_QUEUE_TIMEOUT_S", None, AdmissionSettings),
    *LENGTH_BUCKETS,
    Option("medium_delay_s", None, "Aging delay.", AdmissionSettings),
    Option("long_delay_s", None, "Aging delay.", AdmissionSettings),
    Option("watermark_a", None, None, RoutingSettings),
    Option("watermark_b", None, None, RoutingSettings),
    Option("prefix_prefill_weight", "PDSERVE_PREFIX_PREFILL_WEIGHT",
           "Watermark policy: weight of the prefill seconds a worker's prefix cache saves "
           "(0 = load only).", RoutingSettings),
    Option("prefix_decode_weight", "PDSERVE_PREFIX_DECODE_WEIGHT",
           "Watermark policy: weight of the prompt KV fraction a decode worker holds "
           "(0 = load only).", RoutingSettings),
    Option("default_prefill_tokens_per_s", None, "Until a worker of the role has measured.",
           AdmissionSettings),
    Option("max_prompt_tokens", None, "0 = the context minus one.", own_default=0),
    Option("max_body_bytes", None, None, RouterSettings),
    *TLS,
    Option("worker_ca_file", "PDSERVE_WORKER_TLS_CA_FILE", None, own_default=""),
    Option("worker_cert_file", "PDSERVE_WORKER_TLS_CERT_FILE", None, own_default=""),
    Option("worker_key_file", "PDSERVE_WORKER_TLS_KEY_FILE", None, own_default=""),
    THREADS, replace(DRAIN_GRACE, of=RouterSettings),
    Option("request_timeout_s", "PDSERVE_REQUEST_TIMEOUT_S", "Deadline per request.",
           RouterSettings),
    Option("max_migrations", "PDSERVE_MAX_MIGRATIONS", "Moves to another decode worker.",
           RouterSettings),
    LOG_LEVEL,
)  # fmt: skip


def _router_settings(values: dict[str, Any]) -> RouterSettings:
    v, options = values, ROUTER_OPTIONS
    admission = _settings_of(
        AdmissionSettings, options, v, mode=v["admission"],
        buckets=_settings_of(LengthBuckets, options, v),
        ttft_slo_s=v["ttft_slo_s"] or None, max_queue_wait_s=v["max_queue_wait_s"] or None,
    )  # fmt: skip
    return _settings_of(
        RouterSettings, options, v, redis_url=v["redis_url"], api_key=v["api_key"] or None,
        max_prompt_tokens=v["max_prompt_tokens"] or None, num_threads=v["threads"] or None,
        tls=_tls(v["tls_cert_file"], v["tls_key_file"], v["tls_ca_file"]),
        worker_tls=_tls(v["worker_cert_file"], v["worker_key_file"], v["worker_ca_file"]),
        admission=admission,
        routing=_settings_of(RoutingSettings, options, v, policy=v["routing_policy"]),
    )  # fmt: skip


@app.command()
@_takes(ROUTER_OPTIONS)
def router(**values: Any) -> None:
    """Run the router: OpenAI-compatible HTTP and public gRPC in front of the worker pools."""
    import asyncio

    from router.server import serve

    _setup_logging(values["log_level"])
    asyncio.run(serve(_router_settings(values)))


UP_OPTIONS = (
    Option("prefill", None, "Prefill workers.", own_default=1),
    Option("decode", None, "Decode workers.", own_default=1),
    Option("aggregated", None, "Aggregated workers (prefill + decode in one).", own_default=0),
    Option("routers", None, "Router replicas (ports in turn from the given ones).",
           own_default=1),
    MODEL, DTYPE, KV_BACKEND, HOST,
    Option("http_port", None, "Router HTTP; 0 = any.", RouterSettings),
    Option("grpc_port", None, "Router gRPC; 0 = any.", RouterSettings),
    Option("cores", None, "Cores to divide among workers; 0 = all.", own_default=0),
    replace(WARMUP, help="Workers warm each length bucket."),
    ROUTING_POLICY, ADMISSION,
    # One machine's workers share its cores: a decode worker's core is the one free to
    # compute prompts when the prefill workers' are full (docs/router.md, Prefill overflow).
    replace(PREFILL_OVERFLOW, own_default="decode"),
    Option("log_dir", None, "Child logs; default: a new temp dir.", own_default=""),
    Option("restart_backoff_s", "PDSERVE_RESTART_BACKOFF_S", "First restart delay.",
           own_default=_field_default(RestartPolicy, "backoff_s")),
    Option("max_restart_backoff_s", "PDSERVE_MAX_RESTART_BACKOFF_S",
           "Cap of a crash loop's delay.",
           own_default=_field_default(RestartPolicy, "max_backoff_s")),
    Option("planner", None, "Size the prefill and decode pools from TTFT/ITL targets "
           "(PDSERVE_PLANNER_*).", own_default=False),
)  # fmt: skip


@app.command()
@_takes(UP_OPTIONS)
def up(**values: Any) -> None:
    """Run a whole local cluster: Redis, the workers and the router (PDSERVE_API_KEY, when
    set, protects the router). A process that dies is restarted with backoff; Ctrl-C or
    SIGTERM stops it all."""
    from pathlib import Path

    from pdserve.launcher import ClusterShapeError, ClusterSpec, LocalCluster, run_until_signalled

    v = values
    restart = RestartPolicy(
        backoff_s=v["restart_backoff_s"], max_backoff_s=v["max_restart_backoff_s"]
    )
    try:
        spec = ClusterSpec(
            num_prefill=v["prefill"], num_decode=v["decode"], num_aggregated=v["aggregated"],
            num_routers=v["routers"], model=v["model"], dtype=v["dtype"],
            kv_backend=v["kv_backend"], host=v["host"],
            http_port=v["http_port"], grpc_port=v["grpc_port"], num_cores=v["cores"],
            warmup=v["warmup"], log_dir=Path(v["log_dir"]) if v["log_dir"] else None,
            router_args=("--routing-policy", v["routing_policy"], "--admission", v["admission"],
                         "--prefill-overflow", v["prefill_overflow"]),  # fmt: skip
            restart=restart,
        )  # fmt: skip
        after_start = _local_planner() if v["planner"] else None
    except (ClusterShapeError, ValueError) as e:  # a usage error: click's exit code for those
        typer.echo(f"pdserve up: {e}", err=True)
        raise typer.Exit(2) from e
    raise typer.Exit(run_until_signalled(LocalCluster(spec), typer.echo, after_start))


# `pdserve up --planner`'s own defaults, where no PDSERVE_PLANNER_* variable sets them: a few
# workers on one machine, decided every 20 s, so a load change shows within a minute.
LOCAL_PLANNER_DEFAULTS = {"gpu_budget": max(3, os.cpu_count() or 1), "interval_s": 20.0,
                          "scale_down_cooldown_s": 60.0}  # fmt: skip


def local_planner_settings() -> Any:
    """`up --planner`'s PlannerSettings: PDSERVE_PLANNER_* variables, else the local defaults
    (a ValueError names a bad one)."""
    from planner.settings import PlannerSettings

    defaults = {name: value for name, value in LOCAL_PLANNER_DEFAULTS.items()
                if f"PDSERVE_PLANNER_{name.upper()}" not in os.environ}  # fmt: skip
    return PlannerSettings(**defaults)


def _local_planner() -> Callable[[Any], Any]:
    """The planner for `up --planner`, checked before anything starts: its settings and the
    workers' profile, from this machine's fitted step costs (sim/local_cpu.json). Returns what
    starts it on the cluster."""
    from planner import local
    from sim.costs import LocalCoefficients, LocalCost
    from sim.planner_study import profile_of

    settings = local_planner_settings()
    profile = profile_of(LocalCost(LocalCoefficients.load()), EngineConfig().chunk_size)
    return lambda cluster: local.start(cluster, settings, profile)


@app.command()
def planner(log_level: Annotated[str, typer.Option(help="Log level.")] = "info") -> None:
    """Run the SLA planner on a Kubernetes cluster: it sets the prefill and decode
    Deployments' replicas from TTFT and ITL targets (PDSERVE_PLANNER_*, docs/planner.md)."""
    from pydantic import ValidationError

    from planner.service import PlannerConfigError, build
    from planner.settings import PlannerSettings

    _setup_logging(log_level)
    try:
        loop = build(PlannerSettings())
    except (ValidationError, PlannerConfigError) as e:  # a usage error, as up's
        typer.echo(f"pdserve planner: {e}", err=True)
        raise typer.Exit(2) from e
    loop.run_forever()


from sim.cli import app as sim_app  # noqa: E402 (light: each study imports its own modules)

app.add_typer(sim_app, name="sim", help="Cluster simulator (docs/simulator.md).")


if __name__ == "__main__":
    app()
