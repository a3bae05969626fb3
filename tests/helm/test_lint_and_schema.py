"""`helm lint --strict` on the chart, and values.schema.json turning bad values away."""

import pytest

from .chart import ALL_ON_VALUES, CHART, HelmFailed


@pytest.mark.parametrize("values", [None, ALL_ON_VALUES], ids=["default", "all-on"])
def test_lint_strict_passes(helm, values):
    args = ["lint", "--strict", str(CHART)] + (["--values", str(values)] if values else [])
    proc = helm.run(*args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 chart(s) linted, 0 chart(s) failed" in proc.stdout
    assert "[WARNING]" not in proc.stdout and "[ERROR]" not in proc.stdout


BAD_VALUES = {
    "replicas-not-a-number": (
        'prefill:\n  replicas: "two"\n',
        "- at '/prefill/replicas': got string, want integer",
    ),
    "decode-scaled-on-a-prefill-signal": (
        "decode:\n  autoscaling:\n    metric: pdserve_prefill_queued_tokens\n",
        "- at '/decode/autoscaling/metric': value must be one of "
        "'pdserve_kv_cache_usage_ratio', 'pdserve_decode_running_requests'",
    ),
    "misspelt-key": (
        "router:\n  replica: 3\n",
        "- at '/router': additional properties 'replica' not allowed",
    ),
    "unknown-kv-backend": (
        "engine:\n  kvBackend: rdma\n",
        "- at '/engine/kvBackend': value must be one of 'auto', 'nixl', 'tcp'",
    ),
}


@pytest.mark.parametrize("values_yaml, message", BAD_VALUES.values(), ids=BAD_VALUES.keys())
def test_schema_rejects_bad_values(helm, tmp_path, values_yaml, message):
    values_file = tmp_path / "bad-values.yaml"
    values_file.write_text(values_yaml)
    with pytest.raises(HelmFailed) as failed:
        helm.template(values_file)
    stderr = failed.value.stderr
    assert "values don't meet the specifications of the schema(s)" in stderr
    assert message in stderr.splitlines()

    lint = helm.run("lint", "--strict", str(CHART), "--values", str(values_file))
    assert lint.returncode != 0
    assert message.removeprefix("- ") in lint.stdout + lint.stderr


def test_external_redis_needs_an_address(helm, tmp_path):
    values_file = tmp_path / "no-redis.yaml"
    values_file.write_text("redis:\n  enabled: false\n")
    with pytest.raises(HelmFailed) as failed:
        helm.template(values_file)
    assert (
        "redis.enabled=false needs the registry's address: "
        "set redis.external.url or redis.external.existingSecret"
    ) in failed.value.stderr


def test_notes_name_each_pools_autoscaler(helm):
    proc = helm.run("install", "rel", str(CHART), "--namespace", "pdserve", "--dry-run=client")
    assert proc.returncode == 0, proc.stderr
    notes = proc.stdout.split("NOTES:\n", 1)[1].splitlines()
    assert "  kubectl -n pdserve port-forward svc/rel-pdserve-router 8000:8000" in notes
    assert (
        "  prefill: HPA on pdserve_prefill_queued_tokens (target 16384 per pod), 1..8 replicas."
        in notes
    )
    assert (
        "  decode: HPA on pdserve_kv_cache_usage_ratio (target 0.75 per pod), 1..8 replicas."
        in notes
    )
