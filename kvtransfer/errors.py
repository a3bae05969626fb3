"""Typed transfer errors: each names the request it belongs to and why it failed."""

from __future__ import annotations


class KVTransferError(Exception):
    """A transfer for one request failed; other requests are unaffected."""

    def __init__(self, request_id: str, reason: str) -> None:
        # Both values go to Exception.args so the error pickles across process boundaries.
        super().__init__(request_id, reason)
        self.request_id = request_id
        self.reason = reason

    def __str__(self) -> str:
        return f"request {self.request_id}: {self.reason}"


class KVTimeoutError(KVTransferError):
    """Not every expected block landed within the caller's timeout."""


class KVHeaderMismatchError(KVTransferError):
    """The two ends disagree on the layout or the byte count; nothing was written."""


class KVPeerError(KVTransferError):
    """The peer failed or went away mid-transfer (connection lost, short write, transport error)."""


class KVCancelledError(KVTransferError):
    """The receiver cancelled the request, or does not (or no longer) expect it."""


# The wire names errors by kind so that the sender re-raises the receiver's verdict as the
# same type; unknown kinds from a newer peer fall back to the base class.
_KINDS: dict[str, type[KVTransferError]] = {
    "timeout": KVTimeoutError,
    "header": KVHeaderMismatchError,
    "peer": KVPeerError,
    "cancelled": KVCancelledError,
}
_KIND_OF: dict[type[KVTransferError], str] = {cls: kind for kind, cls in _KINDS.items()}


def error_kind(error: KVTransferError) -> str:
    return _KIND_OF.get(type(error), "failed")


def error_from_wire(kind: str, request_id: str, reason: str) -> KVTransferError:
    return _KINDS.get(kind, KVTransferError)(request_id, reason)
