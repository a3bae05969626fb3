"""The API-key check both front doors apply: `Authorization: Bearer <key>` (HTTP header or
gRPC metadata), compared in constant time."""

from __future__ import annotations

import hmac

from router.errors import UnauthorizedError


def check_bearer(authorization: str, api_key: str | None) -> None:
    """Raises UnauthorizedError unless the header carries the key (or no key is configured)."""
    if api_key is None:
        return
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(
        token.strip().encode(), api_key.encode()
    ):
        raise UnauthorizedError()
