"""The bearer token and TLS material, reloadable without a restart (SIGHUP).

TLS uses gRPC's dynamic server credentials: the certificate fetcher is asked
at every new handshake, and hands over a new configuration once after a
reload. Connections already open, and the updates on them, keep their session:
a running update is never dropped by a rotation. The token is swapped in one
assignment; a refused reload (missing or empty file) keeps what was there.
"""

from __future__ import annotations

import threading

import grpc

from weightsync.common.logging import get_logger
from weightsync.server.config import ServerConfig, read_token

log = get_logger("weightsync.credentials")


def _read(path: str) -> bytes:
    with open(path, "rb") as handle:
        return handle.read()




class Credentials:
    def __init__(self, config: ServerConfig) -> None:
        self._config = config
        self.token = config.token
        self._lock = threading.Lock()
        self._pending: grpc.ServerCertificateConfiguration | None = None
        self.reloads = 0

    def _certificate_configuration(self) -> grpc.ServerCertificateConfiguration:
        c = self._config
        return grpc.ssl_server_certificate_configuration(
            [(_read(c.tls_key), _read(c.tls_cert))],
            root_certificates=_read(c.tls_client_ca) if c.tls_client_ca else None,
        )

    def server_credentials(self) -> grpc.ServerCredentials | None:
        """TLS credentials whose certificate follows reloads; None for a plaintext server."""
        if not self._config.tls_cert:
            return None
        return grpc.dynamic_ssl_server_credentials(
            self._certificate_configuration(), self._fetch, require_client_authentication=bool(self._config.tls_client_ca)
        )

    def _fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """Called by gRPC at each handshake: a new configuration once after a reload, else None (keep)."""
        with self._lock:
            pending, self._pending = self._pending, None
        return pending

    def reload(self) -> bool:
        """Read the token file and certificates again; True if everything loaded."""
        config = self._config
        try:
            token = read_token(config.token_file) if config.token_file else self.token
            certificates = self._certificate_configuration() if config.tls_cert else None
        except (OSError, ValueError, RuntimeError) as error:
            log.error("credentials_reload_failed", error=str(error))
            return False
        self.token = token
        if certificates is not None:
            with self._lock:
                self._pending = certificates
        self.reloads += 1
        log.info("credentials_reloaded", token=bool(token), tls=certificates is not None, reloads=self.reloads)
        return True
