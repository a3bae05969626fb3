"""ASGI middleware for X-Request-Id in and out: the client's id, or a new one, on every
response; handlers read it (and may take vLLM's `request_id` body field instead) through
request.state.request_id."""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from router.errors import InvalidRequestError

HEADER = "x-request-id"
# It goes into logs and response ids: visible ASCII only, and not a novel.
VALID = re.compile(r"[\x21-\x7e]{1,128}")


def check_request_id(request_id: str, where: str) -> str:
    if not VALID.fullmatch(request_id):
        raise InvalidRequestError(
            f"{where} must be 1 to 128 visible ASCII characters", param=where.lower()
        )
    return request_id


class RequestId:
    def __init__(self, app: ASGIApp, reject: Callable[[InvalidRequestError], ASGIApp]) -> None:
        self.app = app
        self.reject = reject  # the error response, as an ASGI app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        given = dict(scope["headers"]).get(HEADER.encode())
        state["request_id_given"] = given is not None
        state["request_id"] = uuid.uuid4().hex
        try:
            if given is not None:
                state["request_id"] = check_request_id(given.decode("latin-1"), "X-Request-Id")
        except InvalidRequestError as e:
            await self.reject(e)(scope, receive, self._with_id(state, send))
            return
        await self.app(scope, receive, self._with_id(state, send))

    @staticmethod
    def _with_id(state: dict, send: Send) -> Send:
        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)[HEADER] = state["request_id"]
            await send(message)

        return send_with_id
