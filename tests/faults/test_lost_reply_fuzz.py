"""A bounded lost-reply fuzz: no two exclusive holders, no spurious LeaseLost (issue 26, part 8).

2 processes x 3 threads of one owner id each hold random lists of resources (1 to 3 of 6,
over 4 slot groups, some ``Shared``) through a fault proxy that loses a share of the script
replies after the script ran in Redis (the connection is cut before the reply comes back).
Every block records itself in a ledger on a direct connection (a Lua script, atomic): an
exclusive holder finds no other holder of its resource there, a shared one no exclusive
holder. A block lasts a few ms against a TTL of seconds, so a ``LeaseLost`` is spurious: a
recovery adopted a grant Redis did not have for it.

Bounded: one run of ``SECONDS`` of load; the whole test stays under 30 s.
"""

from __future__ import annotations

import multiprocessing
import random
import threading
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlparse

import pytest
import redis
from celery import Celery

from celery_leases import LeaseBackendError, LeaseBusy, LeaseLost, Leases, Shared
from tests.support.proxy import LossyProxy

pytestmark = [pytest.mark.faults]

PROCESSES = 2
THREADS = 3
SECONDS = 12.0
RESOURCES = [f"fuzz:{i}" for i in range(6)]
SHARED_SHARE = 0.3
LOST_SHARE = 0.05
TTL = 5.0

#: KEYS: per resource its exclusive count, its shared count; then the overlaps counter.
#: ARGV: +1 (enter) or -1 (leave), then per resource its mode. Returns the overlaps found.
LEDGER = """
local step = tonumber(ARGV[1])
local found = 0
local n = (#KEYS - 1) / 2
for i = 0, n - 1 do
  local xkey, skey = KEYS[2 * i + 1], KEYS[2 * i + 2]
  local mode = ARGV[i + 2]
  if step > 0 then
    local x = tonumber(redis.call('GET', xkey) or '0')
    local s = tonumber(redis.call('GET', skey) or '0')
    if x > 0 or (mode == 'x' and s > 0) then
      found = found + 1
    end
  end
  redis.call('INCRBY', mode == 'x' and xkey or skey, step)
end
if found > 0 then
  redis.call('INCRBY', KEYS[#KEYS], found)
end
return found
"""


def _ledger_keys(prefix: str, names: list[str]) -> list[str]:
    keys = []
    for name in names:
        keys += [f"{prefix}:ledger:x:{name}", f"{prefix}:ledger:s:{name}"]
    return [*keys, f"{prefix}:ledger:overlaps"]


def _holder(
    leases: Leases, ledger: Any, prefix: str, seed: int, end: float, out: dict[str, Any]
) -> None:
    rng = random.Random(seed)
    while time.monotonic() < end:
        names = rng.sample(RESOURCES, rng.randint(1, 3))
        shared = [rng.random() < SHARED_SHARE for _ in names]
        wants: list[str | Shared] = [
            Shared(n) if s else n for n, s in zip(names, shared, strict=True)
        ]
        modes = ["s" if s else "x" for s in shared]
        keys = _ledger_keys(prefix, names)
        try:
            with leases.hold(wants, ttl=TTL, wait=2.0):
                out["overlaps"] += int(ledger(keys=keys, args=[1, *modes]))
                time.sleep(rng.uniform(0.0, 0.01))
                ledger(keys=keys, args=[-1, *modes])
            out["held"] += 1
        except LeaseBusy:
            out["busy"] += 1
        except LeaseLost as exc:
            out["lost"].append(str(exc))
        except LeaseBackendError as exc:
            out["errors"].append(str(exc))


def _process(url: str, ledger_url: str, prefix: str, seed: int, queue: Any) -> None:
    """One process of the fuzz: ``THREADS`` holders of one owner id."""
    leases = Leases(
        Celery(f"fuzz-{seed}", set_as_current=False),
        redis_url=url,
        key_prefix=prefix,
        slot_groups=4,
        socket_timeout=1.0,
    )
    direct = redis.Redis.from_url(ledger_url)
    ledger = direct.register_script(LEDGER)
    out: dict[str, Any] = {"held": 0, "busy": 0, "overlaps": 0, "lost": [], "errors": []}
    end = time.monotonic() + SECONDS
    threads = [
        threading.Thread(target=_holder, args=(leases, ledger, prefix, seed * 10 + i, end, out))
        for i in range(THREADS)
    ]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    except BaseException as exc:  # reported, not lost in a child
        out["errors"].append(f"process: {exc!r}")
    finally:
        queue.put(out)
        direct.close()


@pytest.fixture
def proxy(leases_redis_url: str) -> Iterator[LossyProxy]:
    url = urlparse(leases_redis_url)
    with LossyProxy(url.hostname or "127.0.0.1", url.port or 6379, seed=26) as p:
        yield p


def test_lost_replies_give_no_two_holders_and_no_spurious_lease_lost(
    proxy: LossyProxy, leases_redis_url: str, leases_prefix: str
) -> None:
    db = int(urlparse(leases_redis_url).path.lstrip("/") or 0)
    proxy.drop_fraction(b"EVALSHA", LOST_SHARE)
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(
            target=_process, args=(proxy.url(db), leases_redis_url, leases_prefix, seed, queue)
        )
        for seed in range(1, PROCESSES + 1)
    ]
    for p in procs:
        p.start()
    results = [queue.get(timeout=SECONDS + 60) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    direct = redis.Redis.from_url(leases_redis_url, decode_responses=True)
    try:
        overlaps = int(direct.get(f"{leases_prefix}:ledger:overlaps") or 0)
        direct.delete(*_ledger_keys(leases_prefix, RESOURCES))
    finally:
        direct.close()
    held = sum(r["held"] for r in results)
    lost = [m for r in results for m in r["lost"]]
    errors = [m for r in results for m in r["errors"]]
    summary = (
        f"{held} blocks held, {sum(r['busy'] for r in results)} busy, {proxy.lost} replies "
        f"lost, {len(errors)} backend errors, {overlaps} overlaps, {len(lost)} LeaseLost"
    )
    print(summary)
    assert proxy.lost > 0, summary
    assert held > 0, summary
    assert overlaps == 0, summary
    assert lost == [], f"{summary}: {lost[:3]}"
    assert not [e for e in errors if e.startswith("process:")], errors
