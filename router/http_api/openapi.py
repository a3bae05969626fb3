"""The OpenAPI schema FastAPI serves at /openapi.json (and /docs), with the real request
models: the handlers parse their own bodies (to answer in OpenAI's error shape), so the
models are declared here, their definitions in components."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

REF_TEMPLATE = "#/components/schemas/{model}"


def declare_request_bodies(app: FastAPI, bodies: Mapping[str, tuple[type[BaseModel], ...]]) -> None:
    """bodies: POST path -> the models its JSON body may be (any of them)."""
    generate = app.openapi
    done = False

    def openapi() -> dict[str, Any]:
        nonlocal done
        schema = generate()  # FastAPI builds it once and caches it on the app
        if not done:
            _add_bodies(schema, bodies)
            done = True
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def _add_bodies(schema: dict[str, Any], bodies: Mapping[str, tuple[type[BaseModel], ...]]) -> None:
    models = {model for choices in bodies.values() for model in choices}
    refs, definitions = models_json_schema(
        [(model, "validation") for model in models], ref_template=REF_TEMPLATE
    )
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components.update(definitions.get("$defs", {}))
    for path, choices in bodies.items():
        options = [refs[(model, "validation")] for model in choices]
        body_schema = options[0] if len(options) == 1 else {"anyOf": options}
        schema["paths"][path]["post"]["requestBody"] = {
            "required": True, "content": {"application/json": {"schema": body_schema}},
        }  # fmt: skip
