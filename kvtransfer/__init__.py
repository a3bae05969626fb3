"""Moving KV cache blocks between workers: NIXL (UCX) one-sided WRITEs, with a TCP fallback."""

from kvtransfer.agent import Fence, KVAgent, TransferHandle
from kvtransfer.errors import (
    KVCancelledError,
    KVHeaderMismatchError,
    KVPeerError,
    KVTimeoutError,
    KVTransferError,
)
from kvtransfer.factory import Backend, create_agent
from kvtransfer.layout import KVLayout

__all__ = [
    "Backend",
    "Fence",
    "KVAgent",
    "KVCancelledError",
    "KVHeaderMismatchError",
    "KVLayout",
    "KVPeerError",
    "KVTimeoutError",
    "KVTransferError",
    "TransferHandle",
    "create_agent",
]
