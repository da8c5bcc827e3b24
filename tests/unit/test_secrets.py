"""Passwords in redis_url never show: settings, their errors, and the TLS options check.

Every test puts a distinctive password in the URL and looks for it in all that could be shown.
"""

from __future__ import annotations

import os
import re
import traceback
from pathlib import Path

import pytest
from celery import Celery
from pydantic import ValidationError

from celery_leases import Leases, LeaseSettings
from celery_leases.config import resolve_settings, safe_url
from celery_leases.exceptions import LeaseConfigError

SECRET = "Zq7-secret-pw"
DOCS = Path(__file__).resolve().parents[2] / "docs" / "security.md"

#: the three places a password can sit in a URL
URLS = [
    f"redis://celery_leases:{SECRET}@cache.internal:6380/3",
    f"redis://cache.internal:6380/3?password={SECRET}",
    f"rediss://cache.internal:6380/3?ssl_certfile=/c.pem&ssl_keyfile=/k.pem&ssl_password={SECRET}",
]
#: the key passwords of TLS to a Cluster and to Sentinel (its sentinels' own key too)
TOPOLOGY_URLS = [
    f"rediss+cluster://cache.internal:6380?ssl_certfile=/c.pem&ssl_keyfile=/k.pem"
    f"&ssl_password={SECRET}",
    f"sentinel://cache.internal:26379/3?master_name=m&ssl=true&ssl_certfile=/c.pem"
    f"&ssl_keyfile=/k.pem&ssl_password={SECRET}",
    f"sentinel://cache.internal:26379/3?master_name=m&sentinel_ssl=true"
    f"&sentinel_ssl_certfile=/c.pem&sentinel_ssl_keyfile=/k.pem&sentinel_ssl_password={SECRET}",
]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.upper().startswith("CELERY_LEASES_"):
            monkeypatch.delenv(name)


def with_option(url: str, option: str) -> str:
    return url + ("&" if "?" in url else "?") + option


def everything_shown(exc: BaseException) -> str:
    """What a log, a console or an error tracker could show of ``exc``."""
    parts = [str(exc), repr(exc), "".join(traceback.format_exception(exc))]
    seen: set[int] = set()
    inner: BaseException | None = exc
    while inner is not None and id(inner) not in seen:  # chained ones, shown or not
        seen.add(id(inner))
        parts += [str(inner), repr(inner)]
        inner = inner.__cause__ or inner.__context__
    return "\n".join(parts)


@pytest.mark.parametrize("url", URLS + TOPOLOGY_URLS)
def test_settings_never_show_the_password(url: str) -> None:
    settings = LeaseSettings(redis_url=url)
    assert settings.redis_url == url  # the real value is there, for the store
    assert settings.url == url
    shown = [
        repr(settings),
        str(settings),
        repr(settings.model_dump()),
        settings.model_dump(mode="json")["redis_url"],
        settings.model_dump_json(),
    ]
    for text in shown:
        assert SECRET not in text
        assert "***" in text
    assert settings.model_dump()["redis_url"] == safe_url(url)
    app = Celery("secrets", set_as_current=False)
    if "+cluster://" in url:  # a cluster client connects at once: here to a host that is not
        with pytest.raises(LeaseConfigError, match="not usable") as info:
            Leases(app, redis_url=url, socket_connect_timeout=0.5)
        assert SECRET not in everything_shown(info.value)
        return
    leases = Leases(app, redis_url=url)
    assert SECRET not in repr(leases)
    leases.store.close()


@pytest.mark.parametrize("url", URLS + TOPOLOGY_URLS)
@pytest.mark.parametrize("source", ["kwarg", "app.conf", "env"])
def test_settings_errors_never_show_the_password(
    url: str, source: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # an unknown option (a misspelt TLS option) in a URL that carries the password
    bad = with_option(url, "ssl_ca_cert=/ca.pem")
    app = Celery("secrets", set_as_current=False)
    kwargs = {}
    if source == "kwarg":
        kwargs["redis_url"] = bad
    elif source == "app.conf":
        app.conf.leases_redis_url = bad
    else:
        monkeypatch.setenv("CELERY_LEASES_REDIS_URL", bad)
    with pytest.raises(LeaseConfigError) as info:
        resolve_settings(app, **kwargs)
    assert "ssl_ca_cert" in str(info.value)
    assert SECRET not in everything_shown(info.value)
    with pytest.raises(LeaseConfigError) as info:
        Leases(app, **kwargs)
    assert SECRET not in everything_shown(info.value)


@pytest.mark.parametrize("url", URLS)
def test_pydantic_errors_of_lease_settings_never_show_the_password(url: str) -> None:
    for bad in (
        url.replace("redis", "valkey", 1),
        with_option(url, "ssl_ca_cert=/x"),
        with_option(url, "protocol=9"),
    ):
        with pytest.raises(ValidationError) as info:
            LeaseSettings(redis_url=bad)
        assert SECRET not in everything_shown(info.value)


@pytest.mark.parametrize(
    "url",
    [
        f"redis://:{SECRET}/x@host:6379/0",  # an unescaped / in the password
        f"redis://u:{SECRET}?x@host:6379/0",  # an unescaped ?
        f"redis://u:{SECRET}#x@host:6379/0",  # an unescaped #
        f"redis://u:1234{SECRET}/x@host/0",
    ],
)
def test_a_password_with_unescaped_delimiters_is_not_shown(url: str) -> None:
    assert SECRET not in safe_url(url)
    with pytest.raises(LeaseConfigError, match="port is not a number") as info:
        resolve_settings(None, redis_url=url)
    assert SECRET not in everything_shown(info.value)


def test_safe_url_hides_the_key_password_and_keeps_the_tls_files() -> None:
    shown = safe_url(f"rediss://h:1/0?ssl_ca_certs=/ca.pem&ssl_password={SECRET}&db=2")
    assert shown == "rediss://h:1/0?ssl_ca_certs=/ca.pem&ssl_password=***&db=2"


# --- the URL options check ----------------------------------------------------------------
@pytest.mark.parametrize(
    ("url", "named"),
    [
        ("rediss://h:6380/0?ssl_ca_cert=/ca.pem", "'ssl_ca_cert'"),
        ("rediss://h:6380/0?ssl_cafile=/ca.pem", "'ssl_cafile'"),
        ("redis://h:6379/0?ssl_ca_certs=/ca.pem", "TLS options need a rediss:// URL"),
        ("rediss://h:6380/0?ssl_cert_reqs=CERT_REQUIRED", "CERT_REQUIRED"),
        ("rediss://h:6380/0?ssl_min_version=TLSv1_2", "ssl_min_version"),
        ("rediss://h:6380/0?ssl_check_hostname=maybe&x=1", "'x'"),
        ("redis://h:6379/0?protocol=4", "protocol"),
        ("redis://h:notaport/0", "port is not a number"),
    ],
)
def test_url_options_redis_py_would_refuse_fail_at_settings(url: str, named: str) -> None:
    with pytest.raises(LeaseConfigError) as info:
        resolve_settings(None, redis_url=url)
    assert "redis_url" in str(info.value)
    assert named in str(info.value)


def _documented_urls() -> list[str]:
    text = DOCS.read_text()
    return re.findall(r"^((?:rediss?(?:\+cluster)?|sentinel)://\S+)$", text, flags=re.MULTILINE)


def test_the_documented_url_forms_are_accepted_and_shown_without_password() -> None:
    urls = _documented_urls()
    assert len(urls) >= 4, urls  # one server twice, a cluster and Sentinel over TLS
    for url in urls:
        settings = resolve_settings(None, redis_url=url)
        assert settings.redis_url == url
        assert "change-me" not in repr(settings)


def test_tls_options_are_accepted(tmp_path: Path) -> None:
    url = (
        "rediss://u:pw@h:6380/0?ssl_ca_certs=/ca.pem&ssl_ca_path=/certs&ssl_certfile=/c.pem"
        "&ssl_keyfile=/k.pem&ssl_password=x&ssl_cert_reqs=required&ssl_check_hostname=true"
        "&ssl_min_version=771&ssl_ciphers=HIGH"
    )
    # files are not opened at settings time: they need to exist only where leases are used
    assert resolve_settings(None, redis_url=url).redis_url == url
