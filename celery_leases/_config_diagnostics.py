"""What is wrong with the settings, said plainly: URLs, unknown keys, near misses."""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Any, Final
from urllib.parse import parse_qsl, urlsplit

from celery.utils.log import get_logger
from pydantic import ValidationError
from redis.connection import Connection, SSLConnection, parse_url
from redis.exceptions import RedisError

from ._config_source import (
    CONF_PREFIX,
    ENV_PREFIX,
    conf_origins,
    describe_source,
    loaded_conf,
    match_case,
    namespace_prefix,
)
from ._connect import parse_target

if TYPE_CHECKING:
    from collections.abc import Callable

    from celery import Celery


def safe_url(url: str) -> str:
    """``url`` without its passwords (user info, ``password=`` queries), for logs and errors.

    Handles every lease URL form: several hosts (``host:1,host:2``) and Celery's ``;``-joined
    sentinel lists included.
    """
    return ";".join(_safe_one(part) for part in url.split(";"))


def _safe_one(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    if not sep:
        return "<unparsable redis url>"
    cut = min([i for i in (rest.find(c) for c in "/?#") if i >= 0], default=len(rest))
    netloc, tail = rest[:cut], rest[cut:]
    if "@" not in netloc and "@" in tail:
        # a password holding an unescaped / ? or # ends the host part early, and the rest of
        # it would show as the path or query: redis://:pa/ss@host/0
        return "<unparsable redis url>"
    if "@" in netloc:
        userinfo, hosts = netloc.rsplit("@", 1)
        if ":" in userinfo:
            netloc = f"{userinfo.split(':', 1)[0]}:***@{hosts}"
    # redis-py also takes passwords as query arguments: redis://host/0?password=...
    return f"{scheme}://{netloc}{_QUERY_PASSWORD.sub(_REDACTED, tail)}"


_QUERY_PASSWORD: Final = re.compile(r"(?i)(?<=[?&])((?:sentinel_)?(?:ssl_)?password)=[^&#]*")


_REDACTED: Final = r"\1=***"


def url_problem(url: str) -> str | None:
    """Why redis-py would refuse ``url`` at its first command, found without connecting.

    redis-py hands every query option it does not know to the connection class, which raises
    ``TypeError`` only when the first connection is made; a misspelt TLS option
    (``ssl_ca_cert=``) or one on a ``redis://`` URL would surface late and raw. Files named by
    the options are not opened here: they need to exist only where leases are used.
    """
    try:
        target = parse_target(url)
        if target.kind == "single":
            kwargs: dict[str, Any] = parse_url(url)  # type: ignore[no-untyped-call, unused-ignore]
        else:  # the options of the master's or the nodes' connections
            kwargs = _with_connection_class(target.options)
    except ValueError:
        return None  # _check_url names what is wrong
    problem = _connection_problem(kwargs)
    if problem is not None:
        if problem.startswith(_UNKNOWN) and "'ssl_" in problem:
            hint = {
                "single": "a rediss:// URL",
                "cluster": "a rediss+cluster:// URL",
                "sentinel": "ssl=true",
            }[target.kind]
            if kwargs.get("connection_class") is not SSLConnection:
                problem += f" (TLS options need {hint})"
        return problem
    if target.kind == "sentinel" and target.sentinel_options:
        written = {k for part in url.split(";") for k, _ in parse_qsl(urlsplit(part).query)}
        sentinel = _with_connection_class(target.sentinel_options)
        return _connection_problem(sentinel, lambda name: f"sentinel_{name}" in written)
    return None


_UNKNOWN: Final = "redis-py does not take the URL option"


def _with_connection_class(options: Mapping[str, Any]) -> dict[str, Any]:
    kwargs = dict(options)
    if kwargs.pop("ssl", False):
        kwargs["connection_class"] = SSLConnection
    return kwargs


def _connection_problem(
    kwargs: dict[str, Any], sentinel_only: Callable[[str], bool] = lambda name: False
) -> str | None:
    """Why redis-py's connection class refuses ``kwargs``; an option for which
    ``sentinel_only`` is true was written with the ``sentinel_`` prefix."""
    connection_class = kwargs.pop("connection_class", Connection)
    try:
        connection_class(**kwargs)  # builds the object only; nothing connects
    except TypeError as exc:
        found = re.search(r"keyword argument '(\w+)'", str(exc))
        if found is None:
            return f"redis-py refuses its options: {exc}"
        name = found.group(1)
        return f"{_UNKNOWN} {('sentinel_' if sentinel_only(name) else '') + name!r}"
    except RedisError as exc:  # e.g. ssl_cert_reqs=CERT_REQUIRED
        return f"redis-py refuses its options: {exc}"
    finally:
        kwargs["connection_class"] = connection_class
    return None


def closest(name: str, fields: Collection[str]) -> str | None:
    """The setting ``name`` was probably meant to be (difflib's closest match), or None."""
    close = difflib.get_close_matches(name.lower(), fields, n=1, cutoff=0.6)
    return close[0] if close else None


def did_you_mean(field: str, where: str, fields: Collection[str]) -> str:
    """``: did you mean ...?`` for an unknown setting, spelt as it was given (a keyword,
    an ``app.conf`` key, a namespaced config key, an environment variable); else ``""``."""
    close = closest(field, fields)
    if close is None:
        return ""
    if where.startswith("keyword argument"):
        return f": did you mean {close}=?"
    origin = conf_origins.get().get(CONF_PREFIX + field)
    if origin is not None and origin != CONF_PREFIX + field:  # CELERY_LEASES_TTLL
        spelt = origin[: len(origin) - len(field)] + match_case(close, origin)
        return f": did you mean {spelt}?"
    if where.startswith("environment"):
        return f": did you mean {ENV_PREFIX}{close.upper()}?"
    return f": did you mean {CONF_PREFIX}{close}?"


#: the word a key meant for celery_leases starts with, once its namespace is taken off:
#: ``lease_``, ``leases_`` (``leasesx`` is somebody else's)
_LEASE_WORD: Final = re.compile(r"leases?[_\-.]")


#: environment variables of the project's own test and fault suites, which are not settings
_DEV_ENV: Final = ("CELERY_LEASES_TEST_", "CELERY_LEASES_MODEL_", "CELERY_LEASES_FAULTS_")


_warned_env: set[str] = set()


#: settings' messages log as the settings module, where users look for them
logger: Final = get_logger("celery_leases.config")


def near_misses(app: Celery | None, fields: Collection[str]) -> list[str]:
    """Config keys that look meant for celery_leases but are not read as its settings.

    ``CELERY_LEASE_LOST_MARGIN`` (singular) in a config loaded with ``namespace="CELERY"``,
    ``lease_ttl``, or ``CELERY_LEASES_TTL`` in a config without a namespace (Celery reads
    only ``leases_ttl`` there): Celery would keep them and nothing would read them.
    """
    if app is None:
        return []
    conf = loaded_conf(app)
    namespaced = namespace_prefix(conf)
    # the namespace as a lower-cased prefix: "celery_" (or "celery_" unread, without one)
    ns = (namespaced or "celery_leases_").lower().removesuffix(CONF_PREFIX)
    lines = []
    for key in list(conf.keys()):
        if not isinstance(key, str) or key.startswith(CONF_PREFIX):
            continue
        if namespaced is not None and key.startswith(namespaced):
            continue
        low = key.lower()
        if low.startswith(ns + "lease"):
            rest = low[len(ns) :]  # CELERY_LEASE_TTL; CELERY_LEASES_TTL without a namespace
        elif key.startswith("lease"):
            rest = key  # lease_ttl, leasesttl: a Celery-style key
        else:
            continue
        word = _LEASE_WORD.match(rest)
        if word is None:
            continue
        name = rest[word.end() :]
        close = closest(name, fields) if name else None
        if close is None:
            meant = None
        elif namespaced is not None and key.isupper():
            meant = match_case(namespaced + close, namespaced)
        else:
            meant = CONF_PREFIX + close
        hint = f": did you mean {meant}?" if meant else ""
        why = "" if namespaced is not None or not key.isupper() else " (it has no namespace)"
        lines.append(f"unknown setting key {key!r} in the Celery config{why}{hint}")
    return lines


def warn_unknown_env(fields: Collection[str]) -> None:
    """Log once per process each ``CELERY_LEASES_*`` environment variable that is not a
    setting (the environment is shared with other programs: told, not refused)."""
    for key in list(os.environ):
        upper = key.upper()
        if not upper.startswith(("CELERY_LEASES_", "CELERY_LEASE_")) or key in _warned_env:
            continue
        if upper.startswith(_DEV_ENV):
            continue
        name = upper.removeprefix("CELERY_LEASES_").removeprefix("CELERY_LEASE_").lower()
        if upper.startswith(ENV_PREFIX) and name in fields:
            continue
        _warned_env.add(key)
        close = closest(name, fields)
        hint = f": did you mean {ENV_PREFIX}{close.upper()}?" if close else ""
        logger.warning(
            "leases: environment variable %s is not a celery_leases setting and is ignored%s",
            key,
            hint,
        )


def config_error(
    exc: ValidationError,
    kwargs: Mapping[str, Any],
    conf: Mapping[str, Any],
    fields: Collection[str],
) -> str:
    """The message of a :class:`~celery_leases.exceptions.LeaseConfigError` for ``exc``."""
    lines = []
    for err in exc.errors():
        field = str(err["loc"][0]) if err["loc"] else ""
        if err["type"] == "extra_forbidden":
            where = describe_source(field, kwargs, conf)
            lines.append(
                f"unknown setting {field!r} (from {where}){did_you_mean(field, where, fields)}"
            )
        elif not field:
            lines.append(str(err["msg"]).removeprefix("Value error, "))
        else:
            where = describe_source(field, kwargs, conf)
            message = str(err["msg"]).removeprefix("Value error, ")
            shown = err["input"]
            if field == "redis_url" and isinstance(shown, str):
                shown = safe_url(shown)
            lines.append(f"setting {field!r} from {where}: {message} (got {shown!r})")
    return "invalid celery_leases settings: " + "; ".join(lines)
