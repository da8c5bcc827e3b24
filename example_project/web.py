"""A web replica that guards per-(analysis, step) work with ``leases.ahold`` (Starlette, ASGI).

Run several replicas (processes) behind any load balancer::

    WEB_PREFIX=web REDIS_URL=redis://127.0.0.1:6379/14 \\
        uvicorn example_project.web:app --port 8001

``POST /analyses/{analysis}/steps/{step}`` holds the lease ``analysis:<a>:step:<s>`` (waiting
up to ``WEB_WAIT`` seconds for it, woken by the release) around the step's "work": it records
its entry and exit in a ledger in Redis, fenced by the lease's token, and sleeps
``WEB_WORK`` seconds in between. ``example_project/web_load.py`` drives several replicas with
thousands of concurrent requests and reads the ledger back: no two requests may ever have been
inside one step at once, and the tokens of each step must only grow.

Settings (environment): ``REDIS_URL`` (leases and ledger), ``WEB_PREFIX`` (key prefix of this
run; the ledger lives under it too), ``WEB_WAIT``, ``WEB_WORK`` and ``WEB_TTL`` (seconds).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Final

import redis.asyncio as aredis
from celery import Celery
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from celery_leases import LeaseBusy, Leases

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/14")
PREFIX = os.environ.get("WEB_PREFIX", "web")
WAIT = float(os.environ.get("WEB_WAIT", "30"))
WORK = float(os.environ.get("WEB_WORK", "0.005"))
TTL = float(os.environ.get("WEB_TTL", "10"))

celery_app = Celery("example_project.web", set_as_current=False)
leases = Leases(celery_app, redis_url=REDIS_URL, key_prefix=PREFIX, ttl=TTL)

#: ``KEYS`` active, fence, tokens, overlaps, stale; ``ARGV[1]`` the lease's token.
#: Counts the requests inside the step (an overlap if it was not empty) and checks the fence:
#: a store guarded by the lease refuses a token that is not above the last one it accepted.
ENTER: Final = """
local inside = redis.call('INCR', KEYS[1])
if inside > 1 then redis.call('INCR', KEYS[4]) end
local token = tonumber(ARGV[1])
if token <= tonumber(redis.call('GET', KEYS[2]) or '0') then
  redis.call('INCR', KEYS[5])
else
  redis.call('SET', KEYS[2], ARGV[1])
end
redis.call('RPUSH', KEYS[3], ARGV[1])
return inside
"""


def ledger_key(prefix: str, *parts: object) -> str:
    """A ledger key of this run (under the run's prefix, in a hash tag of its own)."""
    return f"{{{prefix}:ledger}}:" + ":".join(str(p) for p in parts)


class Ledger:
    """What the replicas record about each step: who was inside, and with which token."""

    def __init__(self, client: aredis.Redis, prefix: str) -> None:
        self.client = client
        self.prefix = prefix
        self._enter = client.register_script(ENTER)

    def _keys(self, analysis: str, step: str) -> list[str]:
        key = ledger_key
        p = self.prefix
        return [
            key(p, "active", analysis, step),
            key(p, "fence", analysis, step),
            key(p, "tokens", analysis, step),
            key(p, "overlaps"),
            key(p, "stale"),
        ]

    async def enter(self, analysis: str, step: str, token: int) -> int:
        keys = self._keys(analysis, step)
        await self.client.sadd(ledger_key(self.prefix, "steps"), f"{analysis}:{step}")
        return int(await self._enter(keys, [token]))

    async def exit(self, analysis: str, step: str) -> None:
        await self.client.decr(self._keys(analysis, step)[0])


ledger: Ledger | None = None
REPLICA = f"{os.uname().nodename}:{os.getpid()}"


async def run_step(request: Request) -> JSONResponse:
    analysis, step = request.path_params["analysis"], request.path_params["step"]
    assert ledger is not None
    try:
        async with leases.ahold(f"analysis:{analysis}:step:{step}", wait=WAIT) as lease:
            inside = await ledger.enter(analysis, step, lease.token)
            await asyncio.sleep(WORK)  # the step's work
            await ledger.exit(analysis, step)
    except LeaseBusy as busy:
        return JSONResponse({"busy": busy.resource, "waited": busy.waited}, status_code=409)
    return JSONResponse({"token": lease.token, "inside": inside, "replica": REPLICA})


async def health(request: Request) -> JSONResponse:
    await leases.astore.ping()
    return JSONResponse({"ok": True, "replica": REPLICA})


@asynccontextmanager
async def lifespan(app: Starlette) -> AsyncIterator[None]:
    global ledger
    client = aredis.Redis.from_url(REDIS_URL, decode_responses=True, max_connections=1000)
    ledger = Ledger(client, PREFIX)
    try:
        yield
    finally:
        await leases.aclose()  # this loop's lease connections
        await client.aclose()


app = Starlette(
    routes=[
        Route("/analyses/{analysis}/steps/{step}", run_step, methods=["POST"]),
        Route("/health", health),
    ],
    lifespan=lifespan,
)
