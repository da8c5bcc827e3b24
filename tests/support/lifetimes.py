"""Lifetime records (see celery_leases/_restart_check.py) as tests set and read them."""

from __future__ import annotations

from typing import Any


def server_identity(client: Any) -> str:
    """``"<run_id>/<master_replid>"`` of the server ``client`` talks to, as the scripts write it."""
    server, replication = client.info("server"), client.info("replication")
    return f"{server['run_id']}/{replication['master_replid']}"


def mark_up(client: Any, record: str) -> None:
    """Write ``record`` as made by this server lifetime with no grace left: the group is up."""
    client.set(record, f"0 {server_identity(client)}")
