"""The fault suite's ledger: what every task body did, kept in a Redis that no fault touches.

The ledger lives on the shared test Redis (db 15) under one key prefix per scenario, never on
the Redis under test, so it survives the restarts, pauses and cut connections it records.
Times come from the ledger Redis's clock (``TIME`` inside its scripts): one clock for the
workers and the test process.

What it records, per scenario:

- **overlaps**: each body *enters* a resource (the holder is added to ``inside:<resource>``)
  and *leaves* it in a ``finally``. Entering while another holder is inside whose process is
  still alive is an overlap. A holder whose process is dead (kill -9) left no ``finally``
  behind; it is dropped, not counted: a dead process runs no code.
- **the fenced store**: every body writes through the library's own
  :class:`~celery_leases.FencedRedis` (what users get), which accepts a write only if its
  fencing token is at least the last accepted token of the resource; the ledger counts the
  accepted writes and logs every refused one (a *stale writer*) with the token that beat it.
- **token regressions**: a grant whose token is not above every token that entered the
  resource before it.
- **completions** (a set of task ids, with the first completion time), body runs, retries by
  policy (lease lost inside the body, Redis unreachable at acquire) and task failures.
- **deliveries**: every message a worker publishes for a task (a retry, a busy retry) carries
  a message id of its own (the header ``faults_msg``; the test's first message has none:
  ``first``); the ledger keeps the last message published for each task id, and every message
  a worker *received* (Celery's ``task_received``, in the worker's main process, once the
  transport handed it over). A task that never completed is then either *received and never
  finished* (a loss of ours) or its last message was *never received by any worker* (a loss
  of the broker, see docs/faults.md).
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import redis

from celery_leases import FencedRedis, StaleFence

#: the message header that names each message a worker publishes (see ``Ledger.published``)
MESSAGE_HEADER: Final = "faults_msg"
#: the message id of a task's first message, sent by the test process without that header
FIRST_MESSAGE: Final = "first"

#: enter a resource: add the holder, bump the run count and check the token's order.
#: KEYS: inside hash, runs counter, max token, regressions counter, per-pid set, entered zset,
#:       the resource's entered zset
#: ARGV: member "<task>|<token>", pid, token, resource
#: returns the other holders, flat: member, pid, member, pid, ...
ENTER_LUA: Final = """
local t = redis.call('TIME')
local ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[6], ms, ARGV[4] .. '|' .. ARGV[1])
redis.call('ZADD', KEYS[7], ms, ARGV[1])
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('INCR', KEYS[2])
redis.call('SADD', KEYS[5], ARGV[1] .. '|' .. ARGV[4])
local top = tonumber(redis.call('GET', KEYS[3]) or '0')
local token = tonumber(ARGV[3])
if token <= top then
  redis.call('INCR', KEYS[4])
else
  redis.call('SET', KEYS[3], ARGV[3])
end
local others = {}
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  if all[i] ~= ARGV[1] then
    others[#others + 1] = all[i]
    others[#others + 1] = all[i + 1]
  end
end
return others
"""

#: record that a task completed: first completion time (ms), completion count.
#: KEYS: done zset, completions counter   ARGV: task id
DONE_LUA: Final = """
local t = redis.call('TIME')
local ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[1], 'NX', ms, ARGV[1])
redis.call('INCR', KEYS[2])
return ms
"""

#: push a timestamped event. KEYS: list   ARGV: text   returns the time in ms
EVENT_LUA: Final = """
local t = redis.call('TIME')
local ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('RPUSH', KEYS[1], ms .. ' ' .. ARGV[1])
return ms
"""


def pid_alive(pid: int) -> bool:
    """True if ``pid`` runs code (not gone, not a zombie)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


@dataclass
class Counts:
    """The ledger's totals for one scenario."""

    runs: int
    completed: int
    completions: int
    overlaps: int
    dead_holders: int
    writes_accepted: int
    writes_rejected: int
    token_regressions: int
    retried_lost: int
    retried_backend: int
    failed: dict[str, str]


class Ledger:
    """One scenario's ledger at ``url`` under ``prefix``; usable from any process (fork-safe)."""

    def __init__(self, url: str, prefix: str) -> None:
        self.url = url
        self.prefix = prefix
        self._local = threading.local()
        self._pid = -1
        self._client: redis.Redis | None = None

    # --- connection ---------------------------------------------------------------------
    @property
    def r(self) -> redis.Redis:
        """This process's client (made again after a fork)."""
        if self._client is None or self._pid != os.getpid():
            self._client = redis.Redis.from_url(
                self.url, decode_responses=True, socket_timeout=10, health_check_interval=0
            )
            self._pid = os.getpid()
            self._enter = self._client.register_script(ENTER_LUA)
            self._fenced = FencedRedis(self._client, prefix=f"{self.prefix}-fenced")
            self._done = self._client.register_script(DONE_LUA)
            self._event = self._client.register_script(EVENT_LUA)
        return self._client

    def key(self, *parts: object) -> str:
        return f"{{{self.prefix}}}:" + ":".join(str(p) for p in parts)

    # --- what a body does ---------------------------------------------------------------
    def enter(self, resource: str, token: int, task_id: str, pid: int | None = None) -> int:
        """Enter ``resource``; returns the overlaps found (holders inside whose pid lives)."""
        pid = os.getpid() if pid is None else pid
        member = f"{task_id}|{token}"
        r = self.r
        flat = self._enter(
            [
                self.key("inside", resource),
                self.key("runs"),
                self.key("maxtoken", resource),
                self.key("regressions"),
                self.key("bypid", pid),
                self.key("entered"),
                self.key("entered", resource),
            ],
            [member, pid, token, resource],
            client=r,
        )
        found = 0
        for other, other_pid in zip(flat[::2], flat[1::2], strict=True):
            if pid_alive(int(other_pid)):
                found += 1
                detail = {"resource": resource, "entering": member, "inside": other}
                pipe = r.pipeline(transaction=False)
                pipe.incr(self.key("overlaps"))
                pipe.rpush(self.key("overlap_log"), json.dumps(detail))
                pipe.execute()
            else:
                pipe = r.pipeline(transaction=False)
                pipe.hdel(self.key("inside", resource), other)
                pipe.incr(self.key("dead_holders"))
                pipe.execute()
        return found

    def leave(self, resource: str, token: int, task_id: str, pid: int | None = None) -> None:
        pid = os.getpid() if pid is None else pid
        member = f"{task_id}|{token}"
        pipe = self.r.pipeline(transaction=False)
        pipe.hdel(self.key("inside", resource), member)
        pipe.srem(self.key("bypid", pid), f"{member}|{resource}")
        pipe.execute()

    def write(self, resource: str, token: int, task_id: str) -> bool:
        """Write through the fenced store; False if it refused the token."""
        r = self.r
        try:
            self._fenced.set(resource, f"{task_id}|{token}", fence=token, raise_stale=True)
        except StaleFence as stale:
            pipe = r.pipeline(transaction=False)
            pipe.incr(self.key("writes_rejected"))
            pipe.rpush(self.key("rejected_log"), f"{task_id}|{resource}|{token}|{stale.last}")
            pipe.execute()
            return False
        r.incr(self.key("writes_ok"))
        return True

    def done(self, task_id: str) -> int:
        r = self.r
        return int(self._done([self.key("done"), self.key("completions")], [task_id], client=r))

    def deferred_done(self, task_id: str, pid: int) -> None:
        """A deferring task completed in process ``pid`` (after ``done``)."""
        self.r.rpush(self.key("deferred_done"), f"{task_id} {pid}")

    def event(self, name: str, text: object = "") -> int:
        """Push ``text`` on the event list ``name`` with the ledger time; returns that time."""
        r = self.r
        return int(self._event([self.key("events", name)], [str(text)], client=r))

    def incr(self, name: str) -> None:
        self.r.incr(self.key(name))

    def failed(self, task_id: str, error: str) -> None:
        self.r.hset(self.key("failed"), task_id, error)

    def published(self, task_id: str, message: str) -> None:
        """A worker published ``message`` for ``task_id`` (a retry): its latest message."""
        self.r.hset(self.key("last_message"), task_id, message)

    def received(self, task_id: str, message: str) -> None:
        """A worker received ``message`` of ``task_id`` from the broker."""
        self.r.sadd(self.key("received"), f"{task_id}|{message}")

    # --- what the test reads ------------------------------------------------------------
    def now_ms(self) -> int:
        sec, usec = self.r.time()
        return int(sec) * 1000 + int(usec) // 1000

    def events(self, name: str) -> list[tuple[int, str]]:
        out = []
        for item in self.r.lrange(self.key("events", name), 0, -1):
            ms, _, text = str(item).partition(" ")
            out.append((int(ms), text))
        return out

    def deferred_completions(self) -> dict[str, list[int]]:
        """Task id -> the processes in which that deferring task completed, in order."""
        out: dict[str, list[int]] = {}
        for item in self.r.lrange(self.key("deferred_done"), 0, -1):
            task_id, pid = str(item).split(" ")
            out.setdefault(task_id, []).append(int(pid))
        return out

    def count(self, name: str) -> int:
        """The counter ``name`` (``incr``)."""
        return int(self.r.get(self.key(name)) or 0)

    def completed(self) -> int:
        return int(self.r.zcard(self.key("done")))

    def done_ids(self) -> set[str]:
        return {str(m) for m in self.r.zrange(self.key("done"), 0, -1)}

    def failed_ids(self) -> dict[str, str]:
        return {str(k): str(v) for k, v in self.r.hgetall(self.key("failed")).items()}

    def done_at(self, task_ids: list[str]) -> list[int | None]:
        """First completion time (ms) of each task id (None: not completed)."""
        if not task_ids:
            return []
        scores = self.r.zmscore(self.key("done"), task_ids)
        return [None if s is None else int(s) for s in scores]

    def first_done_after(self, ms: int) -> int | None:
        """The first completion time at or after ``ms`` (any task), or None."""
        found = self.r.zrangebyscore(self.key("done"), ms, "+inf", start=0, num=1, withscores=True)
        return int(found[0][1]) if found else None

    def first_enter_after(self, ms: int, resource: str | None = None) -> int | None:
        """The first time at or after ``ms`` that a body entered ``resource`` (None: any)."""
        key = self.key("entered") if resource is None else self.key("entered", resource)
        found = self.r.zrangebyscore(key, ms, "+inf", start=0, num=1, withscores=True)
        return int(found[0][1]) if found else None

    def in_flight_of(self, pid: int) -> list[tuple[str, str]]:
        """``(task id, resource)`` of what process ``pid`` had entered and not left."""
        out = set()
        for member in self.r.smembers(self.key("bypid", pid)):
            task, _, rest = str(member).partition("|")
            out.add((task, rest.partition("|")[2]))
        return sorted(out)

    def never_received(self, task_ids: list[str]) -> list[str]:
        """Those of ``task_ids`` whose last message no worker ever received."""
        if not task_ids:
            return []
        r = self.r
        last = r.hmget(self.key("last_message"), task_ids)
        members = [f"{t}|{m or FIRST_MESSAGE}" for t, m in zip(task_ids, last, strict=True)]
        seen = r.smismember(self.key("received"), members)
        return [t for t, s in zip(task_ids, seen, strict=True) if not s]

    def rejected(self) -> list[dict[str, Any]]:
        out = []
        for item in self.r.lrange(self.key("rejected_log"), 0, -1):
            task, resource, token, last = str(item).split("|")
            out.append({"task": task, "resource": resource, "token": int(token), "last": int(last)})
        return out

    def overlap_log(self) -> list[dict[str, str]]:
        return [json.loads(x) for x in self.r.lrange(self.key("overlap_log"), 0, -1)]

    def counts(self) -> Counts:
        names = [
            "runs",
            "completions",
            "overlaps",
            "dead_holders",
            "writes_ok",
            "writes_rejected",
            "regressions",
            "retried_lost",
            "retried_backend",
        ]
        values = [int(v or 0) for v in self.r.mget([self.key(n) for n in names])]
        v = dict(zip(names, values, strict=True))
        return Counts(
            runs=v["runs"],
            completed=self.completed(),
            completions=v["completions"],
            overlaps=v["overlaps"],
            dead_holders=v["dead_holders"],
            writes_accepted=v["writes_ok"],
            writes_rejected=v["writes_rejected"],
            token_regressions=v["regressions"],
            retried_lost=v["retried_lost"],
            retried_backend=v["retried_backend"],
            failed=self.failed_ids(),
        )

    def set_clock_offset(self, hostname: str, seconds: float) -> None:
        self.r.set(self.key("clock", hostname), repr(seconds))

    def clock_offset(self, hostname: str) -> float:
        return float(self.r.get(self.key("clock", hostname)) or 0.0)
