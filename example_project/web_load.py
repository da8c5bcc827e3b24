"""Load test of the web example: N uvicorn replicas, thousands of concurrent requests, a ledger.

``scripts/web-demo`` runs it against database 14 (or a private Redis)::

    scripts/web-demo                                # 4 replicas, 10,000 requests
    scripts/web-demo --replicas 2 --requests 500    # smaller
    python -m example_project.web_load --url http://10.0.0.5:8000 --url ...   # running replicas

It starts the replicas (``uvicorn example_project.web:app`` on free loopback ports) unless
``--url`` names running ones, sends ``--requests`` POSTs to ``/analyses/{a}/steps/{s}`` over
``--concurrency`` connections spread across the replicas, each for a random (analysis, step)
of ``--analyses`` x ``--steps``, and then reads the replicas' ledger back. It prints requests,
ok, busy, errors, overlaps (two requests inside one step at once: must be 0), stale (fenced
writes refused: must be 0), whether the tokens of every step only grew, p50/p99 latency and
wall time, and exits non-zero if anything is off. Every key it made is deleted at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import secrets
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis

from example_project.web import ledger_key

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Result:
    replicas: int
    requests: int
    concurrency: int
    keys: int
    ok: int = 0
    busy: int = 0
    errors: int = 0
    overlaps: int = 0
    stale: int = 0
    tokens_monotonic: bool = True
    entries: int = 0
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    max_ms: float = 0.0
    wall_s: float = 0.0
    per_replica: dict[str, int] = field(default_factory=dict)
    error_samples: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return (
            self.overlaps == 0
            and self.stale == 0
            and self.tokens_monotonic
            and self.errors == 0
            and self.ok > 0
            and self.entries == self.ok
        )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Replicas:
    """``count`` uvicorn processes serving example_project.web on loopback ports."""

    def __init__(self, count: int, env: dict[str, str], logdir: Path) -> None:
        self.procs: list[tuple[subprocess.Popen[bytes], Path]] = []
        self.urls: list[str] = []
        for n in range(count):
            port = free_port()
            log = logdir / f"replica-{n}.log"
            argv = [
                sys.executable, "-m", "uvicorn", "example_project.web:app",
                "--host", "127.0.0.1", "--port", str(port),
                "--log-level", "warning", "--no-access-log",
                "--backlog", "4096", "--timeout-graceful-shutdown", "10",
                # longer than any request waits: a replica that closes an idle keep-alive
                # connection as a lane sends on it fails that request
                "--timeout-keep-alive", "120",
            ]  # fmt: skip
            with open(log, "wb") as out:
                proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=out)
            self.procs.append((proc, log))
            self.urls.append(f"http://127.0.0.1:{port}")

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for (proc, log), url in zip(self.procs, self.urls, strict=True):
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"replica {url} exited:\n{log.read_text()}")
                try:
                    if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"replica {url} not ready after {timeout:.0f}s")
                time.sleep(0.05)

    def stop(self) -> None:
        for proc, _ in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc, _ in self.procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)

    def logs(self) -> str:
        return "\n".join(
            f"--- {log.name}\n{log.read_text(errors='replace')}" for _, log in self.procs
        )


async def drive(urls: list[str], args: argparse.Namespace, result: Result) -> list[float]:
    """Send the requests; returns the latencies (seconds) of the answered ones.

    ``--concurrency`` lanes, each an ``httpx.AsyncClient`` with one keep-alive connection to
    one replica (lane i to replica i mod N), take the next request from a shared plan. One
    client per connection: httpx's pool costs more than the leases when one client holds
    hundreds of busy connections (measured here: stalls of seconds).
    """
    rng = random.Random(args.seed)
    plan = [(rng.randrange(args.analyses), rng.randrange(args.steps)) for _ in range(args.requests)]
    plan.reverse()  # lanes pop from the end
    latencies: list[float] = []
    replicas: Counter[str] = Counter()
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    timeout = httpx.Timeout(args.wait + 30.0)
    tls = ssl.create_default_context()  # one for all lanes: each costs a read of the CA store

    def error(text: str) -> None:
        result.errors += 1
        if len(result.error_samples) < 5:
            result.error_samples.append(text)

    async def lane(url: str) -> None:
        async with httpx.AsyncClient(
            limits=limits, timeout=timeout, verify=tls, trust_env=False
        ) as client:
            while plan:
                analysis, step = plan.pop()
                start = time.monotonic()
                try:
                    reply = await client.post(f"{url}/analyses/{analysis}/steps/{step}")
                except httpx.HTTPError as exc:
                    error(f"{type(exc).__name__}: {exc}")
                    continue
                latencies.append(time.monotonic() - start)
                if reply.status_code == 200:
                    result.ok += 1
                    replicas[reply.json()["replica"]] += 1
                elif reply.status_code == 409:
                    result.busy += 1
                else:
                    error(f"{reply.status_code}: {reply.text[:200]}")

    await asyncio.gather(*(lane(urls[i % len(urls)]) for i in range(args.concurrency)))
    result.per_replica = dict(replicas)
    return latencies


def read_ledger(client: redis.Redis, prefix: str, result: Result) -> None:
    result.overlaps = int(client.get(ledger_key(prefix, "overlaps")) or 0)
    result.stale = int(client.get(ledger_key(prefix, "stale")) or 0)
    steps = sorted(str(s) for s in client.smembers(ledger_key(prefix, "steps")))
    result.keys = len(steps)
    for step in steps:
        analysis, _, number = step.partition(":")
        tokens = [
            int(t) for t in client.lrange(ledger_key(prefix, "tokens", analysis, number), 0, -1)
        ]
        result.entries += len(tokens)
        if any(b <= a for a, b in itertools.pairwise(tokens)):
            result.tokens_monotonic = False
        if int(client.get(ledger_key(prefix, "active", analysis, number)) or 0) != 0:
            result.overlaps += 1  # someone never left: counts against the run


def delete_keys(client: redis.Redis, match: str) -> int:
    """Delete the keys that match ``match`` (SCAN + UNLINK)."""
    deleted = 0
    batch: list[Any] = []
    for key in client.scan_iter(match=match, count=1000):
        batch.append(key)
        if len(batch) >= 500:
            deleted += int(client.unlink(*batch))
            batch = []
    if batch:
        deleted += int(client.unlink(*batch))
    return deleted


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--redis-url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/14")
    )
    parser.add_argument(
        "--prefix", default=None, help="key prefix of this run (default: a new one)"
    )
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--url", action="append", default=[], help="a running replica (repeatable)")
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=500)
    parser.add_argument("--analyses", type=int, default=50)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument(
        "--wait", type=float, default=60.0, help="seconds a request waits for its step"
    )
    parser.add_argument(
        "--work", type=float, default=0.005, help="seconds of work inside the lease"
    )
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--json", action="store_true", help="print the result as one JSON line too")
    parser.add_argument("--keep-keys", action="store_true", help="do not delete the run's keys")
    args = parser.parse_args(argv)
    if args.url and not args.prefix:
        parser.error("--url needs --prefix: the WEB_PREFIX the running replicas use")

    prefix = args.prefix or f"web-{secrets.token_hex(4)}"
    client = redis.Redis.from_url(args.redis_url, decode_responses=True)
    count = len(args.url) or args.replicas
    result = Result(replicas=count, requests=args.requests, concurrency=args.concurrency, keys=0)
    env = {
        **os.environ,
        "REDIS_URL": args.redis_url,
        "WEB_PREFIX": prefix,
        "WEB_WAIT": str(args.wait),
        "WEB_WORK": str(args.work),
        "PYTHONUNBUFFERED": "1",
    }
    replicas: Replicas | None = None
    with tempfile.TemporaryDirectory(prefix="web-load-") as logdir:
        try:
            if args.url:
                urls = args.url
            else:
                replicas = Replicas(args.replicas, env, Path(logdir))
                replicas.wait_ready(60)
                urls = replicas.urls
            what = f"{args.requests} requests, {args.concurrency} at once, to {len(urls)} replicas"
            print(f"==> {what}; {args.analyses} x {args.steps} steps; prefix {prefix}", flush=True)
            start = time.monotonic()
            latencies = asyncio.run(drive(urls, args, result))
            result.wall_s = time.monotonic() - start
        finally:
            if replicas is not None:
                replicas.stop()
        read_ledger(client, prefix, result)
        if result.errors and replicas is not None:
            print(replicas.logs()[-4000:], file=sys.stderr)
    result.p50_ms = 1000 * percentile(latencies, 0.50)
    result.p99_ms = 1000 * percentile(latencies, 0.99)
    result.max_ms = 1000 * max(latencies, default=0.0)
    if not args.keep_keys:
        # every key of the run: the leases' and the ledger's; with running replicas (--url)
        # only the ledger, since their leases' keys are theirs
        delete_keys(client, f"{{{prefix}:ledger}}*" if args.url else f"{{{prefix}:*")
    client.close()

    print(f"requests          {result.requests}")
    print(f"ok                {result.ok}")
    print(f"busy              {result.busy}")
    print(f"errors            {result.errors}  {result.error_samples or ''}")
    print(f"steps touched     {result.keys}")
    print(f"ledger entries    {result.entries}")
    print(f"overlaps          {result.overlaps}")
    print(f"stale (fenced)    {result.stale}")
    print(f"tokens monotonic  {'yes, per step' if result.tokens_monotonic else 'NO'}")
    p50, p99, top = result.p50_ms, result.p99_ms, result.max_ms
    print(f"latency           p50 {p50:.1f} ms, p99 {p99:.1f} ms, max {top:.1f} ms")
    rate = result.requests / max(result.wall_s, 1e-9)
    print(f"wall time         {result.wall_s:.2f} s ({rate:.0f} requests/s)")
    print(f"per replica       {sorted(result.per_replica.values())}")
    print("PASS" if result.passed else "FAIL")
    if args.json:
        print(json.dumps({**asdict(result), "passed": result.passed}))
    return 0 if result.passed else 1


if __name__ == "__main__":
    sys.exit(main())
