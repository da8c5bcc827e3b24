"""Throwaway TLS certificates for the tests, made with the ``openssl`` command at test time.

Nothing here is a fixture: tests/integration/conftest.py makes one set per session.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, urlencode

import pytest

from celery_leases._redis_server import HOST, RedisServer, ServerTLS

#: certificates live two days: long enough for any run, short enough to be worthless
_DAYS = "2"
_NO_OPENSSL = (
    "the TLS tests need the openssl command to make throwaway certificates, and none is on "
    "PATH: install it (apt-get install openssl)"
)


@dataclass(frozen=True)
class Certs:
    """A CA with a server and a client certificate, and a stranger's CA and client pair.

    Attributes:
        server: what a TLS ``RedisServer`` needs (the CA, the server pair, a client pair).
        other_ca: a CA that signed neither the server nor the client certificate.
        stranger_certfile: a client certificate signed by ``other_ca``.
        stranger_keyfile: its key.
    """

    server: ServerTLS
    other_ca: str
    stranger_certfile: str
    stranger_keyfile: str


def _openssl(directory: Path, *args: str) -> None:
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.fail(_NO_OPENSSL)
    result = subprocess.run(
        [openssl, *args], cwd=directory, capture_output=True, text=True, timeout=60
    )
    if result.returncode != 0:
        pytest.fail(f"openssl {' '.join(args)} failed:\n{result.stdout}{result.stderr}")


def _new_key_and_request(directory: Path, name: str, subject: str) -> None:
    _openssl(
        directory, "req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
        "-noenc", "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", subject,
    )  # fmt: skip


def _ca(directory: Path, name: str) -> None:
    _openssl(
        directory, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
        "-noenc", "-keyout", f"{name}.key", "-out", f"{name}.crt", "-days", _DAYS,
        "-subj", f"/CN=celery_leases test {name}",
    )  # fmt: skip


def _sign(directory: Path, name: str, ca: str, extensions: str) -> None:
    (directory / f"{name}.ext").write_text(extensions)
    _openssl(
        directory, "x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt",
        "-CAkey", f"{ca}.key", "-CAcreateserial", "-out", f"{name}.crt", "-days", _DAYS,
        "-extfile", f"{name}.ext",
    )  # fmt: skip


def make_certs(directory: Path) -> Certs:
    """Make the certificates in ``directory`` (a few EC keys: well under a second)."""
    _ca(directory, "ca")
    _new_key_and_request(directory, "server", f"/CN={HOST}")
    _sign(
        directory,
        "server",
        "ca",
        f"subjectAltName=IP:{HOST},DNS:localhost\nextendedKeyUsage=serverAuth\n",
    )
    _new_key_and_request(directory, "client", "/CN=celery_leases")
    _sign(directory, "client", "ca", "extendedKeyUsage=clientAuth\n")
    _ca(directory, "other-ca")
    _new_key_and_request(directory, "stranger", "/CN=stranger")
    _sign(directory, "stranger", "other-ca", "extendedKeyUsage=clientAuth\n")
    d = str(directory)
    return Certs(
        server=ServerTLS(
            ca_certs=f"{d}/ca.crt",
            certfile=f"{d}/server.crt",
            keyfile=f"{d}/server.key",
            client_certfile=f"{d}/client.crt",
            client_keyfile=f"{d}/client.key",
        ),
        other_ca=f"{d}/other-ca.crt",
        stranger_certfile=f"{d}/stranger.crt",
        stranger_keyfile=f"{d}/stranger.key",
    )


def tls_url(
    server: RedisServer,
    *,
    user: str | None = None,
    password: str | None = None,
    db: int = 15,
    ca_certs: str | None = None,
    certfile: str | None = None,
    keyfile: str | None = None,
    client_cert: bool = True,
) -> str:
    """The ``rediss://`` URL of a TLS ``server`` as a user writes it (see docs/security.md).

    By default it trusts the server's CA and shows the client certificate the CA signed;
    ``client_cert=False`` leaves the certificate out, the other keywords replace a file.
    """
    tls = server.tls
    assert tls is not None, "not a TLS server"
    query = {"ssl_ca_certs": ca_certs or tls.ca_certs}
    if client_cert:
        query["ssl_certfile"] = certfile or tls.client_certfile
        query["ssl_keyfile"] = keyfile or tls.client_keyfile
    query["ssl_cert_reqs"] = "required"
    auth = ""
    if user is not None or password is not None:
        auth = quote(user or "", safe="")
        if password is not None:
            auth += ":" + quote(password, safe="")
        auth += "@"
    return f"rediss://{auth}{HOST}:{server.port}/{db}?{urlencode(query)}"
