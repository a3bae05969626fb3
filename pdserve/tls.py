"""TLS for every gRPC hop: PEM files -> server and channel credentials (mTLS with a CA)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc


@dataclass(frozen=True, slots=True)
class TLSFiles:
    """PEM files. Serving: cert + key, plus a CA to require client certificates (mTLS).
    Calling: the CA that signed the server, plus a cert + key to present (mTLS)."""

    cert_file: str | None = None
    key_file: str | None = None
    ca_file: str | None = None

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("TLS needs both a certificate file and a key file, or neither")
        for path in (self.cert_file, self.key_file, self.ca_file):
            if path is not None and not Path(path).is_file():
                raise ValueError(f"TLS file {path} does not exist")

    @property
    def enabled(self) -> bool:
        return self.cert_file is not None or self.ca_file is not None


def _read(path: str | None) -> bytes | None:
    return Path(path).read_bytes() if path else None


def server_credentials(tls: TLSFiles) -> grpc.ServerCredentials:
    if tls.cert_file is None or tls.key_file is None:
        raise ValueError("serving TLS needs a certificate file and a key file")
    ca = _read(tls.ca_file)
    key_pair = (_read(tls.key_file), _read(tls.cert_file))
    return grpc.ssl_server_credentials([key_pair], ca, require_client_auth=ca is not None)


def channel_credentials(tls: TLSFiles) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=_read(tls.ca_file),
        private_key=_read(tls.key_file),
        certificate_chain=_read(tls.cert_file),
    )


def open_channel(address: str, tls: TLSFiles, options: list | None = None) -> grpc.Channel:
    if tls.enabled:
        return grpc.secure_channel(address, channel_credentials(tls), options)
    return grpc.insecure_channel(address, options)
