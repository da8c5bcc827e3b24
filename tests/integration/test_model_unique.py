"""A model-based (stateful) test of unique modes, cancel and revocation (issue 31).

``test_model.py`` drives the basic unique claim (claim, handover, unclaim); this machine
drives what was built on it: ``unique_mode`` ``"throttle"``, ``"replace"``, ``"keep_last"``
and ``"debounce"``, ``on_duplicate="cancel"`` and the revocation mark it writes (and
``LeaseStore.revoke`` of a running claim, the same mark), against a real, private Redis.

The parts, at the level the library's own code works at:

- **producers**: several producer processes, each an app with its own ``Leases`` (so its
  own store and its own record of claims whose send failed), sending with the real
  ``apply_async`` -> ``app.send_task`` wrapper -> ``_unique._publish_unique`` (claim,
  publish, confirm, give-back); the publish goes to the model's **broker**, a list;
- **workers**: simulated worker processes (owner identities) that take a message from the
  broker and do what ``LeasedTask.__call__`` does: ``unique_take`` (with keep_last's
  hand-on tombstone, a redelivered flag), ``newest_arguments``, then later the release and
  the hand-on of a parked follow-up (``_parking.hand_on_released``), or die. Renewals are a
  rule (``LeaseStore.renew``), not a heartbeat thread, so a holder can stall;
- **the pump**: ``_parking.pump`` of a worker, handing on due follow-ups (debounce, and the
  follow-up of a claim that ran out or was cleaned up).

One key per mode (``refuse``, ``throttle``, ``replace``, ``keep_last``, ``debounce``,
``cancel``); each send's arguments carry a sequence number, so the model knows whose
arguments a run runs with.

Faults (each a parameter of a rule):

- a lost reply of the claim (it ran, the caller got a timeout; the resend succeeds), a claim
  whose reply is lost and whose resend fails too (``LeaseBackendError`` with
  ``maybe_claimed``: a claim, a parked follow-up or a cancel may have been made), a claim
  request dropped; a confirm whose reply is lost (resent), a confirm that fails (the claim
  lapses within ``unique_confirm_window``);
- a publish that fails (the claim is given back), a producer that dies between its claim and
  its publish (nothing more of it reaches Redis: its claim is pending until the window);
- a lost reply of a worker's handover (read back and adopted, or given back and sent again)
  and of its release (a release that fails leaves the claim to its TTL; no hand-on then:
  the pump hands on once it ran out);
- a worker process that dies mid-run (its message is delivered again, flagged redelivered,
  as with ``acks_late`` and ``reject_on_worker_lost``); its claim stays until the reaper
  (``cleanup_owner(dead=True)``, a rule's choice) or its TTL frees it;
- a stalled holder (it stops renewing; its claim runs out while its body still runs);
- a message delivered twice (a redelivered copy of a message already taken);
- cancels and revocations at any point, renewals reporting them.

What the faults may legitimately cause (docs/unique.md), and so what the checks allow:

- a ``maybe_claimed`` send may have claimed, replaced, parked or cancelled: its arguments
  may run although it raised, and the copy it replaced stays replaced;
- a confirm that fails lets the claim lapse: a second copy may be sent, and one of the two
  copies is dropped at start by the worker guard;
- a dead producer's pending claim blocks its key up to ``unique_confirm_window``;
- a redelivered run of a copy whose process died mid-run runs again (it never finished);
- a run whose claim ran out (stalled, or past a cancel's deadline) still runs its body: it
  no longer counts as holding the key (what fencing is for).

Invariants, checked at each step and at the end of each example:

1. **at most one copy of a key runs at a time**: a copy runs from its take until its
   release, or until the model knows its claim is gone (released, freed by a cleanup,
   reported lost by a renewal) or *surely* ran out (``surely held`` until ``sent + ttl`` of
   its last confirmation, capped by a revocation's deadline counted from the revoking
   call's send: Redis cannot have run it out sooner). A take that succeeds while another
   run's claim is surely held is a violation. Tokens of a key's runs only grow.
2. **keep_last, debounce, cancel: nothing is lost, nothing runs twice**: at the end of an
   example (faults over, every run ended, the pump turned until nothing is parked), every
   accepted send's arguments ran, or a later send's did, in a run that took its claim after
   the send; the last accepted send's arguments ran; no send's arguments ran in two
   distinct task ids, nor twice in one unless its first run died; every run's arguments
   are of a send that was accepted or may have been (``maybe_claimed``).
3. **throttle**: no two accepted sends within ``unique_window`` of each other, by Redis
   time (the claim call of the second ends at least a window after the first's began),
   unless the first's publish failed and gave its window back.
4. **replace**: a task id replaced by an accepted send never runs.
5. **revocation** (cancel and ``revoke``): after a revocation with a deadline, no renewal
   extends the claim past the deadline (the claim's ``PTTL`` after a renewal is within the
   deadline as counted from the revoking call's reply), and the next holder's token is
   higher (invariant 1's token check).

The default run (``CI``) is derandomized: ``CELERY_LEASES_UMODEL_EXAMPLES`` examples
(default 20) of ``CELERY_LEASES_UMODEL_STEPS`` steps (default 20). A random search::

    CELERY_LEASES_UMODEL_EXAMPLES=300 CELERY_LEASES_MODEL_RANDOM=1 \\
        pytest tests/integration/test_model_unique.py -p no:cacheprovider

``CELERY_LEASES_MODEL_RANDOM``, ``CELERY_LEASES_MODEL_SHRINK``,
``CELERY_LEASES_MODEL_WITHOUT`` and ``CELERY_LEASES_MODEL_LOG`` mean what they mean for
``test_model.py``.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import hypothesis.strategies as st
import pytest
from celery import Celery
from celery.result import AsyncResult
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from redis import Redis
from redis.exceptions import TimeoutError as RedisTimeoutError

from celery_leases import LeasedTask, Leases, _parking
from celery_leases._claims import Claimed, ClaimHolder
from celery_leases._identity import Identity
from celery_leases._lease import Held
from celery_leases._modes import UNIQUE_HEADER, header, keeps_last, newest_arguments
from celery_leases._parking import DONE_KEEP_MS, PARKED_HEADER, tombstone
from celery_leases._protocol import Script, Sleep
from celery_leases._redis_server import RedisServer
from celery_leases.exceptions import DuplicateTask, LeaseBackendError
from tests.integration.test_model import (
    EXAMPLES_RUN,
    _run,
    _trace,
    event,
    traced,
    violated,
)

EXAMPLES = int(os.environ.get("CELERY_LEASES_UMODEL_EXAMPLES", "20"))
STEPS = int(os.environ.get("CELERY_LEASES_UMODEL_STEPS", "25"))

#: the ttl setting (every owner's liveness) and a running claim's lease ttl
LIVENESS = 0.6
CLAIM_TTL = 0.6
#: unique_confirm_window: longer than the throttle window (a pending window covers it)
CONFIRM_WINDOW = 1.0
UNIQUE_TTL = 5.0
WINDOW = 0.3  # throttle
QUIET = 0.15  # debounce
MAX_WAIT = 0.6
CANCEL = 0.4  # unique_cancel_deadline
HANDON = 0.4
#: ms rounding of TTLs and clock reads
SLACK = 0.005
MODES = ("refuse", "throttle", "replace", "keep_last", "debounce", "cancel")
FOLLOWING = ("keep_last", "debounce", "cancel")
PRODUCERS = 2
NODES = ("w0@umodel", "w1@umodel")
SLOTS = 2
SETTLE = 20.0
SEND_FAULTS = (
    "none",
    "claim lost",
    "claim lost twice",
    "claim dropped",
    "confirm lost",
    "confirm fails",
    "publish fails",
    "producer dies",
)
TAKE_FAULTS = ("none", "handover lost", "twice")
END_FAULTS = ("none", "release lost", "release fails")


class PublishFailed(Exception):
    """The broker refused the message (the model's publish failure)."""


class ProducerDied(BaseException):
    """The producer process died between its claim and its publish."""


@dataclass
class Msg:
    mode: str
    task_id: str
    args: tuple[Any, ...]
    headers: dict[str, Any]
    redelivered: bool = False


@dataclass
class Sent:
    """One send of the model, and what became of it."""

    mode: str
    seq: int
    task_id: str
    step: int
    outcome: str  # accepted, refused, maybe, failed
    before: float = 0.0  # Redis time (s) before the send
    after: float = 0.0  # and after it


@dataclass(eq=False)
class Owner:
    ident: Identity


@dataclass(eq=False)
class Run:
    """A copy that took its claim: it runs from then until its release (or death)."""

    mode: str
    task_id: str
    seq: int
    owner: Owner
    held: Held
    step: int
    sure_until: float
    may_until: float
    msg: Msg
    cap_sure: float = math.inf  # a revocation's deadline, counted from its send
    cap_may: float = math.inf  # and from its reply (the latest it can be)
    gone: bool = False  # surely no longer in Redis
    ended: bool = False
    died: bool = False
    stalled: bool = False

    def surely_held(self, at: float) -> bool:
        return not self.gone and at < min(self.sure_until, self.cap_sure) - SLACK


@dataclass(eq=False)
class Process:
    """A producer process (or the workers' Leases): its app, its store, its faults."""

    app: Celery
    ext: Leases
    tasks: dict[str, Any]
    plan: dict[str, list[str | None]] = field(default_factory=dict)
    publish: str = "none"
    dead: bool = False
    #: the sends of each of its claim calls: (sent, reply, outcome or None, a reply was lost)
    claims: list[tuple[float, float, Any, bool]] = field(default_factory=list)


def _body(k: str, n: int) -> None:
    """Never called: the model runs no task bodies."""


def _declare(app: Celery) -> dict[str, Any]:
    tasks = {}
    for mode in MODES:
        opts: dict[str, Any] = {"base": LeasedTask, "name": f"umodel.{mode}"}
        opts["unique"] = mode + ":{k}"
        if mode == "cancel":
            opts.update(on_duplicate="cancel", unique_cancel_deadline=CANCEL)
        else:
            if mode != "refuse":
                opts["unique_mode"] = mode
            if mode in ("refuse", "throttle", "replace"):
                opts["on_duplicate"] = "raise"
        if mode == "throttle":
            opts["unique_window"] = WINDOW
        if mode == "debounce":
            opts.update(unique_window=QUIET, unique_max_wait=MAX_WAIT)
        tasks[mode] = app.task(**opts)(_body)
    return tasks


class UniqueModel(RuleBasedStateMachine):
    server: RedisServer
    make_prefix: Callable[[], str]

    def __init__(self) -> None:
        super().__init__()
        self.prefix = type(self).make_prefix()
        self.redis = Redis.from_url(type(self).server.url, decode_responses=True)
        self.broker: list[Msg] = []
        self.step = 0
        self.seq = 0
        self.sends: list[Sent] = []
        self.runs: list[Run] = []
        self.replaced: set[str] = set()
        self.max_token: dict[str, int] = {}
        self.pids = iter(range(2000, 1_000_000))
        self.producers = [self._process(f"p{i}") for i in range(PRODUCERS)]
        self.dead: list[Process] = []  # kept: their ids stay theirs
        self.worker = self._process("w")
        self.slots = {(n, s): self._owner(n) for n in range(len(NODES)) for s in range(SLOTS)}
        _trace.clear()
        EXAMPLES_RUN["examples"] += 1

    # --- set-up ---------------------------------------------------------------------------
    def _owner(self, node: int) -> Owner:
        return Owner(Identity(NODES[node], "inc0", next(self.pids)))

    def _process(self, name: str) -> Process:
        app = Celery(f"umodel-{self.prefix}-{name}", set_as_current=False)
        proc: Process
        machine = self

        def capture(
            task_name: str,
            args: Any = None,
            kwargs: Any = None,
            countdown: Any = None,
            eta: Any = None,
            task_id: str | None = None,
            *rest: Any,
            **options: Any,
        ) -> Any:
            if proc.publish == "fails":
                event("publish failed")
                raise PublishFailed("model: the broker refused it")
            if proc.publish == "dies":
                proc.dead = True
                event("producer died before its publish")
                raise ProducerDied
            assert task_id is not None
            mode = task_name.split(".", 1)[1]
            headers = dict(options.get("headers") or {})
            if kwargs:
                args = (kwargs.get("k", args[0] if args else None), kwargs.get("n"))
            machine.broker.append(Msg(mode, task_id, tuple(args or ()), headers))
            event(f"published {mode}" + (" (a hand-on)" if headers.get(PARKED_HEADER) else ""))
            return AsyncResult(task_id, app=app)

        app.send_task = capture  # type: ignore[method-assign]
        ext = Leases(
            app,
            redis_url=type(self).server.url,
            key_prefix=self.prefix,
            ttl=LIVENESS,
            unique_ttl=UNIQUE_TTL,
            unique_confirm_window=CONFIRM_WINDOW,
            handon_timeout=HANDON,
            socket_timeout=5.0,
            node=f"{name}@umodel",
        )
        tasks = _declare(app)
        app.finalize()
        proc = Process(app, ext, tasks)
        store = ext.store
        real_execute = store._execute
        real_claim = store.unique_claim

        def execute(op: Any) -> Any:
            if type(op) is Sleep:
                return real_execute(op)
            if proc.dead:
                raise RedisTimeoutError("model: the process is dead")
            fault = None
            for call in getattr(op, "calls", ()):
                if type(call) is Script and proc.plan.get(call.name):
                    fault = proc.plan[call.name].pop(0)
                    break
            if fault == "dropped":
                event("fault: a request dropped")
                raise RedisTimeoutError("model: timed out before it reached Redis")
            reply = real_execute(op)
            if fault == "lost":
                event("fault: a reply lost")
                raise RedisTimeoutError("model: the reply was lost after the call ran")
            return reply

        def claim(*args: Any, **kwargs: Any) -> Any:
            lost = "lost" in (proc.plan.get("unique_claim") or [])[:1]
            sent = time.monotonic()
            try:
                outcome = real_claim(*args, **kwargs)
            except BaseException:
                proc.claims.append((sent, time.monotonic(), None, lost))
                raise
            proc.claims.append((sent, time.monotonic(), outcome, lost))
            return outcome

        store._execute = execute  # type: ignore[method-assign]
        store.unique_claim = claim  # type: ignore[method-assign]
        return proc

    def teardown(self) -> None:
        try:
            self._settle()
        finally:
            for proc in [*self.producers, *self.dead, self.worker]:
                proc.ext.store.close()
            self.redis.close()

    # --- helpers --------------------------------------------------------------------------
    def _rtime(self) -> float:
        s, us = self.redis.time()
        return s + us / 1e6

    def resource(self, mode: str) -> str:
        return self.worker.ext.store.keys.unique_resource(f"{mode}:0")

    def _live_runs(self, mode: str) -> list[Run]:
        return [r for r in self.runs if r.mode == mode and not r.gone]

    def _revoked(self, mode: str, token: int | None, sent: float, reply: float, d: float) -> None:
        """A revocation with deadline ``d`` (s) sent at ``sent``: the claim of ``token`` (None:
        whichever run holds it) now ends by the deadline."""
        for run in self._live_runs(mode):
            if token is None or run.held.token <= token:
                run.cap_sure = min(run.cap_sure, sent + d)
                run.sure_until = min(run.sure_until, sent + d)
                if token is not None:
                    run.cap_may = min(run.cap_may, reply + d)
                    run.may_until = min(run.may_until, reply + d)

    # --- producers ------------------------------------------------------------------------
    @rule(
        producer=st.integers(0, PRODUCERS - 1),
        mode=st.sampled_from(MODES),
        fault=st.sampled_from(SEND_FAULTS),
        burst=st.integers(1, 3),
    )
    @traced
    def send(self, producer: int, mode: str, fault: str, burst: int) -> None:
        """A producer sends ``burst`` copies of the key of ``mode``; the first meets ``fault``."""
        for i in range(burst):
            self._send(producer, mode, fault if i == 0 else "none")

    def _send(self, producer: int, mode: str, fault: str) -> None:
        proc = self.producers[producer]
        plan = {
            "claim lost": {"unique_claim": ["lost"]},
            "claim lost twice": {"unique_claim": ["lost", "lost"]},
            "claim dropped": {"unique_claim": ["dropped", "dropped"]},
            "confirm lost": {"unique_claim": [None, "lost"]},
            "confirm fails": {"unique_claim": [None, "lost", "lost"]},
        }.get(fault, {})
        proc.plan = {k: list(v) for k, v in plan.items()}
        proc.publish = {"publish fails": "fails", "producer dies": "dies"}.get(fault, "none")
        self.seq += 1
        self.step += 1
        seq = self.seq
        task = proc.tasks[mode]
        before = self._rtime()
        proc.claims.clear()
        rec = Sent(mode, seq, "", self.step, "accepted", before)
        try:
            result = task.apply_async(("0", seq))
            rec.task_id = result.id
            event(f"send {mode}: accepted")
        except DuplicateTask as dup:
            rec.outcome = "refused"
            event(f"send {mode}: refused ({dup.state})")
        except LeaseBackendError as exc:
            rec.outcome = "maybe" if exc.maybe_claimed else "failed"
            event(f"send {mode}: LeaseBackendError, maybe_claimed={exc.maybe_claimed}")
        except PublishFailed:
            rec.outcome = "failed"
        except ProducerDied:
            rec.outcome = "maybe"  # its claim may be pending, nothing published
            self.dead.append(proc)
            self.producers[producer] = self._process(f"p{producer}-{len(self.dead)}")
        finally:
            proc.plan, proc.publish = {}, "none"
        rec.after = self._rtime()
        if rec.outcome == "accepted" and isinstance(proc.claims[-1][2], ClaimHolder):
            rec.outcome = "refused"  # on_duplicate "existing" (a cancel of a queued copy)
            event(f"send {mode}: refused, the existing copy's result")
        self.sends.append(rec)
        for sent, reply, outcome, lost in proc.claims:
            if isinstance(outcome, Claimed) and outcome.cancels is not None:
                token = int(outcome.cancels.split(" ", 1)[0])
                event("cancel: a running copy is asked to stop")
                self._revoked(mode, token, sent, reply, outcome.deadline)
            elif mode == "cancel" and (lost or outcome is None):
                # a lost claim reply of a cancel may have cancelled the running copy
                self._revoked(mode, None, sent, reply, CANCEL)
            if isinstance(outcome, Claimed) and outcome.replaced and rec.outcome == "accepted":
                self.replaced.add(outcome.replaced)
                event("replace: a queued copy replaced")
        if mode == "throttle" and rec.outcome == "accepted":
            self._check_throttle(rec)

    def _check_throttle(self, rec: Sent) -> None:
        for other in self.sends[:-1]:
            if other.mode != "throttle" or other.outcome != "accepted":
                continue
            if rec.after - other.before < WINDOW - SLACK:
                violated(
                    f"throttle: sends {other.seq} and {rec.seq} both accepted within "
                    f"{rec.after - other.before:.3f}s < unique_window {WINDOW}"
                )

    @rule(
        mode=st.sampled_from(MODES),
        producer=st.integers(0, PRODUCERS - 1),
        burst=st.integers(1, 4),
        fault=st.sampled_from(SEND_FAULTS),
        end=st.sampled_from(("no", "die", *END_FAULTS)),
        then=st.booleans(),
    )
    @traced
    def round(self, mode: str, producer: int, burst: int, fault: str, end: str, then: bool) -> None:
        """A copy of ``mode``'s key is sent and started (if the key is free), ``burst`` more
        sends come while it runs (the last meets ``fault``), then it ends (``end``: released,
        its release's reply lost or failed, its process dead) or not yet; ``then``: a worker
        takes every message in the broker."""
        self._send(producer, mode, "none")
        todo = [m for m in self.broker if m.mode == mode]
        if todo:
            self.broker.remove(todo[0])
            self._deliver(todo[0], self.slots[(0, 0)], "none")
        for i in range(burst):
            self._send(producer, mode, fault if i == burst - 1 else "none")
        running = [r for r in self.runs if r.mode == mode and not r.ended]
        if running:  # its heartbeat turns: a cancel is reported (and stops it, or not)
            self._renew(running[0], end == "none")
        running = [r for r in running if not r.ended]
        if running and end == "die":
            self._die(running[0], reaper=True)
        elif running and end != "no":
            self._finish(running[0], end)
        if then:
            todo, self.broker = self.broker, []
            for msg in todo:
                self._deliver(msg, self.slots[(1, 0)], "none")

    # --- workers --------------------------------------------------------------------------
    @rule(
        pick=st.integers(0, 1000),
        node=st.integers(0, len(NODES) - 1),
        slot=st.integers(0, SLOTS - 1),
        fault=st.sampled_from(TAKE_FAULTS),
    )
    @traced
    def deliver(self, pick: int, node: int, slot: int, fault: str) -> None:
        """A worker process takes a message and starts it (``twice``: the broker keeps a
        redelivered copy of it, as a visibility timeout or a lost ack would)."""
        if not self.broker:
            return
        msg = self.broker.pop(pick % len(self.broker))
        if fault == "twice":
            self.broker.append(Msg(msg.mode, msg.task_id, msg.args, msg.headers, True))
        self._deliver(msg, self.slots[(node, slot)], fault)

    def _deliver(self, msg: Msg, owner: Owner, fault: str) -> None:
        self.step += 1
        w = self.worker
        task = w.tasks[msg.mode]
        task.push_request(
            id=msg.task_id,
            retries=0,
            delivery_info={"redelivered": msg.redelivered, "routing_key": "celery"},
            headers=msg.headers,
            args=msg.args,
            kwargs={},
            **msg.headers,
        )
        try:
            request = task.request
            key = header(request, UNIQUE_HEADER)
            assert isinstance(key, str), msg
            handed = None
            if keeps_last(task, request) and header(request, PARKED_HEADER):
                again = "1" if msg.redelivered else ""
                handed = (tombstone(msg.task_id, 0), DONE_KEEP_MS, again)
            if fault == "handover lost":
                w.plan = {"unique_handover": ["lost"]}
            sent = time.monotonic()
            try:
                outcome = w.ext.store.unique_take(
                    key, msg.task_id, owner.ident, CLAIM_TTL, CLAIM_TTL + 1.0, handed
                )
            except LeaseBackendError:
                event("take: Redis failed (the task retries)")
                self.broker.append(msg)
                return
            finally:
                w.plan = {}
            reply = time.monotonic()
            if isinstance(outcome, ClaimHolder):
                event(f"take {msg.mode}: not run ({outcome.state})")
                return
            held = outcome
            args, _kwargs, _ = newest_arguments(w.ext, task, msg.task_id, msg.args, {}, [])
            self._started(msg, owner, held, int(args[1]), sent, reply)
        finally:
            task.pop_request()

    def _started(
        self, msg: Msg, owner: Owner, held: Held, seq: int, sent: float, reply: float
    ) -> None:
        event(f"run {msg.mode}" + (" (redelivered)" if msg.redelivered else ""))
        resource = held.resource
        for other in self._live_runs(msg.mode):
            if other.surely_held(reply):
                violated(
                    f"{msg.mode}: {msg.task_id} took the claim (token {held.token}) while "
                    f"{other.task_id}'s (token {other.held.token}) is surely held"
                )
        if held.token <= self.max_token.get(resource, 0):
            violated(f"{msg.mode}: token {held.token} does not grow past {self.max_token}")
        self.max_token[resource] = held.token
        if msg.task_id in self.replaced:
            violated(f"replace: {msg.task_id} runs although a later send replaced it")
        for run in self.runs:
            if run.task_id == msg.task_id and not (run.died or msg.redelivered):
                violated(f"{msg.mode}: {msg.task_id} runs again, its first run did not die")
        run = Run(
            msg.mode,
            msg.task_id,
            seq,
            owner,
            held,
            self.step,
            sent + CLAIM_TTL,
            reply + CLAIM_TTL,
            msg,
        )
        self.runs.append(run)

    def _running(self, pick: int) -> Run | None:
        running = [r for r in self.runs if not r.ended]
        return running[pick % len(running)] if running else None

    @rule(pick=st.integers(0, 1000), fault=st.sampled_from(END_FAULTS))
    @traced
    def finish(self, pick: int, fault: str) -> None:
        """A run ends (however: its ``finally``): its claim is released, handing on."""
        run = self._running(pick)
        if run is not None:
            self._finish(run, fault)

    def _finish(self, run: Run, fault: str) -> None:
        self.step += 1
        run.ended = True
        w = self.worker
        w.plan = {
            "release": {"release lost": ["lost"], "release fails": ["lost"] * 4}.get(fault, [])
        }
        try:
            w.ext.store.release([run.held])
        except LeaseBackendError:
            event("release failed: the claim runs out by its TTL")
            run.sure_until = -math.inf  # it may have run
            return
        finally:
            w.plan = {}
        run.gone = True
        _parking.hand_on_released(w.ext, [run.held.resource])

    @rule(pick=st.integers(0, 1000), stop=st.booleans())
    @traced
    def renew(self, pick: int, stop: bool) -> None:
        """The heartbeat of a run that does not stall renews its claim; a revocation it
        reports ends the run (``stop``: ``on_lost="interrupt"``) or not (``"log"``)."""
        run = self._running(pick)
        if run is not None:
            self._renew(run, stop)

    def _renew(self, run: Run, stop: bool) -> None:
        if run.stalled or run.died:
            return
        sent = time.monotonic()
        lost = self.worker.ext.store.renew([run.held], run.owner.ident.owner, 5.0)
        reply = time.monotonic()
        if lost:
            event(f"renew: lost ({run.mode})")
            if run.surely_held(sent):
                violated(f"{run.mode}: {run.task_id}'s claim lost while surely held")
            run.gone = True
            return
        run.sure_until = max(run.sure_until, sent + CLAIM_TTL)
        run.may_until = min(reply + CLAIM_TTL, run.cap_may)
        if run.held.revoked is not None:
            event("renew: reports a revocation")
            if run.cap_may < math.inf:
                before = time.monotonic()
                left = self.redis.pttl(
                    self.worker.ext.store.engine.resource_keys(run.held.resource).exclusive
                )
                if left > 0 and left / 1000 > run.cap_may - before + SLACK:
                    violated(
                        f"{run.mode}: a renewal extended {run.task_id}'s revoked claim "
                        f"past its deadline ({left} ms left, deadline in "
                        f"{run.cap_may - before:.3f}s)"
                    )
            if stop:
                self._finish(run, "none")

    @rule(pick=st.integers(0, 1000))
    @traced
    def stall(self, pick: int) -> None:
        """A holder stops renewing (a stalled process): its claim runs out."""
        run = self._running(pick)
        if run is not None:
            run.stalled = True

    @rule(pick=st.integers(0, 1000), reaper=st.booleans())
    @traced
    def die(self, pick: int, reaper: bool) -> None:
        """The process running a copy dies (``kill -9``): its message comes back flagged
        redelivered; ``reaper``: the main process frees its leases, else its TTL does."""
        run = self._running(pick)
        if run is not None:
            self._die(run, reaper)

    def _die(self, run: Run, reaper: bool) -> None:
        self.step += 1
        run.ended = run.died = True
        m = run.msg
        self.broker.append(Msg(m.mode, m.task_id, m.args, m.headers, True))
        for key, owner in self.slots.items():
            if owner is run.owner:
                self.slots[key] = self._owner(NODES.index(owner.ident.node))
        for other in self.runs:
            if other.owner is run.owner and not other.ended:
                other.ended = other.died = True
        if reaper:
            report = self.worker.ext.store.cleanup_owner(run.owner.ident.owner, dead=True)
            _parking.publish_taken_over(self.worker.ext, report)
            freed = {res for _, res in report.released}
            for other in self.runs:
                if other.owner is run.owner and other.held.resource in freed:
                    other.gone = True
            event(f"reaper freed {len(freed)}")

    @rule(mode=st.sampled_from(MODES), deadline=st.sampled_from((0.1, 0.4)))
    @traced
    def revoke(self, mode: str, deadline: float) -> None:
        """``LeaseStore.revoke`` of the key's claim (the mark a cancel writes)."""
        sent = time.monotonic()
        revoked = self.worker.ext.store.revoke(self.resource(mode), "model", deadline)
        reply = time.monotonic()
        if revoked.tokens:
            event("revoke: a claim revoked")
            self._revoked(mode, max(revoked.tokens), sent, reply, revoked.deadline)

    @rule()
    @traced
    def pump(self) -> None:
        _parking.pump(self.worker.ext)

    @rule(seconds=st.sampled_from((0.05, 0.2, 0.45)))
    @traced
    def time_passes(self, seconds: float) -> None:
        time.sleep(seconds)

    @invariant()
    def one_copy_runs(self) -> None:
        now = time.monotonic()
        for mode in MODES:
            held = [r for r in self._live_runs(mode) if r.surely_held(now)]
            if len(held) > 1:
                violated(f"{mode}: two claims surely held: {[r.task_id for r in held]}")

    # --- the end of an example ------------------------------------------------------------
    def _settle(self) -> None:
        """Faults over: every run ends, every message is delivered, the pump turns, until
        nothing is parked; then nothing sent to a follow-up mode is lost."""
        w = self.worker
        owner = self.slots[(0, 0)]
        deadline = time.monotonic() + SETTLE
        while True:
            for run in self.runs:
                if not run.ended:
                    self._finish(run, "none")
            while self.broker:
                self._deliver(self.broker.pop(0), owner, "none")
            busy = [r for r in self.runs if not r.ended]
            if not self.broker and not busy and not _parking.list_parked(w.ext):
                break
            if time.monotonic() > deadline:
                violated(f"never settled: {_parking.list_parked(w.ext)}")
            _parking.pump(w.ext)
            time.sleep(0.05)
        self._check_followers()

    def _check_followers(self) -> None:
        for mode in MODES:
            sends = [s for s in self.sends if s.mode == mode]
            runs = [r for r in self.runs if r.mode == mode]
            possible = {s.seq for s in sends if s.outcome in ("accepted", "maybe")}
            by_seq: dict[int, list[Run]] = {}
            for run in runs:
                if run.seq not in possible:
                    violated(f"{mode}: a run with arguments {run.seq} of no accepted send")
                by_seq.setdefault(run.seq, []).append(run)
            for seq, same in by_seq.items():
                ids = {r.task_id for r in same}
                if len(ids) > 1:
                    violated(f"{mode}: the arguments of send {seq} ran in {sorted(ids)}")
            if mode not in FOLLOWING:
                continue
            accepted = [s for s in sends if s.outcome == "accepted"]
            for s in accepted:
                if not any(r.seq >= s.seq and r.step > s.step for r in runs):
                    violated(
                        f"{mode}: send {s.seq} ({s.task_id}) is lost: no run after it with "
                        f"its arguments or a later send's; runs {[(r.seq, r.step) for r in runs]}"
                    )
            if accepted:
                event(f"settled {mode}: {min(len(accepted), 4)} accepted")


@pytest.fixture
def umodel_server(make_redis_server: Callable[..., RedisServer]) -> RedisServer:
    return make_redis_server()


def test_unique_modes_keep_their_invariants(umodel_server: RedisServer, leases_prefix: str) -> None:
    _run(UniqueModel, umodel_server, leases_prefix, EXAMPLES, STEPS, "u")
