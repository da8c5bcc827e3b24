"""Settings: one pydantic-settings model, resolved once per Celery app.

Every setting can be given in four places; the first that has it wins:

1. keyword arguments: ``Leases(app, ttl=60)``
2. the Celery config: ``app.conf.leases_ttl = 60``, or ``CELERY_LEASES_TTL`` in the object of
   ``app.config_from_object(obj, namespace="CELERY")``, looked up as Celery looks up its own
   keys (the namespaced spelling first, in each map: ``app.conf`` writes, then the object)
3. the environment: ``CELERY_LEASES_TTL=60``
4. the default below.

An invalid value fails at ``Leases(app)`` (or the first :func:`get_settings`) with a
:class:`~celery_leases.exceptions.LeaseConfigError` that names the setting and where it came from.
``Leases(app)`` resolves them again at first use (:class:`AppSettings`): Celery's config is
lazy, and a key set after ``Leases(app)`` counts; one changed after first use is refused.
"""

from __future__ import annotations

import re
import threading
import weakref
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, Final, Literal

from pydantic import Field, ValidationError, field_serializer, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from ._config_diagnostics import (
    config_error,
    near_misses,
    safe_url,
    url_problem,
    warn_unknown_env,
)
from ._config_source import (
    CONF_PREFIX,
    DEFAULT_REDIS_URL,
    ENV_PREFIX,
    AppConfSource,
    broker_default,
    changes_of,
    conf_context,
    conf_origins,
    conf_with_origins,
    loaded_conf,
)
from ._connect import parse_target
from ._setting_texts import (
    HANDON_TIMEOUT,
    ON_DUPLICATE,
    PARK_PUMP_INTERVAL,
    UNIQUE_CANCEL_DEADLINE,
    UNIQUE_CONFIRM,
    UNIQUE_CONFIRM_WINDOW,
    UNIQUE_TTL,
)
from ._timing import (
    RENEWALS_PER_HORIZON,
    Timing,
    renewal_interval,
    timing,
    timing_problem,
    timing_warnings,
)
from .exceptions import LeaseConfigError

if TYPE_CHECKING:
    from celery import Celery

__all__ = (
    "CONF_PREFIX",
    "DEFAULT_REDIS_URL",
    "ENV_PREFIX",
    "RENEWALS_PER_HORIZON",
    "LeaseSettings",
    "OnBackendError",
    "OnBusy",
    "OnDuplicate",
    "OnLost",
    "Timing",
    "get_settings",
    "renewal_interval",
    "resolve_settings",
    "safe_url",
    "timing",
    "timing_problem",
    "timing_warnings",
)


OnBusy = Literal["retry", "skip", "fail", "wait", "defer"]
OnLost = Literal["interrupt", "log"]
OnBackendError = Literal["retry", "fail"]
OnDuplicate = Literal["existing", "raise", "ignore", "cancel"]

_PREFIX_RE: Final = re.compile(r"[A-Za-z0-9_.:\-]{1,64}")


class LeaseSettings(BaseSettings):
    """Every knob of celery_leases, with its default and its validation.

    Each field is also ``app.conf.leases_<name>`` and the environment variable
    ``CELERY_LEASES_<NAME>``.
    """

    # hide_input_in_errors: a ValidationError's text would show the rejected redis_url whole,
    # password included; config_error shows it through safe_url instead.
    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        frozen=True,
        extra="forbid",
        case_sensitive=False,
        hide_input_in_errors=True,
    )

    redis_url: str | None = Field(
        None,
        description=(
            "Where leases live: redis://, rediss:// or unix:// (one server), "
            "sentinel://host:port[,host:port...][/db]?master_name=NAME (a master found through "
            "Sentinel) or redis+cluster:// / rediss+cluster://host:port[,host:port...] (a "
            "Cluster). Default: the broker URL when it is a redis://, rediss:// or sentinel:// "
            "URL (with master_name from broker_transport_options), else redis://localhost:6379/0."
        ),
    )
    key_prefix: str = Field(
        "leases",
        description=(
            "Every key starts with it, so two apps on one Redis never meet. 1-64 characters "
            "from A-Z a-z 0-9 _ . : -"
        ),
    )
    ttl: float = Field(
        30.0,
        ge=0.05,
        le=86400.0,
        description="Seconds a lease lives without renewal; the heartbeat renews every ttl / 3.",
    )
    lost_margin: float = Field(
        0.1,
        gt=0.0,
        lt=0.5,
        description=(
            "Fraction of the TTL kept as a safety margin: a lease whose last confirmed renewal "
            "is older than min(lease ttl, the ttl setting) * (1 - lost_margin) counts as lost, "
            "before Redis can expire it or a reconcile can free it."
        ),
    )
    on_busy: OnBusy = Field(
        "retry",
        description="Default busy policy of LeasedTask: retry, skip, fail, wait or defer.",
    )
    handon_timeout: float = Field(30.0, gt=0.0, description=HANDON_TIMEOUT)
    park_pump_interval: float = Field(1.0, gt=0.0, description=PARK_PUMP_INTERVAL)
    skip_result: Literal["marker", "none"] = Field(
        "marker",
        description=(
            "What a task skipped by on_busy='skip' returns (state SUCCESS either way). "
            "marker: a small dict {'celery_leases.skipped': {'resource': ..., 'holder_task': "
            "...}} that celery_leases.is_skipped(result) recognises; none: None, as before "
            "0.1.0 (a skip then looks like a body that returned None)."
        ),
    )
    on_lost: OnLost = Field(
        "interrupt",
        description=(
            "Default lost policy: interrupt (raise LeaseLost inside the running body) or log."
        ),
    )
    on_backend_error: OnBackendError = Field(
        "retry",
        description=(
            "Default policy of LeasedTask when Redis fails or cannot be reached as the task "
            "takes its leases or unique claim: retry (self.retry with the retry_delay / "
            "retry_max_delay backoff; counts against the task's max_retries, after which the "
            "LeaseBackendError is raised) or fail (raise LeaseBackendError at once)."
        ),
    )
    busy_timeout: float = Field(
        300.0,
        gt=0.0,
        description=(
            "on_busy='retry': seconds after the first busy attempt when retrying stops and "
            "LeaseBusy is raised."
        ),
    )
    retry_delay: float = Field(
        1.0,
        gt=0.0,
        description=(
            "on_busy='retry' and on_backend_error='retry': countdown of the first lease retry "
            "(seconds)."
        ),
    )
    retry_max_delay: float = Field(
        30.0,
        gt=0.0,
        description=(
            "on_busy='retry' and on_backend_error='retry': cap of the exponential backoff "
            "between retries (seconds)."
        ),
    )
    wait_timeout: float = Field(
        60.0,
        ge=0.0,
        description="on_busy='wait': seconds a task blocks its worker slot waiting for a release.",
    )
    socket_timeout: float = Field(
        5.0, gt=0.0, description="Seconds a Redis command may take before it counts as failed."
    )
    socket_connect_timeout: float = Field(
        2.0, gt=0.0, description="Seconds to open a connection to Redis."
    )
    slot_groups: int = Field(
        1,
        ge=1,
        le=1024,
        description=(
            "Number of hash-slot groups resource keys are spread over. 1 suits a single Redis "
            "or Sentinel; raise it on Redis Cluster to spread leases over the shards."
        ),
    )
    min_replicas: int = Field(
        0,
        ge=0,
        le=16,
        description=(
            "Replicas that must have each grant, renewal and park of a deferred task (Redis "
            "WAIT, in the same round trip) before it counts. With 1 or more, a Sentinel "
            "failover to a replica that was in sync loses no lease, repeats no fencing token "
            "and loses no parked task; a grant not replicated within min_replicas_timeout is "
            "given back and raises LeaseBackendError, a renewal not replicated counts as "
            "failed, a park not replicated requeues its message. 0: asynchronous replication, "
            "as Redis does by default."
        ),
    )
    min_replicas_timeout: float = Field(
        0.5,
        gt=0.0,
        description=(
            "Seconds a grant, renewal or park waits for min_replicas replicas to confirm it."
        ),
    )
    reconcile_interval: float = Field(
        60.0,
        ge=0.0,
        description=(
            "Seconds between orphan-reconcile passes in each worker (one worker of the fleet "
            "runs each pass); 0 turns the periodic pass off."
        ),
    )
    restart_grace: float = Field(
        0.0,
        ge=0.0,
        description=(
            "Seconds during which no lease is granted after Redis is found empty (restarted "
            "without persistence, or its keys deleted). Redis cannot tell that from a new, "
            "never used Redis, which this grace holds back too, hence 0 (off) by default. "
            "Set it to the ttl setting (or more) when Redis may come back empty, so that a "
            "holder always learns of the loss before anyone else is granted the resource. "
            "Restarts that keep data are covered by restore_grace."
        ),
    )
    restore_grace: float | None = Field(
        None,
        ge=0.0,
        description=(
            "Seconds during which no lease is granted after Redis restarted from an RDB "
            "snapshot or an AOF, or failed over to a replica (its run id or replication id "
            "changed while the library's records were kept), since the grants made after the "
            "snapshot or the last replicated write are lost while their holders still count "
            "them held. None (the default): the ttl setting, or restart_grace if that is "
            "longer; a holder counts a lease held for at most ttl after its last renewal. "
            "Costs nothing on a new Redis. 0 turns the check off. Needs INFO in the ACL."
        ),
    )
    token_memory: float = Field(
        86400.0,
        ge=0.0,
        le=10 * 365 * 86400.0,
        description=(
            "Seconds the last fencing token of a resource is kept in Redis after its grant (one "
            "counter key per resource, about 130 bytes). A token is at least the Redis clock in "
            "microseconds at its grant; within this time of the resource's last grant, the "
            "counter also keeps it above the last one when the server clock steps back, or a "
            "failover or slot migration lands the resource on a server whose clock is behind. "
            "0 keeps no counter: nothing of a resource stays in Redis after its release, and "
            "a token grows as long as the clock that grants it never reads earlier than at an "
            "earlier grant of the resource. See 'How tokens are made' in hold-and-once.md."
        ),
    )
    history: int = Field(
        0,
        ge=0,
        le=1_000_000,
        description=(
            "Events kept per slot group in a capped Redis stream (XADD MAXLEN ~): granted, "
            "released, expired, freed (by cleanup, reaper or reconcile), lost, forced and busy, "
            "each with its task and node; each resource also keeps its last min(history, 100) "
            "events, its transitions and its last ttl. 0 (the default) writes nothing. Read by "
            "`celery leases history` and `show`. See 'History' in operations.md for its cost."
        ),
    )
    history_keep: float = Field(
        86400.0,
        gt=0.0,
        le=365 * 86400.0,
        description=(
            "With history: seconds a resource's own events and record live after its last "
            "event (the slot groups' streams are capped by count only)."
        ),
    )
    receipt_ttl: float | None = Field(
        None,
        gt=0.0,
        description=("Seconds a once() receipt is kept; None keeps it until leases.forget(name)."),
    )
    beat_mode: Literal["claim", "leader"] = Field(
        "claim",
        description=(
            "LeasedScheduler: 'claim' lets every replica tick and the first to claim a due run "
            "send it; 'leader' lets only the replica holding the leader lease send."
        ),
    )
    beat_claim_keep: float = Field(
        86400.0,
        gt=0.0,
        description=(
            "Seconds a beat entry's last claimed run is remembered in Redis, at least; a "
            "crontab entry's claim is kept at least three gaps to its next run (a weekly "
            "entry's for three weeks), an interval entry's at least three intervals."
        ),
    )
    beat_clock_tolerance: float = Field(
        1.0,
        gt=0.0,
        le=3600.0,
        description=(
            "Seconds a beat replica's clock may disagree with the Redis clock: a crontab run "
            "due further ahead of the Redis clock is not claimed yet (it is held until then), "
            "and a replica whose clock is off by more logs a warning."
        ),
    )
    unique_ttl: float = Field(3600.0, gt=0.0, le=30 * 86400.0, description=UNIQUE_TTL)
    unique_confirm_window: float = Field(30.0, gt=0.0, le=3600.0, description=UNIQUE_CONFIRM_WINDOW)
    unique_confirm: bool = Field(True, description=UNIQUE_CONFIRM)
    on_duplicate: OnDuplicate = Field("existing", description=ON_DUPLICATE)
    unique_cancel_deadline: float = Field(
        30.0, gt=0.0, le=86400.0, description=UNIQUE_CANCEL_DEADLINE
    )
    redelivery_guard: bool = Field(
        False,
        description=(
            "Workers guard every delivery of every task (plain @app.task included) with a "
            "lease named redelivery:<task id>: while one copy of a task runs or waits for its "
            "ETA on a live worker, another delivery of the same message waits for its outcome "
            "(it runs if the first copy died unfinished, and is acked and dropped if it "
            "finished), and on the Redis transport the worker keeps its deliveries from being "
            "restored by visibility_timeout. Off by default: it costs a grant, a completion "
            "record and a release per task (see redelivery.md)."
        ),
    )
    redelivery_record_ttl: float = Field(
        7200.0,
        gt=0.0,
        le=30 * 86400.0,
        description=(
            "redelivery_guard: seconds the completion record of a finished delivery is kept, so "
            "that a copy redelivered after a lost ack is dropped. It must exceed the longest "
            "time a redelivery can take: the broker's visibility_timeout plus its restore "
            "sweep on Redis (the connection's loss on RabbitMQ)."
        ),
    )
    redelivery_recheck: float = Field(
        1.0,
        gt=0.0,
        le=60.0,
        description=(
            "redelivery_guard: seconds between two looks of a delivery that waits for another "
            "copy of its task (a look reads the completion record and tries the guard lease)."
        ),
    )
    node: str | None = Field(
        None,
        description=(
            "Node name used in owner ids. Default: the worker hostname inside a worker "
            "(celery@<host> unless -n), else '<program>:<kind>:<pid>@<host>' (kind: beat, "
            "cli, the celery subcommand such as shell, or proc), which no worker gets unless "
            "named so. A worker frees at start-up the leases of earlier incarnations of its "
            "node name: set node only to a name no other live process uses, and in a process "
            "that is not a worker to one without '@' (a worker's name always has one)."
        ),
    )

    @field_validator("key_prefix")
    @classmethod
    def _check_prefix(cls, value: str) -> str:
        if not _PREFIX_RE.fullmatch(value):
            # the value itself is added once, by config_error's "(got ...)"
            msg = "must be 1-64 characters from A-Z a-z 0-9 _ . : -"
            raise ValueError(msg)
        return value

    @field_validator("redis_url")
    @classmethod
    def _check_url(cls, value: str | None) -> str | None:
        if value is not None:
            parse_target(value)  # a ValueError names what is wrong with it
        return value

    @field_validator("redis_url")
    @classmethod
    def _check_url_options(cls, value: str | None) -> str | None:
        problem = None if value is None else url_problem(value)
        if problem is not None:
            raise ValueError(problem)
        return value

    @field_validator("node")
    @classmethod
    def _check_node(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            msg = "must not be empty"
            raise ValueError(msg)
        return value

    @model_validator(mode="after")
    def _check_cross_fields(self) -> LeaseSettings:
        if self.retry_max_delay < self.retry_delay:
            msg = (
                f"retry_max_delay ({self.retry_max_delay}s) must not be below "
                f"retry_delay ({self.retry_delay}s)"
            )
            raise ValueError(msg)
        problem = timing_problem(self)
        if problem is not None:
            raise ValueError(problem)
        return self

    @field_serializer("redis_url")
    def _dump_url(self, value: str | None) -> str | None:
        # dumps end up in logs and output: the real URL is read from .redis_url or .url only
        return None if value is None else safe_url(value)

    def __repr_args__(self) -> Iterator[tuple[str | None, Any]]:
        for name, value in super().__repr_args__():
            yield name, (safe_url(value) if name == "redis_url" and value is not None else value)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, AppConfSource(settings_cls), env_settings)

    @property
    def url(self) -> str:
        """The Redis URL in force (``redis_url`` once resolved)."""
        return self.redis_url or DEFAULT_REDIS_URL

    @property
    def margin_fraction(self) -> float:
        """1 - lost_margin: the part of a TTL a lease may go unconfirmed."""
        return 1.0 - self.lost_margin


def resolve_settings(app: Celery | None = None, **kwargs: Any) -> LeaseSettings:
    """Build the settings from keyword arguments, ``app.conf``, the environment and defaults.

    ``app.conf`` is read as Celery reads it: after ``app.config_from_object(obj,
    namespace="CELERY")`` a ``CELERY_LEASES_TTL`` of ``obj`` is the ``ttl`` setting (and wins
    over a ``leases_ttl`` of the same map), and a misspelt ``CELERY_LEASES_TTLL`` is refused
    like a misspelt ``leases_ttll``.

    Raises:
        LeaseConfigError: a value is invalid or a ``leases_*`` key is unknown; the message
            names the setting and the place it came from.
    """
    return _resolve(app, kwargs, conf_with_origins(app))


def _resolve(
    app: Celery | None, kwargs: Mapping[str, Any], found: Mapping[str, tuple[Any, str]]
) -> LeaseSettings:
    conf = {key: value for key, (value, _) in found.items()}
    origins = {key: origin for key, (_, origin) in found.items()}
    warn_unknown_env(LeaseSettings.model_fields)
    near = near_misses(app, LeaseSettings.model_fields)
    token = conf_origins.set(origins)
    try:
        with conf_context(conf):
            settings = LeaseSettings(**kwargs)
    except ValidationError as exc:
        text = config_error(exc, kwargs, conf, LeaseSettings.model_fields)
        if near:
            text += "; " + "; ".join(near)
        raise LeaseConfigError(text) from None
    finally:
        conf_origins.reset(token)
    if near:
        raise LeaseConfigError("invalid celery_leases settings: " + "; ".join(near))
    if settings.redis_url is None:
        settings = settings.model_copy(update={"redis_url": broker_default(app)})
    return settings


class AppSettings:
    """The settings of one app's ``Leases(app, **kwargs)``: resolved then, and at first use.

    Celery reads its configuration lazily, so a project may set ``app.conf.leases_ttl`` or
    call ``app.config_from_object`` after ``Leases(app)``. The settings are resolved at
    ``Leases(app)`` (an invalid value fails there) and once more at first use (the first
    :meth:`current`), which is what they then stay. A ``leases_*`` key changed after that is
    refused by :meth:`check` with a :class:`LeaseConfigError`, never half-applied.
    """

    def __init__(self, app: Celery, kwargs: Mapping[str, Any]) -> None:
        self._app = app
        self._kwargs = dict(kwargs)
        self._found = conf_with_origins(app)
        self._value = _resolve(app, self._kwargs, self._found)
        self._fixed = False
        self._lock = threading.Lock()
        self._conf: Any = None  # app.conf at first use (kept: an id could be reused)
        self._changes: dict[str, Any] = {}
        # a copy of every key set on the conf directly when _changes was taken: while the
        # conf's changes still equal it (one comparison in C, values by identity first), no
        # leases_* key can have changed
        self._all_changes: object = None

    @property
    def fixed(self) -> bool:
        """True once the settings were first used (they no longer change)."""
        return self._fixed

    def peek(self) -> LeaseSettings:
        """The settings as resolved last, without counting as a use."""
        return self._value

    def view(self) -> LeaseSettings:
        """The settings as they would be used now, without counting as a use.

        Once fixed, those in force; before, resolved again from the config and the
        environment as they are now (the same object when nothing changed), and still free
        to change until the first use.
        """
        if self._fixed:
            return self._value
        with self._lock:
            if not self._fixed:
                self._resolve_again()
        return self._value

    def current(self) -> LeaseSettings:
        """The settings in force; the first call resolves them again and fixes them."""
        if self._fixed:
            return self._value
        with self._lock:
            if not self._fixed:
                self._resolve_again()
                self._conf = loaded_conf(self._app)
                self._note_changes()
                self._fixed = True
        return self._value

    def _resolve_again(self) -> None:
        """Resolve from the config and the environment as they are now (under the lock);
        the same object when nothing changed, so the store made at Leases(app) stays."""
        found = conf_with_origins(self._app)
        value = _resolve(self._app, self._kwargs, found)
        if value != self._value:
            self._value = value
        self._found = found

    def check(self, *, full: bool = False) -> LeaseSettings:
        """:meth:`current`, refusing a ``leases_*`` key changed since the first use.

        The cheap form (every acquire) looks at what ``app.conf.x = ...``, ``app.conf.update``
        and a new ``config_from_object`` change; ``full=True`` (worker and beat start) reads
        every key again, config object included.

        Raises:
            LeaseConfigError: a setting changed after first use; the message names it.
        """
        settings = self.current()
        conf: Any = self._app.conf  # a new config_from_object makes a new (pending) one
        if not full and conf is self._conf and self._unchanged(conf):
            return settings
        found = conf_with_origins(self._app)
        if found != self._found:
            raise LeaseConfigError(self._changed_message(found))
        self._conf = loaded_conf(self._app)
        self._note_changes()
        return settings

    def _note_changes(self) -> None:
        self._changes = changes_of(self._conf)
        changes = self._conf.__dict__.get("changes")
        self._all_changes = dict(changes) if isinstance(changes, dict) else None

    def _unchanged(self, conf: Any) -> bool:
        """True if no ``leases_*`` key was set on ``conf`` since :meth:`_note_changes`."""
        changes = conf.__dict__.get("changes")
        try:
            if isinstance(changes, dict) and changes == self._all_changes:
                return True
        except Exception:  # a value whose == raises (an array, say): compare ours alone
            pass
        if changes_of(conf) != self._changes:
            return False
        self._all_changes = dict(changes) if isinstance(changes, dict) else None
        return True

    def _changed_message(self, found: Mapping[str, tuple[Any, str]]) -> str:
        names = sorted(
            set(found) ^ set(self._found)
            | {k for k in set(found) & set(self._found) if found[k][0] != self._found[k][0]}
        )
        parts = []
        for name in names:
            origin = (found.get(name) or self._found[name])[1]
            before, after = (_shown(name, side) for side in (self._found, found))
            parts.append(f"{origin} ({before} -> {after})")
        return (
            f"celery_leases settings of app {self._app.main!r} changed after their first use: "
            f"{'; '.join(parts)}. They are read once, at first use, and never half-applied: "
            "set them before the first lease (or restart the process)"
        )


def _shown(name: str, found: Mapping[str, tuple[Any, str]]) -> str:
    """The value of ``name`` in ``found`` for a message (a URL without its password)."""
    if name not in found:
        return "unset"
    value = found[name][0]
    if name == CONF_PREFIX + "redis_url" and isinstance(value, str):
        value = safe_url(value)
    return repr(value)


_cache: weakref.WeakKeyDictionary[Celery, LeaseSettings | AppSettings] = weakref.WeakKeyDictionary()


def get_settings(app: Celery) -> LeaseSettings:
    """The settings of ``app``: those of its ``Leases(app, ...)``, else resolved now."""
    try:
        held = _cache[app]
    except KeyError:
        settings = resolve_settings(app)
        _cache[app] = settings
        return settings
    return held.current() if isinstance(held, AppSettings) else held


def set_settings(app: Celery, settings: LeaseSettings | AppSettings) -> None:
    """Remember ``settings`` as the ones of ``app`` (called by ``Leases(app, ...)``)."""
    _cache[app] = settings
