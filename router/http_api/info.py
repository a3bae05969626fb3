"""The endpoints beside generation, in vLLM's shapes: /tokenize, /detokenize, /version, and
the model list and card with the served context length."""

from __future__ import annotations

from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from fastapi import APIRouter, Request
from fastapi.params import Depends

from router.errors import InvalidRequestError, NotFoundError, UnavailableError
from router.gateway import Gateway
from router.http_api import chat
from router.http_api.schemas import (
    DetokenizeBody,
    TokenizeChatBody,
    TokenizeCompletionBody,
    parse_body,
    parse_tokenize,
)


def info_routes(gateway: Gateway, guarded: Sequence[Depends]) -> APIRouter:
    routes = APIRouter()
    model = gateway.settings.model

    @routes.get("/version")
    async def version_info() -> dict[str, str]:
        return {"version": pdserve_version()}

    @routes.get("/v1/models", dependencies=guarded)
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [_card(gateway)]}

    @routes.get("/v1/models/{model_id:path}", dependencies=guarded)
    async def model_card(model_id: str) -> dict[str, Any]:
        check_model(model_id, model)
        return _card(gateway)

    @routes.post("/tokenize", dependencies=guarded)
    async def tokenize(request: Request) -> dict[str, Any]:
        body = parse_tokenize(await request.body())
        check_model(body.model, model)
        if isinstance(body, TokenizeChatBody):
            template = gateway.chat_template()
            options = chat.template_options(body, template)
            text = await gateway.render_chat(template, chat.template_messages(body), **options)
            ids = await gateway.tokenize(text, "messages", body.add_special_tokens)
        else:
            ids = await gateway.tokenize(body.prompt, "prompt", body.add_special_tokens)
        response: dict[str, Any] = {"count": len(ids), "max_model_len": gateway.max_model_len(),
                                    "tokens": ids}  # fmt: skip
        if body.return_token_strs:
            response["token_strs"] = [gateway.tokenizer.hf.id_to_token(i) for i in ids]
        return response

    @routes.post("/detokenize", dependencies=guarded)
    async def detokenize(request: Request) -> dict[str, str]:
        body = parse_body(await request.body(), DetokenizeBody)
        check_model(body.model, model)
        vocab_size = gateway.tokenizer.vocab_size
        for i, token_id in enumerate(body.tokens):
            if token_id >= vocab_size:
                raise InvalidRequestError(f"tokens.{i}: {token_id} is not a token id (the "
                                          f"vocabulary has {vocab_size})",
                                          param=f"tokens.{i}")  # fmt: skip
        return {"prompt": gateway.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    return routes


# The request models behind each path, for the OpenAPI schema (the handlers parse their own
# bodies, to answer in OpenAI's error shape).
REQUEST_MODELS = {
    "/tokenize": (TokenizeCompletionBody, TokenizeChatBody),
    "/detokenize": (DetokenizeBody,),
}


def pdserve_version() -> str:
    try:
        return version("pdserve")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


def _card(gateway: Gateway) -> dict[str, Any]:
    try:
        max_model_len: int | None = gateway.max_model_len()
    except UnavailableError:  # no worker registered yet: the context is not known
        max_model_len = None
    return {"id": gateway.settings.model, "object": "model", "created": 0, "owned_by": "pdserve",
            "root": gateway.settings.model, "max_model_len": max_model_len}  # fmt: skip


def check_model(requested: str | None, model: str) -> None:
    """The one model this router serves, or a 404 naming it."""
    if requested is not None and requested != model:
        raise NotFoundError(f"model {requested!r} does not exist; this server serves {model!r}",
                            param="model", code="model_not_found")  # fmt: skip
