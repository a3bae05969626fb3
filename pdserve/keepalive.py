"""gRPC keepalive between pdserve's own processes.

A peer cut off by the network (a partition, a host gone without closing its connections) sends
nothing back, so a call to it would wait out its whole deadline: a decode worker would hold a
request for its prefill timeout instead of retrying on another prefill worker, and the router
would not move a stream off a decode host it cannot hear. With pings on every connection that
carries calls, a silent peer fails them with UNAVAILABLE within about PING_EVERY_MS +
PING_TIMEOUT_MS, and the caller does what it does for a lost worker. Servers must accept pings
that often (gRPC's default policing would answer them with GOAWAY "too_many_pings")."""

from __future__ import annotations

PING_EVERY_MS = 5000
PING_TIMEOUT_MS = 5000

_PINGS = [
    ("grpc.keepalive_time_ms", PING_EVERY_MS),
    ("grpc.keepalive_timeout_ms", PING_TIMEOUT_MS),
    ("grpc.http2.max_pings_without_data", 0),  # a call waiting on a long prefill sends no data
]
CHANNEL_OPTIONS = list(_PINGS)
SERVER_OPTIONS = [
    *_PINGS,  # a server pings too: a caller gone silent frees what its calls hold
    ("grpc.http2.min_recv_ping_interval_without_data_ms", PING_EVERY_MS // 2),
    ("grpc.http2.max_ping_strikes", 0),
]
