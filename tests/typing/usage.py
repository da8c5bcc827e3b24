"""Usage examples that mypy checks (never run): the public interface must type-check."""

from __future__ import annotations

import redis
import redis.asyncio
from celery import Celery

from celery_leases import (
    AsyncFencedRedis,
    DuplicateTask,
    FencedRedis,
    Lease,
    LeaseBusy,
    LeasedTask,
    LeaseLost,
    LeaseRevoked,
    Leases,
    Rate,
    RateLimited,
    Revoked,
    Shared,
    StaleFence,
    current_claim,
    current_leases,
)

app = Celery("typing", broker="redis://localhost:6379/0")
leases = Leases(app, ttl=30.0, key_prefix="typing")


@app.task(base=LeasedTask, lease="analysis:{analysis_id}:init")
def init_analysis(analysis_id: int) -> int:
    held: tuple[Lease, ...] = current_leases()
    return held[0].token


@app.task(base=LeasedTask, unique="sync:{repo}", on_duplicate="cancel", unique_cancel_deadline=30)
def sync_repo(repo: str) -> int:
    claim: Lease | None = current_claim()
    if claim is None:
        return 0
    claim.check()
    return claim.token


def one() -> int:
    with leases.hold("report:42", ttl=30, wait=10) as lease:
        lease.check()
        remaining: float = lease.expires_in
        return lease.token + int(remaining)


def many() -> list[str]:
    with leases.hold(["repo:7", Shared("remote:3"), Shared("api:k", limit=3)], wait=5) as held:
        return [lease.resource for lease in held]


def errors() -> str:
    try:
        with leases.hold("x"):
            pass
    except LeaseBusy as busy:
        return busy.resource
    except LeaseLost as lost:
        return f"{lost.resource} {lost.held_for}"
    return ""


@app.task(base=LeasedTask, unique="report:{account_id}", unique_ttl=600, on_duplicate="raise")
def build_report(account_id: int) -> None: ...


def unique() -> str | None:
    try:
        result = build_report.delay(42)
    except DuplicateTask as exc:
        key: str = exc.key
        holder: str | None = exc.task_id
        return holder or key
    return str(result.id)


async def aone() -> int:
    async with leases.ahold("report:42", ttl=30, wait=10) as lease:
        lease.check()
        return lease.token


async def amany() -> list[str]:
    async with leases.ahold(["repo:7", Shared("remote:3")], wait=None) as held:
        return [lease.resource for lease in held]


async def aonce_usage() -> object:
    async def init() -> dict[str, int]:
        return {"files": 12}

    first = await leases.aonce("analysis:42:input", init, ttl=60, wait=600)
    again = await leases.aonce("analysis:42:input", lambda: {"files": 12})
    stored = await leases.areceipt("analysis:42:input")
    cleared: bool = await leases.aforget("analysis:42:input")
    await leases.aclose()
    return (first, again, stored, cleared)


def fenced() -> int | None:
    results = FencedRedis(redis.Redis(), prefix="results")
    with leases.hold("report:42") as lease:
        applied: bool = results.set("report:42", b"data", fence=lease, ttl=60.0)
        results.hset("report:42:meta", {"rows": 12, "state": "done"}, fence=lease.token)
        try:
            results.set("report:42", "again", fence=lease, raise_stale=True)
        except StaleFence as exc:
            newer: int = exc.last
            return newer
    value: bytes | str | None = results.get("report:42")
    key: str = results.key("report:42")
    from_url = FencedRedis("redis+cluster://127.0.0.1:7000")
    from_url.close()
    return results.last_fence("report:42") if applied and value and key else None


async def afenced() -> int | None:
    results = AsyncFencedRedis(redis.asyncio.Redis(), prefix="results")
    async with leases.ahold("report:42") as lease:
        await results.set("report:42", "data", fence=lease)
        await results.hset("meta", {"a": 1}, fence=lease, raise_stale=True)
    await results.aclose()
    return await results.last_fence("report:42")


@app.task(base=LeasedTask, rates=[Rate("api:{account}", "100/m"), Rate("all", "50/s", cost=2)])
def call_api(account: int) -> None: ...


def rate_limits() -> float:
    leases.set_rate("api:42", "50/s")
    leases.set_rate("api:42", None)
    try:
        leases.limit("api:42", "10/s", cost=1, wait=5.0)
    except RateLimited as exc:
        busy: LeaseBusy = exc
        return exc.retry_after + (busy.retry_after or 0.0)
    return leases.penalize("api:42", retry_after=30.0)


def revocation() -> str:
    done: Revoked = leases.revoke("report:42", reason="operator", deadline=30.0)
    seconds: float = done.deadline
    owners: tuple[str, ...] = done.holders
    tokens: tuple[int, ...] = done.tokens
    leases.revoke("report:43")  # the reason and the deadline have defaults
    try:
        with leases.hold("report:42") as lease:
            lease.check()
    except LeaseRevoked as exc:
        lost: LeaseLost = exc
        return f"{exc.reason} {exc.deadline} {lost.resource} {seconds} {owners} {tokens}"
    return ""
