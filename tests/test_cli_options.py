"""The worker and router commands as users and the Helm chart see them: each flag reads its
documented env var, a command given no flags builds exactly the settings classes' defaults, and
prefill and decode take the same worker options."""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path

import click
import pytest
import typer.main

from decode_service.settings import DecodeSettings
from engine.config import EngineConfig
from pdserve import cli
from pdserve.lengths import LengthBuckets
from pdserve.worker_settings import WorkerSettings
from router.settings import RouterSettings

README = Path(__file__).resolve().parents[1] / "README.md"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"

# flag -> env var: the names users, README's configuration table and the chart's ConfigMap use.
WORKER_ENV = {
    "--redis-url": "REDIS_URL", "--model": "PDSERVE_MODEL", "--dtype": "PDSERVE_DTYPE",
    "--threads": "PDSERVE_THREADS", "--host": "PDSERVE_HOST", "--port": "PDSERVE_PORT",
    "--advertise-host": "PDSERVE_ADVERTISE_HOST", "--metrics-port": "PDSERVE_METRICS_PORT",
    "--worker-id": "PDSERVE_WORKER_ID", "--kv-backend": "PDSERVE_KV_BACKEND",
    "--chunk-size": "PDSERVE_CHUNK_SIZE", "--num-blocks": "PDSERVE_NUM_BLOCKS",
    "--step-overhead-tokens": "PDSERVE_STEP_OVERHEAD_TOKENS",
    "--drain-grace-s": "PDSERVE_DRAIN_GRACE_S", "--registry-ttl-s": "PDSERVE_REGISTRY_TTL_S",
    "--warmup": None, "--tls-cert-file": "PDSERVE_TLS_CERT_FILE",
    "--tls-key-file": "PDSERVE_TLS_KEY_FILE", "--tls-ca-file": "PDSERVE_TLS_CA_FILE",
    "--max-concurrent-rpcs": "PDSERVE_MAX_CONCURRENT_RPCS",
    "--max-num-seqs": "PDSERVE_MAX_NUM_SEQS", "--device": "PDSERVE_DEVICE",
    "--cuda-graphs": "PDSERVE_CUDA_GRAPHS", "--attention-backend": "PDSERVE_ATTENTION_BACKEND",
    "--quantization": "PDSERVE_QUANTIZATION", "--kv-cache-dtype": "PDSERVE_KV_CACHE_DTYPE",
    "--kv-offload-gb": "PDSERVE_KV_OFFLOAD_GB", "--kv-offload-path": "PDSERVE_KV_OFFLOAD_PATH",
    "--peer-fetch": "PDSERVE_PEER_FETCH", "--log-level": "PDSERVE_LOG_LEVEL",
    "--short-below": "PDSERVE_SHORT_BELOW", "--long-above": "PDSERVE_LONG_ABOVE",
}  # fmt: skip
DECODE_ONLY_ENV = {
    "--prefill-timeout-s": "PDSERVE_PREFILL_TIMEOUT_S",
    "--local-prefill-fallback": "PDSERVE_LOCAL_PREFILL_FALLBACK",
    "--aggregated": "PDSERVE_AGGREGATED",
}
ROUTER_ENV = {
    "--redis-url": "REDIS_URL", "--model": "PDSERVE_MODEL", "--host": "PDSERVE_HOST",
    "--http-port": "PDSERVE_HTTP_PORT", "--grpc-port": "PDSERVE_GRPC_PORT",
    "--api-key": "PDSERVE_API_KEY", "--routing-policy": "PDSERVE_ROUTING_POLICY",
    "--admission": "PDSERVE_ADMISSION", "--prefill-token-budget": "PDSERVE_PREFILL_TOKEN_BUDGET",
    "--prefill-overflow": "PDSERVE_PREFILL_OVERFLOW",
    "--max-queued-requests": "PDSERVE_MAX_QUEUED_REQUESTS", "--ttft-slo-s": "PDSERVE_TTFT_SLO_S",
    "--max-queue-wait-s": "PDSERVE_MAX_QUEUE_WAIT_S",
    "--queue-timeout-s": "PDSERVE_QUEUE_TIMEOUT_S",
    "--short-below": "PDSERVE_SHORT_BELOW", "--long-above": "PDSERVE_LONG_ABOVE",
    "--medium-delay-s": None, "--long-delay-s": None, "--watermark-a": None, "--watermark-b": None,
    "--prefix-prefill-weight": "PDSERVE_PREFIX_PREFILL_WEIGHT",
    "--prefix-decode-weight": "PDSERVE_PREFIX_DECODE_WEIGHT",
    "--default-prefill-tokens-per-s": None, "--max-prompt-tokens": None,
    "--max-body-bytes": None, "--tls-cert-file": "PDSERVE_TLS_CERT_FILE",
    "--tls-key-file": "PDSERVE_TLS_KEY_FILE", "--tls-ca-file": "PDSERVE_TLS_CA_FILE",
    "--worker-ca-file": "PDSERVE_WORKER_TLS_CA_FILE",
    "--worker-cert-file": "PDSERVE_WORKER_TLS_CERT_FILE",
    "--worker-key-file": "PDSERVE_WORKER_TLS_KEY_FILE", "--threads": "PDSERVE_THREADS",
    "--drain-grace-s": "PDSERVE_DRAIN_GRACE_S", "--request-timeout-s": "PDSERVE_REQUEST_TIMEOUT_S",
    "--max-migrations": "PDSERVE_MAX_MIGRATIONS", "--log-level": "PDSERVE_LOG_LEVEL",
}  # fmt: skip
EXPECTED_ENV = {
    "prefill": WORKER_ENV,
    "decode": WORKER_ENV | DECODE_ONLY_ENV,
    "router": ROUTER_ENV,
}
# The only defaults the command line sets apart from the settings classes: WorkerSettings'
# ports are 0 (the OS picks, for tests), the commands' fixed ports are what the chart uses.
FIXED_PORTS = {"prefill": (50061, 9400), "decode": (50062, 9401)}


def command(name: str) -> click.Command:
    return typer.main.get_command(cli.app).commands[name]


def env_of(name: str) -> dict[str, str | None]:
    return {p.opts[0]: p.envvar for p in command(name).params}


def parse(name: str, args: list[str] | None = None) -> dict:
    """The values typer passes the command, parsed from args and the environment."""
    return command(name).make_context(name, args or []).params


@pytest.fixture(autouse=True)
def no_settings_in_env(monkeypatch):
    for envvar in {e for table in EXPECTED_ENV.values() for e in table.values() if e}:
        monkeypatch.delenv(envvar, raising=False)


@pytest.mark.parametrize("name", sorted(EXPECTED_ENV))
def test_each_flag_reads_its_documented_env_var(name):
    assert env_of(name) == EXPECTED_ENV[name]


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_worker_given_no_flags_gets_the_settings_classes_defaults(role):
    options = cli.PREFILL_OPTIONS if role == "prefill" else cli.DECODE_OPTIONS
    port, metrics_port = FIXED_PORTS[role]
    expected = WorkerSettings(
        role=role, worker_id=f"{role}-{socket.gethostname()}-{os.getpid()}",
        redis_url=DEFAULT_REDIS_URL, port=port, metrics_port=metrics_port, engine=EngineConfig(),
    )  # fmt: skip
    assert cli._worker_settings(role, options, parse(role)) == expected


def test_decode_given_no_flags_gets_decode_settings_defaults():
    assert cli._settings_of(DecodeSettings, cli.DECODE_OPTIONS, parse("decode")) == (
        DecodeSettings()
    )


def test_the_router_given_no_flags_gets_the_router_settings_defaults():
    assert cli._router_settings(parse("router")) == RouterSettings(redis_url=DEFAULT_REDIS_URL)


def test_prefill_and_decode_take_the_same_worker_options():
    def described(name: str) -> dict[str, tuple]:
        params = [p for p in command(name).params if p.name not in ("port", "metrics_port")]
        return {p.name: (p.opts, p.secondary_opts, p.envvar, p.help, p.default) for p in params}

    prefill, decode = described("prefill"), described("decode")
    assert set(decode) - set(prefill) == {"prefill_timeout_s", "local_prefill_fallback",
                                          "aggregated"}  # fmt: skip
    assert {name: decode[name] for name in prefill} == prefill


def test_env_vars_and_flags_reach_the_settings(monkeypatch):
    monkeypatch.setenv("PDSERVE_CHUNK_SIZE", "1024")
    monkeypatch.setenv("PDSERVE_PEER_FETCH", "false")
    monkeypatch.setenv("PDSERVE_THREADS", "3")
    settings = cli._worker_settings("decode", cli.DECODE_OPTIONS, parse("decode", ["--port", "7"]))
    assert (settings.engine.chunk_size, settings.peer_fetch, settings.port) == (1024, False, 7)
    assert settings.engine.num_threads == 3


def test_the_step_overhead_flag_s_minus_1_is_the_device_s_default_and_0_turns_it_off():
    def overhead(flags: list[str]) -> int | None:
        settings = cli._worker_settings("prefill", cli.PREFILL_OPTIONS, parse("prefill", flags))
        return settings.engine.step_overhead_tokens

    assert overhead([]) is None  # the scheduler reads the device's: 16 on a CPU, 0 on a GPU
    assert overhead(["--step-overhead-tokens", "0"]) == 0
    assert overhead(["--step-overhead-tokens", "24"]) == 24


def test_one_env_var_sets_the_length_buckets_of_workers_and_router_alike(monkeypatch):
    monkeypatch.setenv("PDSERVE_SHORT_BELOW", "256")
    monkeypatch.setenv("PDSERVE_LONG_ABOVE", "1024")
    expected = LengthBuckets(short_below=256, long_above=1024)
    for role, options in (("prefill", cli.PREFILL_OPTIONS), ("decode", cli.DECODE_OPTIONS)):
        assert cli._worker_settings(role, options, parse(role)).length_buckets == expected
    assert cli._router_settings(parse("router")).admission.buckets == expected
    flag = parse("prefill", ["--short-below", "128"])
    assert cli._worker_settings("prefill", cli.PREFILL_OPTIONS, flag).length_buckets == (
        LengthBuckets(short_below=128, long_above=1024)
    )


def test_readme_configuration_table_names_the_real_env_vars():
    """Every `--flag` / `ENV` pair in README's configuration table is what a command reads."""
    section = README.read_text().split("## Configuration")[1].split("\n## ")[0]
    pairs = re.findall(r"`(--[a-z-]+)(?:/--[a-z-]+)?` / `([A-Z_]+)`", section)
    assert len(pairs) >= 25
    commands = [env_of(name) for name in EXPECTED_ENV]
    for flag, env in pairs:
        assert any(table.get(flag) == env for table in commands), (flag, env)
