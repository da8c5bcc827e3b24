"""The web example at full size: 4 uvicorn replicas, 10,000 requests, 500 at once, a ledger.

``example_project/web_load.py`` starts the replicas, drives them and checks the ledger itself
(overlaps, fenced writes, tokens per step); this test runs it as a user would and checks what
it reports, and that it left no key behind.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import redis

REPO = Path(__file__).resolve().parents[2]
REPLICAS = 4
REQUESTS = 10_000


def test_web_replicas_never_overlap(leases_redis_url: str, leases_prefix: str):
    argv = [
        sys.executable, "-m", "example_project.web_load",
        "--replicas", str(REPLICAS), "--requests", str(REQUESTS), "--concurrency", "500",
        "--analyses", "20", "--steps", "5",  # 100 steps: about 5 requests wait for each
        "--redis-url", leases_redis_url, "--prefix", leases_prefix, "--json",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("CELERY_LEASES_")}
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"load script failed:\n{proc.stdout}\n{proc.stderr}"
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["passed"] is True
    assert result["overlaps"] == 0
    assert result["stale"] == 0
    assert result["tokens_monotonic"] is True
    assert result["errors"] == 0
    assert result["ok"] + result["busy"] == REQUESTS
    assert result["ok"] == result["entries"] > 0
    assert len(result["per_replica"]) == REPLICAS  # every replica served requests
    client = redis.Redis.from_url(leases_redis_url)
    try:
        assert list(client.scan_iter(match=f"{{{leases_prefix}:*", count=1000)) == []
    finally:
        client.close()
