"""Fenced writes against a real Redis (and sqlite, PostgreSQL when it answers).

The scenario no lease can cover: a holder frozen past its TTL (here SIGSTOP) wakes up after
the next holder was granted and wrote, and writes with its old token. The Redis helper and the
SQL recipe of docs/hold-and-once.md ("Fenced writes") must refuse that write; a plain write,
as a control, goes through.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import redis
import redis.asyncio
from redis.crc import key_slot

from celery_leases import (
    AsyncFencedRedis,
    FencedRedis,
    LeaseBackendError,
    LeaseConfigError,
    LeaseError,
    Leases,
    StaleFence,
)
from celery_leases._redis_server import free_port
from tests.support.polling import wait_until
from tests.support.topology import LocalCluster

ROOT = Path(__file__).resolve().parents[2]
MakeLeases = Callable[..., Leases]

# --- the SQL recipe, as docs/hold-and-once.md gives it -------------------------------------
SQL_TABLE = """CREATE TABLE {table} (
    id     TEXT PRIMARY KEY,
    value  TEXT NOT NULL,
    fence  BIGINT NOT NULL
)"""
#: the first write and every later one in one statement: rowcount 0 means refused
SQL_UPSERT = """INSERT INTO {table} (id, value, fence) VALUES (:id, :value, :fence)
ON CONFLICT (id) DO UPDATE SET value = excluded.value, fence = excluded.fence
WHERE {table}.fence <= excluded.fence"""
#: a row that exists: rowcount 0 means refused (a newer token wrote) or no such row
SQL_UPDATE = """UPDATE {table} SET value = :value, fence = :fence
WHERE id = :id AND fence <= :fence"""

PG_URL = os.environ.get(
    "CELERY_LEASES_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test"
)


@pytest.fixture
def fenced(leases_redis_url: str, leases_prefix: str) -> Iterator[FencedRedis]:
    """A FencedRedis on the test Redis under this test's prefix (cleaned by the plugin)."""
    client = redis.Redis.from_url(leases_redis_url, decode_responses=True)
    yield FencedRedis(client, prefix=leases_prefix)
    client.close()


def _expiry_of_both(r: redis.Redis, data: str, record: str) -> int:
    """The one absolute expiry (ms) of ``data`` and ``record``; fails if they differ.

    PEXPIRETIME on Redis 7; Redis 6.2 has only PTTL, read for both in one MULTI, where a
    millisecond may tick between the two reads.
    """
    if int(str(r.info("server")["redis_version"]).split(".")[0]) >= 7:
        at = r.pexpiretime(data)
        assert r.pexpiretime(record) == at
        return int(at)
    pipe = r.pipeline(transaction=True)
    pipe.pttl(data)
    pipe.pttl(record)
    data_ms, record_ms = pipe.execute()
    assert 0 <= data_ms - record_ms <= 1
    return int(data_ms)


def _stat(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


# --- the frozen holder ----------------------------------------------------------------------
FROZEN_HOLDER = textwrap.dedent(
    """
    import json, sqlite3, sys

    import redis
    from celery import Celery

    from celery_leases import FencedRedis, LeaseLost, Leases

    url, prefix, resource, db, upsert, plain_key = sys.argv[1:7]
    leases = Leases(Celery("frozen", set_as_current=False), redis_url=url, key_prefix=prefix)
    client = redis.Redis.from_url(url, decode_responses=True)
    store = FencedRedis(client, prefix=prefix)
    sql = sqlite3.connect(db, isolation_level=None)
    out = {}
    try:
        with leases.hold(resource, ttl=1.0) as lease:
            row = {"id": resource, "value": f"first {lease.token}", "fence": lease.token}
            out["first_redis"] = store.set(resource, row["value"], fence=lease)
            out["first_sql"] = sql.execute(upsert, row).rowcount
            lease.check()           # still held: it goes on to write its result ...
            print(json.dumps({"token": lease.token}), flush=True)
            sys.stdin.readline()    # ... and is SIGSTOPped here, until past its TTL
            row["value"] = f"late {lease.token}"
            out["late_redis"] = store.set(resource, row["value"], fence=lease)
            out["late_sql"] = sql.execute(upsert, row).rowcount
            out["late_plain"] = bool(client.set(plain_key, row["value"]))  # no fence: a control
    except LeaseLost:
        out["lost"] = True
    print(json.dumps(out), flush=True)
    """
)


def test_a_frozen_holders_late_write_is_refused(
    make_leases: MakeLeases,
    leases_redis_url: str,
    leases_prefix: str,
    fenced: FencedRedis,
    tmp_path: Path,
) -> None:
    resource = "report:42"
    db = tmp_path / "results.db"
    upsert = SQL_UPSERT.format(table="results")
    sql = sqlite3.connect(db, isolation_level=None)
    sql.execute(SQL_TABLE.format(table="results"))
    plain_key = f"{{{leases_prefix}}}:plain"
    child = subprocess.Popen(
        [sys.executable, "-c", FROZEN_HOLDER, leases_redis_url, leases_prefix, resource,
         str(db), upsert, plain_key],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        cwd=ROOT,
    )  # fmt: skip
    assert child.stdin is not None
    assert child.stdout is not None
    try:
        line = child.stdout.readline()
        assert line, child.communicate(timeout=30)[1]
        old_token = json.loads(line)["token"]
        # t0 A holds report:42 (ttl 1 s), has written once and checked its lease
        # t1 A freezes (SIGSTOP): no heartbeat, no code
        os.kill(child.pid, signal.SIGSTOP)
        wait_until(lambda: _stat(child.pid) == "T", 10, "the holder to stop")
        # t2 A's lease runs out in Redis; B is granted it (woken by the expiry) and writes
        leases = make_leases()
        with leases.hold(resource, ttl=30, wait=30) as lease:
            new_token = lease.token
            assert new_token > old_token
            assert fenced.set(resource, f"second {new_token}", fence=lease)
            row = {"id": resource, "value": f"second {new_token}", "fence": new_token}
            assert sql.execute(upsert, row).rowcount == 1
            fenced.client.set(plain_key, f"second {new_token}")
            # t3 A wakes up and, not knowing, writes its result with its old token
            child.stdin.write("go\n")
            child.stdin.flush()
            os.kill(child.pid, signal.SIGCONT)
            out, err = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            os.kill(child.pid, signal.SIGCONT)
            child.kill()
            child.wait()
    assert child.returncode == 0, err
    result = json.loads(out)
    assert result["first_redis"] is True, result
    assert result["first_sql"] == 1, result
    # the store refused A's late writes, and they changed nothing
    assert result["late_redis"] is False, result
    assert result["late_sql"] == 0, result
    assert fenced.get(resource) == f"second {new_token}"
    assert fenced.last_fence(resource) == new_token
    assert sql.execute("SELECT value, fence FROM results").fetchall() == [
        (f"second {new_token}", new_token)
    ]
    # without the fence, A's late write overwrote B's: the overlap the fence closed
    assert result["late_plain"] is True
    assert fenced.client.get(plain_key) == f"late {old_token}"
    assert result.get("lost") is True  # and A learnt its lease was lost when it left the block


# --- the rules ------------------------------------------------------------------------------
def test_equal_tokens_are_accepted_so_one_holder_writes_many_times(fenced: FencedRedis) -> None:
    assert fenced.set("r", "a", fence=7)
    assert fenced.set("r", "b", fence=7)
    assert fenced.hset("h", {"x": 1}, fence=7)
    assert fenced.hset("h", {"y": 2}, fence=7)
    assert fenced.get("r") == "b"
    assert fenced.client.hgetall(fenced.key("h")) == {"x": "1", "y": "2"}


def test_older_tokens_are_refused_and_change_nothing(fenced: FencedRedis) -> None:
    assert fenced.set("r", "new", fence=10, ttl=60)
    ttl_before = fenced.client.pttl(fenced.key("r"))
    assert fenced.set("r", "old", fence=9) is False
    assert fenced.get("r") == "new"
    assert fenced.last_fence("r") == 10
    assert 0 < fenced.client.pttl(fenced.key("r")) <= ttl_before  # the refusal kept the expiry
    with pytest.raises(StaleFence) as info:
        fenced.set("r", "old", fence=3, raise_stale=True)
    assert (info.value.name, info.value.token, info.value.last) == ("r", 3, 10)
    assert isinstance(info.value, LeaseError)
    assert "'r'" in str(info.value)
    assert "10" in str(info.value)
    assert fenced.hset("h", {"a": "new"}, fence=5)
    assert fenced.hset("h", {"a": "old", "b": "old"}, fence=4) is False
    assert fenced.client.hgetall(fenced.key("h")) == {"a": "new"}
    assert fenced.set("r", "newer", fence=11)
    assert fenced.get("r") == "newer"


def test_a_first_write_is_accepted_with_any_token(fenced: FencedRedis) -> None:
    assert fenced.last_fence("fresh") is None
    assert fenced.get("fresh") is None
    assert fenced.set("fresh", "v", fence=0)
    assert fenced.last_fence("fresh") == 0


def test_a_missing_record_accepts_the_next_write(fenced: FencedRedis) -> None:
    # data written before fencing was adopted (no record), or a record deleted by hand:
    # the next fenced write is a first write, whatever its token
    fenced.client.set(fenced.key("legacy"), "unfenced")
    assert fenced.set("legacy", "v1", fence=5)
    fenced.client.delete(fenced.fence_key("legacy"))
    assert fenced.set("legacy", "v0", fence=1)
    assert (fenced.get("legacy"), fenced.last_fence("legacy")) == ("v0", 1)


def test_tokens_compare_exactly_above_2_to_the_53(fenced: FencedRedis) -> None:
    big = 2**63 + 1  # a double rounds 2**63 + 1 and 2**63 to the same number
    assert fenced.set("big", "a", fence=big)
    assert fenced.set("big", "b", fence=big - 1) is False
    assert fenced.set("big", "c", fence=10**30)
    assert fenced.set("big", "d", fence=9 * 10**29) is False
    assert fenced.last_fence("big") == 10**30


def test_the_record_expires_with_its_data_never_before(fenced: FencedRedis) -> None:
    r = fenced.client
    assert fenced.set("t", "v", fence=1, ttl=30)
    data_ms, fence_ms = r.pttl(fenced.key("t")), r.pttl(fenced.fence_key("t"))
    assert 29_000 < data_ms <= 30_000
    assert 29_000 < fence_ms <= 30_000
    # one absolute expiry (PEXPIREAT) for both, so the record is never the first to go
    assert _expiry_of_both(r, fenced.key("t"), fenced.fence_key("t")) > 0
    # a write without ttl makes both persistent, as SET does; hset follows the same rule
    assert fenced.set("t", "v", fence=2)
    assert r.pttl(fenced.key("t")) == -1
    assert r.pttl(fenced.fence_key("t")) == -1
    assert fenced.hset("h", {"a": 1}, fence=1, ttl=30)
    assert _expiry_of_both(r, fenced.key("h"), fenced.fence_key("h")) > 0
    assert fenced.hset("h", {"b": 2}, fence=1)
    assert r.pttl(fenced.key("h")) == -1
    assert r.pttl(fenced.fence_key("h")) == -1


def test_data_and_record_expire_together(fenced: FencedRedis) -> None:
    assert fenced.set("short", "v", fence=9, ttl=0.2)
    wait_until(lambda: fenced.client.exists(fenced.key("short")) == 0, 10, "the data to expire")
    assert fenced.last_fence("short") is None  # gone with it: a later write is a first write
    assert fenced.set("short", "w", fence=1)


def test_a_large_hset_in_one_write(fenced: FencedRedis) -> None:
    mapping = {f"f{i}": i for i in range(5000)}  # more arguments than Lua can unpack at once
    assert fenced.hset("wide", mapping, fence=1)
    assert fenced.client.hlen(fenced.key("wide")) == 5000


def test_a_lease_is_a_fence(make_leases: MakeLeases, fenced: FencedRedis) -> None:
    leases = make_leases()
    with leases.hold("doc:1") as first:
        assert fenced.set("doc:1", "first", fence=first)
    with leases.hold("doc:1") as second:
        assert second.token > first.token
        assert fenced.set("doc:1", "second", fence=second)
    assert fenced.set("doc:1", "late", fence=first) is False
    assert fenced.get("doc:1") == "second"


@pytest.mark.parametrize("bad", [-1, True, 1.5, "7", None])
def test_an_invalid_fence_is_a_config_error(fenced: FencedRedis, bad: Any) -> None:
    with pytest.raises(LeaseConfigError):
        fenced.set("r", "v", fence=bad)


def test_invalid_arguments_are_config_errors(fenced: FencedRedis) -> None:
    for call in (
        lambda: fenced.set("", "v", fence=1),
        lambda: fenced.set("\udcff", "v", fence=1),
        lambda: fenced.set("r", "v", fence=1, ttl=0),
        lambda: fenced.set("r", "v", fence=1, ttl=-2.0),
        lambda: fenced.set("r", "v", fence=1, ttl=float("inf")),
        lambda: fenced.set("r", "v", fence=1, ttl=float("nan")),
        lambda: fenced.set("r", None, fence=1),
        lambda: fenced.hset("r", {"a": None}, fence=1),
        lambda: fenced.hset("r", {}, fence=1),
        lambda: FencedRedis(fenced.client, prefix=""),
        lambda: FencedRedis("http://not-redis"),
    ):
        with pytest.raises(LeaseConfigError):
            call()
    assert fenced.last_fence("r") is None  # nothing was written


def test_redis_failing_is_a_backend_error_without_the_password() -> None:
    store = FencedRedis(f"redis://:hunter2@127.0.0.1:{free_port()}/0?socket_connect_timeout=0.5")
    try:
        with pytest.raises(LeaseBackendError) as info:
            store.set("r", "v", fence=1)
    finally:
        store.close()
    assert "hunter2" not in str(info.value)
    assert "'r'" in str(info.value)
    assert isinstance(info.value.__cause__, redis.RedisError)


def test_a_store_from_a_url(leases_redis_url: str, leases_prefix: str) -> None:
    store = FencedRedis(leases_redis_url, prefix=leases_prefix)
    try:
        assert store.set("u", "v", fence=1)
        assert store.get("u") in ("v", b"v")
    finally:
        store.close()


# --- cluster-safe key names -----------------------------------------------------------------
@pytest.mark.parametrize(
    "name", ["report:42", "a{b}c", "{x}", "}{", "{}", "}", "{", "%7B", "ключ {1}", "a b\nc"]
)
def test_data_and_record_share_one_hash_slot(name: str) -> None:
    store = FencedRedis(redis.Redis(), prefix="app")  # no connection is made
    data, record = store.key(name), store.fence_key(name)
    assert key_slot(data.encode()) == key_slot(record.encode())
    # the whole data key is the hash tag: one name's keys never share a tag with another's
    assert data.startswith("{")
    assert data.endswith("}")
    assert data.count("{") == 1
    assert record == data + ":fence"


def test_names_keep_distinct_keys_and_spread_over_slots() -> None:
    store = FencedRedis(redis.Redis(), prefix="app")
    names = ["a}", "a%7D", "a", "a:fence", "{a}", "a}:fence"]
    keys = {store.key(n) for n in names} | {store.fence_key(n) for n in names}
    assert len(keys) == 2 * len(names)
    slots = {key_slot(store.key(f"report:{i}").encode()) for i in range(100)}
    assert len(slots) > 50
    assert FencedRedis(redis.Redis(), prefix="other").key("a") != store.key("a")


def test_writes_run_on_a_redis_cluster(redis_cluster: LocalCluster, leases_prefix: str) -> None:
    store = FencedRedis(redis_cluster.url, prefix=leases_prefix)  # a RedisCluster client
    try:
        slots = set()
        for i, name in enumerate(["report:1", "a{b}", "{}", "}{", *map(str, range(20))]):
            slots.add(key_slot(store.key(name).encode()))
            assert store.set(name, "new", fence=5 + i)
            assert store.set(name, "old", fence=4 + i) is False
            assert store.hset(f"h:{name}", {"f": 1}, fence=5, ttl=60)
            assert store.get(name) in ("new", b"new")
            assert store.last_fence(name) == 5 + i
        assert len(slots) > 10  # the names really went to many slots (all three primaries)
    finally:
        store.close()


@pytest.mark.asyncio
async def test_asyncio_writes_run_on_a_redis_cluster(
    redis_cluster: LocalCluster, leases_prefix: str
) -> None:
    store = AsyncFencedRedis(redis_cluster.url, prefix=leases_prefix)
    try:
        for name in ("report:2", "x{y}z"):
            assert await store.set(name, "new", fence=9)
            assert await store.set(name, "old", fence=8) is False
            assert await store.last_fence(name) == 9
    finally:
        await store.aclose()


# --- asyncio --------------------------------------------------------------------------------
@pytest_asyncio.fixture
async def afenced(leases_redis_url: str, leases_prefix: str) -> Any:
    """An AsyncFencedRedis on the test Redis under this test's prefix."""
    client = redis.asyncio.Redis.from_url(leases_redis_url, decode_responses=True)
    yield AsyncFencedRedis(client, prefix=leases_prefix)
    await client.aclose()


@pytest.mark.asyncio
async def test_asyncio_writes_follow_the_same_rules(
    afenced: AsyncFencedRedis, fenced: FencedRedis
) -> None:
    assert await afenced.set("r", "a", fence=5)
    assert await afenced.set("r", "b", fence=5)
    assert await afenced.set("r", "old", fence=4) is False
    with pytest.raises(StaleFence) as info:
        await afenced.set("r", "x", fence=1, raise_stale=True)
    assert (info.value.token, info.value.last) == (1, 5)
    assert await afenced.hset("h", {"a": 1}, fence=2)
    assert await afenced.hset("h", {"a": 2}, fence=1) is False
    assert await afenced.get("r") == "b"
    assert await afenced.last_fence("r") == 5
    # sync and asyncio writers of one name fence each other: the same keys and script
    assert fenced.set("r", "sync", fence=6)
    assert await afenced.set("r", "async", fence=5) is False
    assert fenced.get("r") == "sync"


@pytest.mark.asyncio
async def test_asyncio_holders_are_fenced(
    make_leases: MakeLeases, afenced: AsyncFencedRedis
) -> None:
    leases = make_leases()
    try:
        async with leases.ahold("doc:a") as first:
            assert await afenced.set("doc:a", "first", fence=first)
        async with leases.ahold("doc:a") as second:
            assert await afenced.set("doc:a", "second", fence=second, ttl=60)
        assert await afenced.set("doc:a", "late", fence=first) is False
        results = await asyncio.gather(
            *(afenced.set("doc:b", str(t), fence=t) for t in (3, 1, 2, 5, 4))
        )
        # whichever order they reached Redis in, the first applied and 5 (the largest) too
        assert results[3] is True
        assert await afenced.last_fence("doc:b") == 5
        assert await afenced.get("doc:b") == "5"
    finally:
        await leases.aclose()


@pytest.mark.asyncio
async def test_an_asyncio_store_from_a_url(leases_redis_url: str, leases_prefix: str) -> None:
    store = AsyncFencedRedis(leases_redis_url, prefix=leases_prefix)
    try:
        assert await store.set("u", "v", fence=1)
        assert await store.last_fence("u") == 1
    finally:
        await store.aclose()


# --- the SQL recipe on SQLAlchemy and Django (sqlite, and PostgreSQL when it answers) -------
def _postgres_or_skip() -> str:
    psycopg = pytest.importorskip("psycopg")
    try:
        psycopg.connect(PG_URL, connect_timeout=3).close()
    except psycopg.Error as exc:
        pytest.skip(f"no PostgreSQL at {PG_URL}: {exc}")
    return PG_URL


def _table_name(prefix: str) -> str:
    return "fence_" + "".join(c if c.isalnum() else "_" for c in prefix).lower()


@pytest.fixture(params=["sqlite", "postgresql"])
def sql_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A SQLAlchemy URL: a sqlite file, or the local PostgreSQL (skipped when it is not there)."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'fence.db'}"
    return _postgres_or_skip().replace("postgresql://", "postgresql+psycopg://", 1)


def test_the_sqlalchemy_recipe(sql_url: str, leases_prefix: str) -> None:
    sqlalchemy = pytest.importorskip("sqlalchemy")
    from sqlalchemy import BigInteger, Column, MetaData, String, Table, Text, update

    if sql_url.startswith("sqlite"):
        from sqlalchemy.dialects.sqlite import insert
    else:
        from sqlalchemy.dialects.postgresql import insert

    metadata = MetaData()
    results = Table(
        _table_name(leases_prefix),
        metadata,
        Column("id", String(200), primary_key=True),
        Column("value", Text, nullable=False),
        Column("fence", BigInteger, nullable=False),
    )

    # the docs' code, verbatim
    def fenced_write(conn: Any, id: str, value: str, token: int) -> bool:
        """Write ``value`` unless a newer token has written; True if it was applied."""
        stmt = insert(results).values(id=id, value=value, fence=token)
        stmt = stmt.on_conflict_do_update(
            index_elements=[results.c.id],
            set_={"value": stmt.excluded.value, "fence": stmt.excluded.fence},
            where=results.c.fence <= stmt.excluded.fence,
        )
        # RETURNING gives a row only if the row was inserted or updated (an INSERT's rowcount
        # is not reliable through SQLAlchemy: -1 on psycopg unless preserve_rowcount is set)
        return conn.execute(stmt.returning(results.c.fence)).first() is not None

    def fenced_update(conn: Any, id: str, value: str, token: int) -> bool:
        stmt = (
            update(results)
            .where(results.c.id == id, results.c.fence <= token)
            .values(value=value, fence=token)
        )
        return bool(conn.execute(stmt).rowcount == 1)

    engine = sqlalchemy.create_engine(sql_url)
    metadata.create_all(engine)
    try:
        with engine.begin() as conn:
            assert [fenced_write(conn, "r", f"v{t}", t) for t in (5, 5, 4, 6)] == [
                True,
                True,
                False,
                True,
            ]
            assert fenced_update(conn, "r", "old", 2) is False
            assert fenced_update(conn, "r", "same", 6) is True
            assert fenced_write(conn, "s", "first", 2**62) is True  # BIGINT holds any token
            assert fenced_write(conn, "s", "older", 2**62 - 1) is False
            rows = conn.execute(results.select().order_by(results.c.id)).all()
        assert [tuple(r) for r in rows] == [("r", "same", 6), ("s", "first", 2**62)]
    finally:
        metadata.drop_all(engine)
        engine.dispose()


DJANGO_RECIPE = textwrap.dedent(
    """
    import json, sys

    import django
    from django.conf import settings

    from urllib.parse import urlsplit

    engine, where, table = sys.argv[1:4]
    db = {"ENGINE": f"django.db.backends.{engine}", "NAME": where}
    if engine == "postgresql":  # where is a postgresql:// URL
        url = urlsplit(where)
        db.update(NAME=url.path.lstrip("/"), USER=url.username or "", HOST=url.hostname,
                  PORT=str(url.port or 5432), PASSWORD=url.password or "")
    settings.configure(DATABASES={"default": db}, INSTALLED_APPS=[], USE_TZ=True)
    django.setup()

    from django.db import IntegrityError, connection, models, transaction

    class Result(models.Model):
        id = models.CharField(primary_key=True, max_length=200)
        value = models.TextField()
        fence = models.BigIntegerField()

        class Meta:
            app_label = "fencetest"
            db_table = table

    # the docs' code, verbatim
    def fenced_save(id: str, value: str, token: int) -> bool:
        \"\"\"Save ``value`` unless a newer token has written; True if it was applied.\"\"\"
        rows = Result.objects.filter(pk=id, fence__lte=token)
        if rows.update(value=value, fence=token):
            return True
        try:
            with transaction.atomic():  # the first write of this row
                Result.objects.create(id=id, value=value, fence=token)
            return True
        except IntegrityError:  # the row exists: a newer token wrote, or a first write raced
            return rows.update(value=value, fence=token) == 1

    with connection.schema_editor() as editor:
        editor.create_model(Result)
    try:
        out = [fenced_save("r", f"v{t}", t) for t in (5, 5, 4, 6)]
        out.append(fenced_save("s", "first", 2**62))
        out.append(fenced_save("s", "older", 2**62 - 1))
        rows = list(Result.objects.order_by("id").values_list("id", "value", "fence"))
    finally:
        with connection.schema_editor() as editor:
            editor.delete_model(Result)
    print(json.dumps({"applied": out, "rows": rows}))
    """
)


@pytest.mark.parametrize("engine", ["sqlite3", "postgresql"])
def test_the_django_recipe(engine: str, leases_prefix: str, tmp_path: Path) -> None:
    pytest.importorskip("django")
    name = str(tmp_path / "fence.db") if engine == "sqlite3" else _postgres_or_skip()
    proc = subprocess.run(
        [sys.executable, "-c", DJANGO_RECIPE, engine, name, _table_name(leases_prefix)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["applied"] == [True, True, False, True, True, False]
    assert result["rows"] == [["r", "v6", 6], ["s", "first", 2**62]]
