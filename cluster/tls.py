"""TLS on the router's port, with vLLM's flags: `--ssl-certfile` (the server's certificate,
which turns TLS on), `--ssl-keyfile` (its key, unless the certificate file holds it),
`--ssl-ca-certs` and `--ssl-cert-reqs` (client certificates: 0 none, 1 optional, 2
required; Python's ssl.CERT_* values) and `--ssl-ciphers`. uvicorn terminates it; the
API, /metrics, the dashboard and /ops/* are all behind it.

Files are loaded before Ray starts (`load_check`), the way the server will load them: a
key that is not its certificate's, an encrypted key (the server could only ask for its
password on a terminal) or a CA file that is no CA file is one clear error at once, not
a server that comes up and fails every handshake.

Clients of a server whose certificate a private CA signed (or that signed itself) name
that CA with `SSL_CERT_FILE=ca.pem`: httpx and the openai client read it, and so do
`pdserve bench`, `contract` and `run-batch --base-url https://...`.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from typing import Any

CERT_REQS = {0: "none", 1: "optional", 2: "required"}  # ssl.CERT_NONE / OPTIONAL / REQUIRED


@dataclass(frozen=True)
class TlsConfig:
    certfile: str | None = None
    keyfile: str | None = None
    ca_certs: str | None = None
    cert_reqs: int = ssl.CERT_NONE
    ciphers: str | None = None

    @property
    def enabled(self) -> bool:
        return self.certfile is not None

    @property
    def scheme(self) -> str:
        return "https" if self.enabled else "http"

    def __post_init__(self) -> None:
        """The flags' combinations (no file is read here: see `load_check`)."""
        if isinstance(self.cert_reqs, bool) or self.cert_reqs not in CERT_REQS:
            raise ValueError(
                "--ssl-cert-reqs must be 0 (no client certificate), 1 (optional) or 2 "
                f"(required), got {self.cert_reqs!r}"
            )
        for flag, value in (
            ("--ssl-certfile", self.certfile), ("--ssl-keyfile", self.keyfile),
            ("--ssl-ca-certs", self.ca_certs), ("--ssl-ciphers", self.ciphers),
        ):  # fmt: skip
            if value is not None and not (isinstance(value, str) and value):
                raise ValueError(f"{flag} must be a non-empty string, got {value!r}")
        if not self.enabled:
            given = [
                flag
                for flag, value in (
                    ("--ssl-keyfile", self.keyfile),
                    ("--ssl-ca-certs", self.ca_certs),
                    ("--ssl-ciphers", self.ciphers),
                    ("--ssl-cert-reqs", self.cert_reqs or None),
                )  # fmt: skip
                if value is not None
            ]
            if given:
                raise ValueError(
                    f"{', '.join(given)}: TLS needs --ssl-certfile (the server's certificate)"
                )
        elif self.cert_reqs != ssl.CERT_NONE and self.ca_certs is None:
            raise ValueError(
                f"--ssl-cert-reqs {self.cert_reqs} ({CERT_REQS[self.cert_reqs]}) checks "
                "client certificates: name the CA that signs them with --ssl-ca-certs"
            )

    def load_check(self) -> None:
        """Loads every file as the server will (ValueError naming the flag)."""
        if not self.enabled:
            return
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            ctx.load_cert_chain(self.certfile, self.keyfile, password=_no_password)
        except (OSError, ssl.SSLError, _EncryptedKey) as e:
            files = f"--ssl-certfile {self.certfile}" + (
                f" / --ssl-keyfile {self.keyfile}" if self.keyfile else ""
            )
            why = (
                "the key is encrypted; pdserve takes a key without a password"
                if isinstance(e, _EncryptedKey)
                else str(e)
            )
            raise ValueError(f"{files}: cannot load the certificate and its key: {why}") from e
        if self.ca_certs is not None:
            try:
                ctx.load_verify_locations(cafile=self.ca_certs)
            except (OSError, ssl.SSLError) as e:
                raise ValueError(f"--ssl-ca-certs {self.ca_certs}: cannot load it: {e}") from e
        if self.ciphers is not None:
            try:
                ctx.set_ciphers(self.ciphers)
            except ssl.SSLError:
                raise ValueError(
                    f"--ssl-ciphers {self.ciphers!r}: OpenSSL selects no cipher by it"
                ) from None

    def uvicorn_kwargs(self) -> dict[str, Any]:
        if not self.enabled:
            return {}
        kw: dict[str, Any] = dict(
            ssl_certfile=self.certfile, ssl_keyfile=self.keyfile,
            ssl_ca_certs=self.ca_certs, ssl_cert_reqs=self.cert_reqs,
        )  # fmt: skip
        if self.ciphers is not None:  # uvicorn's own default otherwise
            kw["ssl_ciphers"] = self.ciphers
        return kw


class _EncryptedKey(Exception):
    pass


def _no_password() -> str:
    """Called by OpenSSL only for an encrypted key; without a callback it would ask on
    the terminal, and a server under Kubernetes would wait there for ever."""
    raise _EncryptedKey
