"""The Celery config as a settings source: ``leases_*`` keys read as Celery reads its own."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Final
from urllib.parse import quote

from pydantic.fields import FieldInfo
from pydantic_settings import PydanticBaseSettingsSource

if TYPE_CHECKING:
    from celery import Celery


#: the prefix of the settings' environment variables
ENV_PREFIX: Final = "CELERY_LEASES_"
#: the prefix of the settings' keys in the Celery config
CONF_PREFIX: Final = "leases_"
DEFAULT_REDIS_URL: Final = "redis://localhost:6379/0"


_app_conf: ContextVar[Mapping[str, Any]] = ContextVar(
    "celery_leases_app_conf", default=MappingProxyType({})
)
# leases_<name> -> the config key it was read from (CELERY_LEASES_TTL under a namespace)
conf_origins: ContextVar[Mapping[str, str]] = ContextVar(
    "celery_leases_conf_origins", default=MappingProxyType({})
)


class AppConfSource(PydanticBaseSettingsSource):
    """Reads ``leases_*`` keys of the Celery app config being resolved."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        conf = _app_conf.get()
        key = CONF_PREFIX + field_name
        return conf.get(key), key, False

    def __call__(self) -> dict[str, Any]:
        return {k.removeprefix(CONF_PREFIX): v for k, v in _app_conf.get().items()}


@contextmanager
def conf_context(conf: Mapping[str, Any]) -> Iterator[None]:
    token = _app_conf.set(conf)
    try:
        yield
    finally:
        _app_conf.reset(token)


def describe_source(field: str, kwargs: Mapping[str, Any], conf: Mapping[str, Any]) -> str:
    if field in kwargs:
        return f"keyword argument {field}="
    origin = conf_origins.get().get(CONF_PREFIX + field)
    if origin is not None and origin != CONF_PREFIX + field:
        return f"{origin} in the Celery config"
    if CONF_PREFIX + field in conf:
        return f"app.conf.{CONF_PREFIX}{field}"
    env = ENV_PREFIX + field.upper()
    if any(k.upper() == env for k in os.environ):
        return f"environment variable {env}"
    return "its default"


def conf_of(app: Celery | None) -> dict[str, Any]:
    """The ``leases_*`` settings of ``app.conf``, read the way Celery reads its own.

    After ``app.config_from_object(obj, namespace="CELERY")`` Celery looks a setting up as
    ``CELERY_<NAME>`` first and then as ``<name>``, in each of its maps in turn (changes made
    with ``app.conf.x = ...`` first, then the config object); ``app.conf.get`` does exactly
    that, so every key found under either spelling is read through it. The result maps
    ``leases_<name>`` to the value in force.
    """
    return {key: value for key, (value, _) in conf_with_origins(app).items()}


def loaded_conf(app: Celery) -> Any:
    """``app.conf`` as Celery's Settings (a pending configuration is loaded now, as any read
    of it would)."""
    conf: Any = app.conf
    # Until a key is read, app.conf is a view over a PendingConfiguration: the first read
    # loads the config (config_from_object's object, its namespace) into the same object.
    finalize = getattr(conf, "finalize", None)
    if callable(finalize):
        finalize()
    return conf


def namespace_prefix(conf: Any) -> str | None:
    """``CELERY_LEASES_`` (cased as Celery matches it) when ``conf`` has a namespace."""
    prefix = conf.__dict__.get("prefix") if hasattr(conf, "__dict__") else None
    if not isinstance(prefix, str) or not prefix:
        return None
    return match_case(prefix + CONF_PREFIX, prefix)


def match_case(text: str, like: str) -> str:
    """celery.utils.text.match_case: ``text`` upper-cased if ``like`` is, else lower-cased."""
    return text.upper() if like.isupper() else text.lower()


def conf_with_origins(app: Celery | None) -> dict[str, tuple[Any, str]]:
    """``leases_<name>`` -> (value in force, the config key it came from)."""
    if app is None:
        return {}
    conf = loaded_conf(app)
    namespaced = namespace_prefix(conf)
    found: dict[str, tuple[Any, str]] = {}
    for key in list(conf.keys()):
        if not isinstance(key, str):
            continue
        if namespaced is not None and key.startswith(namespaced) and len(key) > len(namespaced):
            name = CONF_PREFIX + key[len(namespaced) :].lower()
        elif key.startswith(CONF_PREFIX):
            name = key
        else:
            continue
        if name in found:
            continue
        # Celery's own lookup: the namespaced spelling wins within each map
        spelled = (
            match_case(namespaced + name.removeprefix(CONF_PREFIX), namespaced)
            if (namespaced is not None)
            else None
        )
        origin = name
        for mapping in conf.maps:
            if spelled is not None and spelled in mapping:
                origin = spelled
                break
            if name in mapping:
                break
        found[name] = (conf.get(name), origin)
    return found


def changes_of(conf: Any) -> dict[str, Any]:
    """The ``leases_*`` keys (either spelling) of what was set on ``conf`` directly."""
    changes = conf.__dict__.get("changes")
    if not isinstance(changes, dict):
        return {}
    starts = (CONF_PREFIX, namespace_prefix(conf) or CONF_PREFIX)
    return {k: v for k, v in changes.items() if isinstance(k, str) and k.startswith(starts)}


def broker_default(app: Celery | None) -> str:
    if app is None:
        return DEFAULT_REDIS_URL
    broker = app.conf.broker_url
    if isinstance(broker, str) and broker.startswith(("redis://", "rediss://")):
        return broker.split(";")[0]
    if isinstance(broker, str) and broker.startswith("sentinel://"):
        # Celery's form: the sentinels in the URL, the master's name in the transport options
        master = (app.conf.broker_transport_options or {}).get("master_name")
        if master and "master_name=" not in broker:
            first, *rest = broker.split(";")
            joiner = "&" if "?" in first else "?"
            return ";".join([f"{first}{joiner}master_name={quote(str(master))}", *rest])
        return broker
    return DEFAULT_REDIS_URL
