"""Schema-validates a stream of Kubernetes manifests; run by .venv-tools/bin/python, not pytest.

usage: python kube_validate.py VERSION [VERSION ...] < manifests.yaml
prints a JSON list: {"version", "apiVersion", "kind", "name", "error"} per document and version.

Built-in kinds go through kubernetes-validate's Python API in strict mode: unknown fields fail,
and so does an apiVersion that version does not serve (SchemaNotFoundError is an error here, not
the CLI's warning). CRD kinds have no built-in schema: each one this chart renders has a strict
schema in crd_schemas/ that reuses the Kubernetes definitions of the same version (ObjectMeta,
LabelSelector, HPA behavior). A CRD kind without such a schema is an error too.
"""

import json
import sys
from pathlib import Path

import jsonschema
import yaml
from kubernetes_validate import utils
from referencing import Registry, Resource

CRD_SCHEMAS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor-monitoring-v1.json",
    ("keda.sh/v1alpha1", "ScaledObject"): "scaledobject-keda-v1alpha1.json",
}
CRD_SCHEMA_DIR = Path(__file__).parent / "crd_schemas"


def _k8s_definitions(version: str) -> dict:
    # The same schema directory that utils.validate picks for this version (strict variant).
    resolved = [v for v in utils.all_versions() if utils.major_minor(v) <= version][-1]
    path = f"kubernetes-json-schema/v{resolved}-local-strict/_definitions.json"
    return utils.schema_contents(path, version)


def _validate_crd(doc: dict, schema_file: str, version: str) -> None:
    schema = json.loads((CRD_SCHEMA_DIR / schema_file).read_text())
    registry = Resource.from_contents(_k8s_definitions(version)) @ Registry()
    jsonschema.Draft202012Validator(schema, registry=registry).validate(doc)


def validate(doc: dict, version: str) -> str | None:
    """The error text for one document at one version, or None when it is valid."""
    crd_schema = CRD_SCHEMAS.get((doc.get("apiVersion"), doc.get("kind")))
    try:
        if crd_schema:
            _validate_crd(doc, crd_schema, version)
        else:
            utils.validate(doc, version, strict=True)
    except jsonschema.ValidationError as e:
        where = "/".join(str(p) for p in e.absolute_path) or "(root)"
        return f"{where}: {e.message}"
    except (utils.SchemaNotFoundError, utils.VersionNotSupportedError) as e:
        return e.message
    return None


def main(versions: list[str]) -> None:
    docs = [d for d in yaml.safe_load_all(sys.stdin) if d]
    results = [
        {
            "version": version,
            "apiVersion": doc.get("apiVersion"),
            "kind": doc.get("kind"),
            "name": (doc.get("metadata") or {}).get("name"),
            "error": validate(doc, version),
        }
        for version in versions
        for doc in docs
    ]
    json.dump(results, sys.stdout, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
