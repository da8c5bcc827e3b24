"""LeasedTask: a Celery task that holds leases on the resources it touches while it runs.

User guide
==========

Declare the resources as ``str.format`` templates over the task's arguments::

    from celery import Celery
    from celery_leases import Leases, LeasedTask, Shared, current_leases

    app = Celery("proj", broker="redis://localhost:6379/0")
    leases = Leases(app)

    @app.task(base=LeasedTask, lease="analysis:{analysis_id}:step:{step}")
    def run_step(analysis_id, step="align"):
        (lease,) = current_leases()
        store.write(result, fence=lease.token)     # a store can refuse older tokens

    @app.task(base=LeasedTask,
              leases=["repo:{repo_id}", Shared("remote:{remote_id}"), Shared("api:{key}", limit=3)],
              lease_ttl=60, on_busy="retry")
    def sync(repo_id, remote_id, key): ...

Before the body runs, the worker takes every lease all or nothing (in one fixed order, so two
tasks that want the same set never deadlock); a heartbeat renews them every ``ttl / 3``; they
are released however the task ends.

Options (each also an app-wide setting, see the configuration reference):

- ``lease`` / ``leases``: one template, or a list of templates and :class:`Shared` ones. A field
  that is not a parameter of the task is an error when the task is declared.
- ``lease_ttl``: seconds a lease lives without renewal (setting ``ttl``).
- ``on_busy``: ``"retry"`` (default: retry with exponential backoff and jitter, without using
  the task's own ``max_retries``, until ``busy_timeout`` has passed, then fail with
  :class:`LeaseBusy`), ``"skip"`` (return a marker without running the body: see
  :func:`is_skipped`), ``"fail"`` (raise :class:`LeaseBusy`), ``"wait"`` (block the worker slot
  up to ``wait_timeout``, woken by the release), ``"defer"`` (park the task in Redis, in its
  resource's FIFO, and free the worker slot at once: its delivery ends without a result, and
  when the resource frees, the lease is reserved for it and it is published again with its
  own id and arguments; no retry is counted. See docs/parking.md).
- ``on_backend_error``: what a task does when Redis fails or cannot be reached as it takes its
  leases (or its unique claim): ``"retry"`` (default: ``self.retry`` with the same backoff as
  ``on_busy="retry"``; it counts against the task's ``max_retries``, after which
  :class:`LeaseBackendError` is raised) or ``"fail"`` (raise :class:`LeaseBackendError` at
  once). Celery's ``autoretry_for`` cannot do this: it wraps the body, and the leases are
  taken before the body runs.
- ``on_lost``: ``"interrupt"`` (default: :class:`LeaseLost` is raised inside the running body,
  as Celery raises ``SoftTimeLimitExceeded``) or ``"log"``.
- ``unique``: a template like a lease's; at most one copy of the task per rendered key is
  queued or running. A copy sent while the key is held (by ``delay``, ``send_task``, canvas,
  beat) is not sent; ``on_duplicate`` says what its sender gets: ``"existing"`` (default: the
  holder's ``AsyncResult``), ``"raise"`` (:class:`DuplicateTask`), ``"ignore"`` (a
  ``REJECTED`` result) or ``"cancel"`` (a copy running is asked to stop, ``LeaseRevoked`` in
  it, its claim force-released after ``unique_cancel_deadline``; the send becomes the one
  follow-up run after it; :func:`current_claim` is the run's claim). ``unique_ttl`` (setting
  ``unique_ttl``) bounds how long a claim waits in the queue; ``unique_confirm=False`` makes
  a send one script call, not two (a producer killed before its publish then blocks the key
  for ``unique_ttl``). ``unique_mode`` (also an ``apply_async``/beat entry option): ``"refuse"``
  (default, the above), ``"throttle"`` (also refused for ``unique_window`` seconds after an
  accepted send), ``"replace"`` (a send takes the place of the copy still queued),
  ``"keep_last"`` or ``"debounce"`` (``unique_window``, ``unique_max_wait``). See
  docs/unique.md::

      @app.task(base=LeasedTask, unique="report:{account_id}", on_duplicate="raise")
      def build_report(account_id): ...

- ``rate`` / ``rates``: a :class:`~celery_leases.Rate` or a list of them, fleet-wide rate
  limits taken after the leases, all or nothing; over a limit ``on_busy`` applies with the
  limiter's exact wait (``retry``: that countdown). See docs/limits.md.

What happens on each way a task can end:

======================================  =================================================
success, exception, ``self.retry``       released in the task's own ``finally``
soft time limit                          released in the ``finally`` (the body got the error)
hard time limit, ``revoke(terminate)``   the child's ``finally`` runs on SIGTERM; if the child
                                         is killed first, the worker's main process frees the
                                         dead child's leases through the owner registry
child killed with SIGKILL                the main process frees them when it replaces the child
whole worker killed                      freed when a worker with the same name starts again,
                                         or by the orphan reconcile, or by the TTL
======================================  =================================================

.. versionadded:: 0.1
"""

from __future__ import annotations

import inspect
import random
import threading
import time
from collections.abc import Mapping, Sequence
from contextvars import ContextVar
from typing import Any, ClassVar, Final, NoReturn, get_args

from celery import Task
from celery.exceptions import Retry
from celery.utils.log import get_logger

from ._interrupt import Interrupter
from ._lease import Lease, Shared, Want
from ._limiter import check_rates, limit_wants
from ._limits import Rate
from ._modes import UniqueMode, check_mode, check_unique_options, newest_arguments
from ._outcomes import SKIPPED_KEY, is_skipped
from ._taskflow import take_or_park
from ._templates import Template, plain_params
from ._unique import current_claim, release_claim, take_claim
from .app import Leases, find_leases, ttl_of
from .config import LeaseSettings, OnBackendError, OnBusy, OnDuplicate, OnLost, get_settings
from .exceptions import LeaseBackendError, LeaseBusy, LeaseConfigError, LeaseError, RateLimited

__all__ = ("LeasedTask", "current_claim", "current_leases", "is_skipped")

logger = get_logger(__name__)

#: message header carrying when a task first found its leases busy (Unix time)
BUSY_SINCE_HEADER: Final = "lease_busy_since"
BUSY_ATTEMPT_HEADER: Final = "lease_busy_attempt"

_current: ContextVar[tuple[Lease, ...]] = ContextVar("celery_leases_current", default=())
_extension_lock = threading.Lock()


def current_leases() -> tuple[Lease, ...]:
    """The leases of the running leased task, in declaration order (empty outside one).

    Correct under every pool: under ``--pool threads`` each thread sees its own task's leases.

    .. versionadded:: 0.1
    """
    return _current.get()


def _backoff(settings: LeaseSettings, attempt: int) -> float:
    """Countdown of retry number ``attempt`` (0 first): exponential, capped, "equal jitter"."""
    delay = min(settings.retry_max_delay, settings.retry_delay * 2.0 ** min(attempt, 64))
    return delay / 2 + random.uniform(0, delay / 2)


def _check_choice(task_name: str, option: str, value: object, allowed: tuple[str, ...]) -> None:
    if value is not None and value not in allowed:
        msg = f"task {task_name!r}: {option}={value!r} is not one of {', '.join(allowed)}"
        raise LeaseConfigError(msg)


def _check_seconds(task_name: str, option: str, value: object, *, zero_ok: bool) -> None:
    if value is None:
        return
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or value < 0 or (value == 0 and not zero_ok):  # type: ignore[operator]
        msg = f"task {task_name!r}: {option} must be a positive number of seconds, not {value!r}"
        raise LeaseConfigError(msg)


class LeasedTask(Task[Any, Any]):
    """A task that holds a lease on each resource it names while its body runs.

    See the module documentation for the options and policies.

    .. versionadded:: 0.1
    """

    lease: str | Shared | None = None
    leases: Sequence[str | Shared] | None = None
    lease_ttl: float | None = None
    on_busy: OnBusy | None = None
    on_lost: OnLost | None = None
    on_backend_error: OnBackendError | None = None
    busy_timeout: float | None = None
    wait_timeout: float | None = None
    unique: str | None = None
    unique_ttl: float | None = None
    on_duplicate: OnDuplicate | None = None
    unique_mode: UniqueMode | None = None
    unique_window: float | None = None
    unique_max_wait: float | None = None
    unique_cancel_deadline: float | None = None
    unique_confirm: bool | None = None
    rate: Rate | None = None
    rates: Sequence[Rate] | None = None

    _lease_templates: ClassVar[tuple[Template, ...]] = ()
    _lease_signature: ClassVar[inspect.Signature | None] = None
    #: the signature's ``(names, defaults)`` when every parameter is a plain one (positional
    #: or keyword), for binding without ``Signature.bind`` (see ``_bound_values``)
    _plain_params: ClassVar[tuple[tuple[str, ...], dict[str, Any]] | None] = None
    _unique_template: ClassVar[Template | None] = None
    #: True when the ``__call__`` after this class's in the MRO is Celery's own (no other
    #: base wraps the body): a traced call may then run the body as Celery runs a task
    #: without a ``__call__`` of its own (see ``_run_body``)
    _celery_call: ClassVar[bool] = True
    _rate_templates: ClassVar[tuple[tuple[Rate, Template], ...]] = ()

    #: a busy lease is an expected end (on_busy="fail", a "wait" or "retry" that ran out):
    #: Celery logs it at INFO without a traceback, not at ERROR
    throws: tuple[type[Exception], ...] = (LeaseBusy,)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not any(issubclass(LeaseBusy, t) for t in cls.throws):  # a task's own throws=
            cls.throws = (*cls.throws, LeaseBusy)
        cls._declare_leases()
        after = cls.__mro__[cls.__mro__.index(LeasedTask) + 1 :]
        cls._celery_call = next(k for k in after if "__call__" in k.__dict__) is Task

    @classmethod
    def _declare_leases(cls) -> None:
        name = cls.__dict__.get("name") or cls.__qualname__
        if cls.lease is not None and cls.leases is not None:
            msg = f"task {name!r}: give either lease= or leases=, not both"
            raise LeaseConfigError(msg)
        _check_choice(name, "on_busy", cls.on_busy, get_args(OnBusy))
        _check_choice(name, "on_lost", cls.on_lost, get_args(OnLost))
        _check_choice(name, "on_backend_error", cls.on_backend_error, get_args(OnBackendError))
        _check_seconds(name, "lease_ttl", cls.lease_ttl, zero_ok=False)
        _check_seconds(name, "busy_timeout", cls.busy_timeout, zero_ok=False)
        _check_seconds(name, "wait_timeout", cls.wait_timeout, zero_ok=True)
        _check_seconds(name, "unique_ttl", cls.unique_ttl, zero_ok=False)
        _check_choice(name, "on_duplicate", cls.on_duplicate, get_args(OnDuplicate))
        check_mode(
            name,
            cls.unique,
            cls.unique_mode,
            cls.unique_window,
            cls.on_duplicate,
            cls.unique_max_wait,
        )
        check_unique_options(name, cls.unique, cls.unique_cancel_deadline, cls.unique_confirm)
        if cls.unique is not None and not (isinstance(cls.unique, str) and cls.unique):
            msg = f"task {name!r}: unique= must be a non-empty str template, not {cls.unique!r}"
            raise LeaseConfigError(msg)
        if cls.lease is not None:
            items: Sequence[object] = [cls.lease]
        elif cls.leases is not None:
            if isinstance(cls.leases, (str, Shared)) or not isinstance(cls.leases, Sequence):
                msg = f"task {name!r}: leases= must be a list, not {cls.leases!r}"
                raise LeaseConfigError(msg)
            items = list(cls.leases)
            if not items:
                msg = f"task {name!r}: leases= is empty"
                raise LeaseConfigError(msg)
        else:
            items = []
        cls._lease_templates = ()
        cls._unique_template = None
        rates = check_rates(name, cls.rate, cls.rates)
        cls._rate_templates = ()
        if not items and cls.unique is None and not rates:
            return
        signature = cls._run_signature()
        cls._lease_signature = signature
        cls._plain_params = plain_params(signature)
        cls._lease_templates = tuple(Template(name, i, signature.parameters) for i in items)
        if cls.unique is not None:
            cls._unique_template = Template(name, cls.unique, signature.parameters, "unique")
        params = signature.parameters
        cls._rate_templates = tuple((r, Template(name, r.template, params, "rate")) for r in rates)

    @classmethod
    def _run_signature(cls) -> inspect.Signature:
        # the class that defines run says what it is: a function task's class holds a
        # staticmethod (or, bind=True, a function taking self), which a subclass inherits
        run = next((k.__dict__["run"] for k in cls.__mro__ if "run" in k.__dict__), None)
        if isinstance(run, staticmethod):
            return inspect.signature(run.__func__)
        if run is None:
            return inspect.Signature()
        signature = inspect.signature(run)
        params = list(signature.parameters.values())
        # a bound task's run (bind=True) and a class-based task's run take self first
        return signature.replace(parameters=params[1:]) if params else signature

    # --- per call -----------------------------------------------------------------------
    def _bound_values(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        plain = self._plain_params
        if plain is not None:
            # the hot path of every leased task: what bind() and apply_defaults() give for a
            # signature of plain parameters, when the arguments fit it (else bind() says why)
            names, defaults = plain
            if len(args) <= len(names):
                values = dict(zip(names, args, strict=False))  # args may be fewer
                if not any(k in values or k not in names for k in kwargs):
                    values.update(kwargs)
                    if len(values) == len(names):
                        return values
                    for name in names:
                        if name not in values:
                            if name not in defaults:
                                break
                            values[name] = defaults[name]
                    else:
                        return values
        signature = self._lease_signature or inspect.Signature()
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError as exc:
            msg = f"task {self.name!r}: arguments do not fit the task: {exc}"
            raise LeaseConfigError(msg) from None
        bound.apply_defaults()
        values = dict(bound.arguments)
        for param in signature.parameters.values():
            if param.kind is inspect.Parameter.VAR_KEYWORD:
                values.update(values.pop(param.name, {}))
        return values

    def _render_leases(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Want]:
        if not self._lease_templates:
            return []
        values = self._bound_values(args, kwargs)
        return [t.render(self.name, values) for t in self._lease_templates]

    def _unique_key(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
        """The rendered ``unique`` template for these arguments."""
        template = self._unique_template
        if template is None:
            msg = f"task {self.name!r} is not declared with unique="
            raise LeaseConfigError(msg)
        return template.render(self.name, self._bound_values(args, kwargs)).resource

    def _extension(self) -> Leases:
        ext = find_leases(self.app)
        if ext is not None:
            return ext
        with _extension_lock:  # two threads' first tasks: one Leases(app), the second is an error
            ext = find_leases(self.app)
            if ext is not None:
                return ext
            return self._make_extension()

    def _make_extension(self) -> Leases:
        logger.warning(
            "leases: Leases(app) was never created for app %r; creating it now. Create it "
            "next to the app so the worker lifecycle (start-up cleanup, reconcile) runs too.",
            self.app.main,
        )
        return Leases(self.app)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        request = self.request
        # unique= guards what is enqueued: a direct or eager call enqueues nothing
        unique = self._unique_template is not None and not (
            request.called_directly or request.is_eager
        )
        if not self._lease_templates and not unique and not self._rate_templates:
            return super().__call__(*args, **kwargs)
        wants = self._render_leases(args, kwargs)
        ext = self._extension()
        settings = ext.settings
        on_lost = self.on_lost or settings.on_lost
        task_id = request.id
        interrupter = Interrupter() if on_lost == "interrupt" else None
        if not unique or not task_id:
            return self._call_leased(ext, settings, wants, task_id, interrupter, args, kwargs)
        try:
            claim = take_claim(
                ext, self, task_id, request, args, kwargs, ttl_of(ext, self.lease_ttl), interrupter
            )
        except LeaseBackendError as exc:
            self._backend_failed(exc)
        if claim is None:
            return None  # a duplicate of a queued or running copy: not run (logged)
        args, kwargs, wants = newest_arguments(ext, self, task_id, args, kwargs, wants)
        try:
            return self._call_leased(ext, settings, wants, task_id, interrupter, args, kwargs)
        finally:
            release_claim(ext, task_id, claim)

    def _call_leased(
        self,
        ext: Leases,
        settings: LeaseSettings,
        wants: list[Want],
        task_id: str | None,
        interrupter: Interrupter | None,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """Acquire ``wants``, run the body, release them (however it ends)."""
        on_busy = self.on_busy or settings.on_busy
        wait: float | None = 0.0
        if on_busy == "wait":
            wait = self.wait_timeout if self.wait_timeout is not None else settings.wait_timeout
        if not wants and not self._rate_templates:
            if interrupter is None:
                return super().__call__(*args, **kwargs)
            with interrupter:
                return super().__call__(*args, **kwargs)
        request = self.request
        # on_busy="defer" (see _parking.py): a copy of a parked task is dropped there, and a
        # busy lease parks the task (Ignore: the delivery ends, the slot is free)
        deferring = on_busy == "defer" and bool(task_id)
        deferring = deferring and not (request.is_eager or request.called_directly)
        try:
            limits = (
                limit_wants(self, self._bound_values(args, kwargs)) if self._rate_templates else []
            )
            outcome = take_or_park(
                ext,
                ext,
                self,
                wants,
                limits,
                ttl=self.lease_ttl,
                wait=wait,
                on_lost=interrupter,
                deferring=deferring,
                args=args,
                kwargs=kwargs,
            )
        except LeaseBackendError as exc:
            self._backend_failed(exc)
        if isinstance(outcome, LeaseBusy):
            return self._busy(outcome, on_busy, args, kwargs)
        leases = outcome
        traced = self._traced()
        token = _current.set(tuple(leases))
        try:
            if interrupter is None:
                return self._run_body(traced, args, kwargs)
            with interrupter:
                return self._run_body(traced, args, kwargs)
        finally:
            _current.reset(token)
            ext.release(leases)  # hands the resource on to its next parked task

    def _traced(self) -> bool:
        """True if this call is the tracer's own (a worker's, or ``apply``'s), outside any
        leased body: its request, pushed by the tracer, is the only one on the stack."""
        return (
            self._celery_call
            and not _current.get()
            and len(self.request_stack) == 1
            and not self.request.called_directly
        )

    def _run_body(self, traced: bool, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run the task body. A traced call runs ``run`` directly, as Celery's tracer does for
        a task without a ``__call__`` of its own: the tracer pushed this call's request and
        the task already, and ``Task.__call__`` would only push a copy of both (a Context
        made per task, a third of what a lease adds to a trivial task besides its Redis calls).
        """
        if traced:
            return self.run(*args, **kwargs)
        return super().__call__(*args, **kwargs)

    # --- busy policies --------------------------------------------------------------------
    def _busy(
        self, busy: LeaseBusy, policy: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        if policy == "skip":
            logger.info("leases: %s[%s] skipped: %s", self.name, self.request.id, busy)
            if get_settings(self.app).skip_result == "none":
                return None
            return {SKIPPED_KEY: {"resource": busy.resource, "holder_task": busy.holder_task}}
        if policy in ("fail", "wait", "defer"):  # defer: busy on every attempt (rare)
            raise busy
        return self._retry_busy(busy, args, kwargs)

    def _retry_busy(self, busy: LeaseBusy, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        settings = get_settings(self.app)
        request = self.request
        if request.is_eager or request.called_directly:
            raise busy
        headers = _headers(request)
        now = self._busy_clock()
        since = float(headers.get(BUSY_SINCE_HEADER) or now)
        attempt = int(headers.get(BUSY_ATTEMPT_HEADER) or 0)
        limit = self.busy_timeout if self.busy_timeout is not None else settings.busy_timeout
        if now - since >= limit:
            logger.info(
                "leases: %s[%s] gives up: %s stayed busy for %.0fs (busy_timeout)",
                self.name,
                request.id,
                busy.resource,
                now - since,
            )
            raise busy
        # a rate limit knows its exact wait: no backoff, no jitter
        delay = busy.retry_after if isinstance(busy, RateLimited) else _backoff(settings, attempt)
        countdown = min(delay, max(0.0, since + limit - now) + 0.01)
        options = {BUSY_SINCE_HEADER: since, BUSY_ATTEMPT_HEADER: attempt + 1}
        # not self.retry(): that would count against the task's own max_retries
        sig = self.signature_from_request(
            request,
            args,
            kwargs,
            countdown=countdown,
            retries=request.retries,
            headers={**headers, **options},
        )
        sig.apply_async()
        # The one INFO line of a busy retry is Celery's own ("Task <name>[<id>] retry: ..."),
        # which logs the Retry's message: so the message says it all, and ours is DEBUG.
        message = f"retrying in {countdown:.1f}s: {busy}"
        logger.debug("leases: %s[%s] %s", self.name, request.id, message)
        # celery types `when` as numbers.Real, which mypy does not match with float
        raise Retry(message, exc=busy, when=countdown, sig=sig)  # type: ignore[arg-type]

    def _backend_failed(self, exc: LeaseBackendError) -> NoReturn:
        """Redis failed as the task took its leases: retry the task (on_backend_error)."""
        settings = get_settings(self.app)
        policy = self.on_backend_error or settings.on_backend_error
        request = self.request
        if policy == "fail" or request.is_eager or request.called_directly:
            raise exc
        countdown = _backoff(settings, request.retries)
        logger.warning(
            "leases: %s[%s] retries in %.1fs: Redis failed as it took its leases: %s",
            self.name,
            request.id,
            countdown,
            exc,
        )
        # the task's own retry: max_retries bounds an outage (then exc is raised)
        raise self.retry(exc=exc, countdown=countdown)

    def _busy_clock(self) -> float:
        """Now, on the clock busy_timeout is counted with: Redis's, shared by the fleet.

        The first-busy time travels between workers in a header, so it must not be read on one
        machine's wall clock and compared on another's: a worker whose clock jumped an hour
        ahead would give up every busy task at once, and one an hour behind would stamp tasks
        that every other worker then gives up. Only when Redis cannot tell the time (it just
        answered the acquire, so rarely) is the local clock used.
        """
        try:
            return self._extension().store.redis_time()
        except LeaseError as exc:
            logger.debug("leases: Redis clock unavailable, using the local clock: %s", exc)
            return time.time()


def _headers(request: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    raw = getattr(request, "headers", None)
    if isinstance(raw, Mapping):
        out.update(raw)
    for name in (BUSY_SINCE_HEADER, BUSY_ATTEMPT_HEADER):
        value = getattr(request, name, None)
        if value is not None:
            out[name] = value
    return {k: v for k, v in out.items() if k in (BUSY_SINCE_HEADER, BUSY_ATTEMPT_HEADER)}


#: the task options only LeasedTask acts on; a task of another class that sets one is adopted
LEASE_OPTIONS: Final = (
    "lease",
    "leases",
    "lease_ttl",
    "on_busy",
    "on_lost",
    "on_backend_error",
    "busy_timeout",
    "wait_timeout",
    "unique",
    "unique_ttl",
    "on_duplicate",
    "unique_mode",
    "unique_window",
    "unique_max_wait",
    "unique_cancel_deadline",
    "unique_confirm",
    "rate",
    "rates",
)


def adopt(task: object) -> bool:
    """Give a task declared with lease options but without ``base=LeasedTask`` its behaviour.

    ``@app.task(lease="x:{a}")`` makes a subclass of the app's task class with ``lease`` as a
    plain class attribute, which Celery never looks at. The task's class is replaced by a
    subclass of it and of LeasedTask (its own ``__call__``, a custom ``task_cls``'s included,
    still runs first; the leases are taken inside it), and the options are checked as at a
    LeasedTask declaration. True if ``task`` was adopted now.

    Raises:
        LeaseConfigError: an option is invalid, or the task's class cannot take the behaviour
            (the message names the task; declare it with ``base=LeasedTask``).
    """
    if isinstance(task, LeasedTask) or not isinstance(task, Task):
        return False
    cls = type(task)
    given = [o for o in LEASE_OPTIONS if getattr(cls, o, None) is not None]
    if not given:
        return False
    name = str(getattr(cls, "name", None) or cls.__qualname__)
    namespace: dict[str, Any] = {
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
        "__doc__": cls.__doc__,
        "name": name,
    }
    # the options stay where the user put them: on cls, which comes first in the MRO
    try:
        leased = type(str(cls.__name__), (cls, LeasedTask), namespace)
        task.__class__ = leased
    except TypeError as exc:  # an MRO or instance-layout conflict (e.g. __slots__)
        msg = (
            f"task {name!r} sets {', '.join(given)} but its class {cls.__qualname__} cannot be "
            f"given LeasedTask's behaviour ({exc}); declare it with base=LeasedTask"
        )
        raise LeaseConfigError(msg) from None
    logger.debug("leases: task %s given LeasedTask's behaviour for %s", name, ", ".join(given))
    return True


def unleased_tasks(app: Any) -> dict[str, list[str]]:
    """Tasks of ``app`` that set lease options without being :class:`LeasedTask`.

    On an app with ``Leases(app)`` they are adopted (see :func:`adopt`); on an app without it
    nothing would read their options. Returns task name -> the options it sets.
    """
    found: dict[str, list[str]] = {}
    for name, task in sorted(app.tasks.items()):
        if isinstance(task, LeasedTask) or not isinstance(task, Task):
            continue
        given = [o for o in LEASE_OPTIONS if getattr(type(task), o, None) is not None]
        if given:
            found[str(name)] = given
    return found


def adopt_tasks(app: Any) -> None:
    """Adopt (see :func:`adopt`) every task of ``app`` with lease options, now and later.

    Now: the tasks already made. Later: each task Celery makes (``_task_from_fun``, through
    which ``@app.task`` and ``@shared_task`` go, at once or when the app is finalized), and
    every registered task again after finalize (tasks declared before ``Leases(app)``);
    the worker's bootstep adopts every registered task once more at start. Idempotent.
    """
    for task in list(app._tasks.values()):
        adopt(task)  # may raise: nothing is installed yet
    make = app.__dict__.get("_task_from_fun")
    if make is None or not getattr(make, "_celery_leases", False):
        original = app._task_from_fun

        def _task_from_fun(fun: Any, *args: Any, **options: Any) -> Any:
            task = original(fun, *args, **options)
            adopt(task)
            return task

        _task_from_fun._celery_leases = True  # type: ignore[attr-defined]
        app._task_from_fun = _task_from_fun

        def _finalized(sender: Any = None, **kwargs: Any) -> None:
            for task in list(app._tasks.values()):
                adopt(task)

        app.on_after_finalize.connect(_finalized, weak=False)
