"""ASGI middleware that refuses request bodies over a size limit with 413, before they are
buffered: by Content-Length when the client sends one, else as the bytes arrive."""

from __future__ import annotations

from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from router.errors import BodyTooLargeError


class BodyLimit:
    def __init__(
        self, app: ASGIApp, max_bytes: int, reject: Callable[[BodyTooLargeError], ASGIApp]
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.reject = reject  # the error response, as an ASGI app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await self.reject(BodyTooLargeError(int(declared), self.max_bytes))(
                scope, receive, send
            )
            return
        num_received = 0

        async def limited_receive() -> Message:
            nonlocal num_received
            message = await receive()
            if message["type"] == "http.request":
                num_received += len(message.get("body", b""))
                if num_received > self.max_bytes:  # the handler's error mapping answers 413
                    raise BodyTooLargeError(num_received, self.max_bytes)
            return message

        await self.app(scope, limited_receive, send)
