"""The FastAPI app: routes, the API-key check, and the one place router errors become HTTP
responses in OpenAI's error shape."""

from __future__ import annotations

import logging
import time
from dataclasses import asdict
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from engine import SamplingParams
from pdserve import grpc_convert
from pdserve.registry import ROLES
from router import metrics
from router.auth import check_bearer
from router.errors import OverloadedError, RouterError, status_of
from router.gateway import Gateway, Job
from router.http_api import chat
from router.http_api.body_limit import BodyLimit
from router.http_api.info import REQUEST_MODELS, check_model, info_routes, pdserve_version
from router.http_api.openai_format import Kind, Logprobs, Responder, error_body, error_json
from router.http_api.openapi import declare_request_bodies
from router.http_api.request_id import RequestId, check_request_id
from router.http_api.schemas import ChatBody, CompletionBody, GenerationBody, parse_body
from router.http_api.streaming import ClientGone, sse_events, until_disconnect
from router.ledger import Ledger
from router.workers import WorkerView

log = logging.getLogger(__name__)

# On every admitted completion: the TTFT admission predicted for it at arrival, in seconds.
PREDICTED_TTFT_HEADER = "x-pdserve-predicted-ttft-s"


def error_response(error: RouterError) -> JSONResponse:
    status = status_of(error)
    headers = (
        {"Retry-After": error.retry_after_header} if isinstance(error, OverloadedError) else {}
    )
    return JSONResponse(error_json(error, status), status.http, headers)


def create_app(gateway: Gateway) -> FastAPI:
    settings = gateway.settings
    # /openapi.json and /docs (Swagger UI) are FastAPI's own; no ReDoc.
    app = FastAPI(title="pdserve router", version=pdserve_version(), redoc_url=None)
    declare_request_bodies(app, REQUEST_MODELS | {
        "/v1/completions": (CompletionBody,), "/v1/chat/completions": (ChatBody,),
    })  # fmt: skip
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes, reject=error_response)
    app.add_middleware(RequestId, reject=error_response)  # outermost: errors carry it too

    @app.exception_handler(RouterError)
    async def on_router_error(request: Request, error: RouterError) -> Response:
        metrics.REQUESTS.labels(request.url.path, str(status_of(error).http)).inc()
        return error_response(error)

    @app.exception_handler(HTTPException)
    async def on_http_error(request: Request, error: HTTPException) -> Response:
        # Starlette's own errors (unknown path, wrong method) keep their status.
        message = f"{request.method} {request.url.path}: {error.detail}"
        return JSONResponse(error_body(message, "invalid_request_error"), error.status_code)

    @app.exception_handler(ClientGone)
    async def on_client_gone(request: Request, error: ClientGone) -> Response:
        metrics.REQUESTS.labels(request.url.path, "499").inc()
        return Response(status_code=499)  # nobody reads it; nginx's "client closed request"

    async def authorized(request: Request) -> None:
        check_bearer(request.headers.get("authorization", ""), settings.api_key)

    guarded = [Depends(authorized)]

    @app.get("/health")
    async def health() -> Response:
        counts = {role: len(gateway.pool.infos(role)) for role in ROLES}
        ready = gateway.pool.serving()
        body = {"status": "ok" if ready else "no workers", "workers": counts}
        return JSONResponse(body, 200 if ready else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    app.include_router(info_routes(gateway, guarded))

    @app.get("/admin/workers", dependencies=guarded)
    async def workers() -> dict[str, Any]:
        admission = gateway.admission
        queue = {b: admission.queue.depth(b) for b in admission.queue.delays_s}
        pool = gateway.pool
        prefixes = admission.prefixes
        workers = [
            _worker_json(view, pool.ledgers["decode" if role == "aggregated" else role])
            | ({"prefix_cache": prefixes.worker_json(view.worker_id)} if prefixes else {})
            for role in ROLES
            for view in pool.views(role)
        ]
        body = {"workers": workers, "queue": queue}
        return body | ({"recent_choices": prefixes.recent_json()} if prefixes else {})

    @app.post("/v1/completions", dependencies=guarded)
    async def completions(request: Request) -> Response:
        received_s = time.monotonic()
        body = parse_body(await request.body(), CompletionBody)
        _check(request, body, settings.model)
        prompt = body.single_prompt()
        if isinstance(prompt, str):
            add_special = body.add_special_tokens is not False  # vLLM's default: True
            ids = await gateway.tokenize(prompt, add_special_tokens=add_special)
        else:
            ids = prompt
        fields = body.sampling_fields()
        job = gateway.job(body.truncate(ids), lambda room: SamplingParams(**fields), received_s)
        echo = ""
        if body.echo:  # the prompt as the model saw it
            echo = gateway.tokenizer.decode(job.prompt_token_ids, skip_special_tokens=False)
        return await _respond(request, gateway, job, body, "completion", echo)

    @app.post("/v1/chat/completions", dependencies=guarded)
    async def chat_completions(request: Request) -> Response:
        received_s = time.monotonic()
        body = parse_body(await request.body(), ChatBody)
        _check(request, body, settings.model)
        template = gateway.chat_template()
        options = chat.template_options(body, template)
        text = await gateway.render_chat(template, chat.template_messages(body), **options)
        # vLLM's default for chat: False, the template writes its own special tokens.
        ids = await gateway.tokenize(text, "messages", body.add_special_tokens is True)
        ids = body.truncate(ids)
        fields = body.sampling_fields()

        def params(room: int) -> SamplingParams:
            # Chat without max_tokens may use the rest of the context, as OpenAI's API does.
            return SamplingParams(**({"max_tokens": room} | fields))

        job = gateway.job(ids, params, received_s, "messages")
        return await _respond(request, gateway, job, body, "chat", chat.echo_prefix(body))

    return app


def _check(request: Request, body: GenerationBody, model: str) -> None:
    check_model(body.model, model)
    if body.request_id is not None and not request.state.request_id_given:
        request.state.request_id = check_request_id(body.request_id, "request_id")


async def _respond(
    request: Request, gateway: Gateway, job: Job, body: GenerationBody, kind: Kind,
    echo: str = "",
) -> Response:  # fmt: skip
    """echo: text the client gets in front of the completion's own."""
    client_id = request.state.request_id
    log.info("%s %s is request %s %s", request.url.path, client_id, job.ticket.request_id,
             body.who() or "")  # fmt: skip
    run = await until_disconnect(request, gateway.open(job))
    logprobs: tuple[Logprobs, ...] = ()
    if job.params.logprobs is not None:
        logprobs = tuple(
            Logprobs(kind, gateway.token_text, text_offset=len(echo)) for _ in range(job.params.n)
        )
    responder = Responder(kind, client_id, gateway.settings.model, logprobs)
    assert run.predicted_ttft_s is not None  # open() returns an admitted run
    headers = {PREDICTED_TTFT_HEADER: f"{run.predicted_ttft_s:.3f}"}
    if body.stream:  # from here on the status is 200; a later error goes in-band
        metrics.REQUESTS.labels(request.url.path, "200").inc()
        events = sse_events(run, responder, body.include_usage, body.continuous_usage, echo)
        return StreamingResponse(events, media_type="text/event-stream",
                                 headers=headers | {"Cache-Control": "no-cache"})  # fmt: skip
    try:
        whole = await until_disconnect(request, run.gather())
    finally:
        run.close()
    metrics.REQUESTS.labels(request.url.path, "200").inc()
    choices = [
        responder.choice(
            sample.index,
            echo + sample.text,
            sample.finish_reason,
            grpc_convert.stop_reason_of(sample),
            logprobs[sample.index].json(sample.logprobs) if logprobs else None,
        )
        for sample in whole.samples
    ]
    return JSONResponse(responder.response(choices, whole.usage), headers=headers)


def _worker_json(view: WorkerView, ledger: Ledger) -> dict[str, Any]:
    info, here, routed = view.info, ledger.share(view.worker_id), ledger.routed(view.worker_id)
    return {
        "role": info.role,
        "worker_id": info.worker_id,
        "address": info.address,
        "metrics_url": info.metrics_url,
        "kv_backend": info.kv_backend,
        "max_model_len": info.max_model_len,
        "heartbeat_age_s": round(max(0.0, time.time() - info.updated_at), 3),
        "reported_load": asdict(info.load),
        # In flight from this router: prompt tokens (prefill) or KV blocks (decode), requests.
        "assigned_here": {"amount": here.amount, "requests": here.count},
        # In flight from the other router replicas, as last heard (router/replicas.py).
        "assigned_by_replicas": {
            "amount": routed.amount - here.amount,
            "requests": routed.count - here.count,
        },
        "effective_load": {  # the heartbeat plus the routers' assignments since
            "queued_tokens": view.queued_tokens,
            "queued_requests": view.queued_requests,
            "free_blocks": view.free_blocks,
            "running_requests": view.running_requests,
            "tokens_per_s": view.tokens_per_s,
        },
    }
