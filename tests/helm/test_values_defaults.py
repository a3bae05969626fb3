"""values.yaml's defaults against the code's: every setting a pod of the default chart gets (its
ConfigMap, its literal env entries, its `--flag=value` args) either equals the default of the
`pdserve` command it runs, or is listed below as a deliberate chart override, with why. A chart
default can no longer drift from the code's silently."""

from typing import Any

import typer.main

from pdserve import cli

from .chart import component, container, env_by_name, find

# env var (or the env var of the flag the chart passes) -> why the chart sets it apart from
# the code's default. A new difference fails the test until it is made to agree or listed here.
DELIBERATE_OVERRIDES = {
    # engine.chunkSize 1024 (code 512): the GPU chunk of the published prefill-tuning study
    # (+16.7% throughput at 1024; 512-1024 the sweet spot); the code's 512 suits the CPU it runs
    # on here.
    "PDSERVE_CHUNK_SIZE": "engine.chunkSize",
    # engine.drainGraceSeconds 60 (workers 30, router 10): room for long generations on SIGTERM;
    # the ConfigMap gives every role, the router too, this grace, and the pods'
    # terminationGracePeriodSeconds is derived from it.
    "PDSERVE_DRAIN_GRACE_S": "engine.drainGraceSeconds",
    # <pool>.device "" follows <pool>.gpus (1): "cuda", so a GPU pod that sees no GPU fails
    # instead of running on its CPU (code: auto).
    "PDSERVE_DEVICE": "<pool>.device / <pool>.gpus",
    # --host=0.0.0.0 (code 127.0.0.1): peers and Services reach the pod by its IP.
    "PDSERVE_HOST": "templates: --host=0.0.0.0",
    # <pool>.metricsPort 9400 for every pool (decode's code default 9401 only keeps two workers
    # on one machine apart; each pod has its own IP).
    "PDSERVE_METRICS_PORT": "decode.metricsPort, aggregated.metricsPort",
    # aggregated.port 50063 (`decode --aggregated` defaults to decode's 50062): its own Service.
    "PDSERVE_PORT": "aggregated.port",
    # The in-chart Redis Service instead of a local one.
    "REDIS_URL": "redis.enabled",
}
# Set by the chart, read by the code but not a flag: engine/model_files.py's weights cache.
NOT_FLAGS = {"PDSERVE_CACHE"}
WORKLOADS = ("router", "prefill", "decode", "aggregated")


def _command(args: list[str]) -> Any:
    return typer.main.get_command(cli.app).commands[args[0]]


def _pod_settings(docs, name: str) -> tuple[Any, dict[str, str]]:
    """The command a workload's pod runs, and what the chart sets for it: env var -> raw value
    (a `--flag=value` arg under its flag's env var; args win over env, as in click)."""
    workload = find(docs, "Deployment", component(name))
    args = container(workload)["args"]
    command = _command(args)
    settings = dict(find(docs, "ConfigMap", component("config"))["data"])
    # Literal env entries only: valueFrom ones are the pod's identity (IP, name) or Secrets.
    settings |= {k: e["value"] for k, e in env_by_name(workload).items() if "value" in e}
    env_of_flag = {p.opts[0]: p.envvar for p in command.params}
    for arg in args[1:]:
        flag, equals, value = arg.partition("=")
        if equals:  # the bare flags (`decode --aggregated`) choose the role, not a setting
            settings[env_of_flag[flag]] = value
    ours = {k: v for k, v in settings.items() if k.startswith("PDSERVE_") or k == "REDIS_URL"}
    return command, ours


def _typed(raw: str, like: object) -> object:
    """A chart string read as the code's default's type (click's spellings of true)."""
    if isinstance(like, bool):
        return raw.lower() in ("1", "true", "t", "yes", "y", "on")
    return type(like)(raw)


def _differences(docs) -> dict[str, list[str]]:
    """env var -> 'workload: chart value vs code default', for each setting that differs."""
    found: dict[str, list[str]] = {}
    for name in WORKLOADS:
        command, settings = _pod_settings(docs, name)
        for param in command.params:
            if param.envvar in settings:
                value = _typed(settings[param.envvar], param.default)
                if value != param.default:
                    found.setdefault(param.envvar, []).append(
                        f"{name}: chart {value!r}, code {param.default!r}"
                    )
    return found


def test_values_defaults_agree_with_the_code_or_are_deliberate(helm):
    docs = helm.template(set_values=("aggregated.enabled=true",))
    differences = _differences(docs)
    silent = {env: seen for env, seen in differences.items() if env not in DELIBERATE_OVERRIDES}
    assert not silent, (
        "values.yaml disagrees with the code's default; make them agree, or add the env var to "
        f"DELIBERATE_OVERRIDES with why: {silent}"
    )
    assert set(differences) == set(DELIBERATE_OVERRIDES), "a listed override no longer differs"


def test_every_pdserve_env_var_the_chart_sets_is_one_the_code_reads(helm):
    docs = helm.template(set_values=("aggregated.enabled=true",))
    read = {p.envvar for c in ("router", "prefill", "decode") for p in _command([c]).params}
    for name in WORKLOADS:
        _, settings = _pod_settings(docs, name)
        assert set(settings) - read - NOT_FLAGS == set(), name
