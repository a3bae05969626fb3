"""Backend choice: NIXL when it imports and initialises here, else the TCP fallback."""

from __future__ import annotations

import logging
from typing import Literal

import torch

from kvtransfer.agent import KVAgent
from kvtransfer.layout import KVLayout
from kvtransfer.staging import Staging, staging_setting
from kvtransfer.tcp_agent import TcpAgent

logger = logging.getLogger(__name__)

Backend = Literal["auto", "nixl", "tcp"]


def create_agent(
    backend: Backend,
    name: str,
    kv_cache: torch.Tensor,
    layout: KVLayout,
    host: str = "127.0.0.1",
    staging: Staging | None = None,
) -> KVAgent:
    """Create the transfer agent of a serving process (never fork after this: NIXL hangs).

    host is where the tcp backend listens (on a port the OS picks); NIXL/UCX picks its own
    interfaces. staging (default: $PDSERVE_KV_STAGING, else auto) says whether a CUDA cache
    goes through pinned host memory: auto does so only where UCX cannot move GPU memory; tcp
    always stages a CUDA cache.
    """
    staging = staging or staging_setting()
    tcp_staging = True if staging == "always" else None
    if backend == "tcp":
        return TcpAgent(name, kv_cache, layout, host, staging=tcp_staging)
    if backend == "nixl":
        return _create_nixl(name, kv_cache, layout, staging)
    if backend != "auto":
        raise ValueError(f"backend must be 'auto', 'nixl' or 'tcp', got {backend!r}")
    try:
        return _create_nixl(name, kv_cache, layout, staging)
    except Exception as e:  # ImportError, or whatever NIXL/UCX raises while initialising
        logger.warning(
            "NIXL unavailable (%s: %s); using the tcp KV transfer backend", type(e).__name__, e
        )
        return TcpAgent(name, kv_cache, layout, host, staging=tcp_staging)


def _create_nixl(name: str, kv_cache: torch.Tensor, layout: KVLayout, staging: Staging) -> KVAgent:
    # Imported here: the nixl wheel is optional, and importing it loads UCX.
    from kvtransfer.nixl_agent import NixlAgent

    return NixlAgent(name, kv_cache, layout, staging)
