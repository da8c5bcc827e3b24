"""A refused connection is no lost reply (issue 27, item 4).

``hold()`` against a port where nothing listens raises ``LeaseBackendError``; it must not
also log that a grant's reply was lost and a grant is held until its TTL: nothing was sent,
so nothing can have been granted.
"""

from __future__ import annotations

import asyncio
import logging
import socket

import pytest
from celery import Celery
from redis.exceptions import ConnectionError as RedisConnectionError

from celery_leases import LeaseBackendError, Leases
from celery_leases._one_attempt import failure_of
from celery_leases._protocol import Command, Send


def _closed_port() -> int:
    """A loopback port where nothing listens (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def refusing() -> Leases:
    url = f"redis://127.0.0.1:{_closed_port()}/0"
    return Leases(Celery("refused", set_as_current=False), redis_url=url, socket_timeout=0.5)


def test_a_refused_connection_is_not_logged_as_a_lost_grant(
    refusing: Leases, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="celery_leases")
    with pytest.raises(LeaseBackendError), refusing.hold("r"):
        pass
    assert "was lost" not in caplog.text
    assert "held until its TTL" not in caplog.text


def test_an_asyncio_refused_connection_is_not_logged_as_a_lost_grant(
    refusing: Leases, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="celery_leases")

    async def hold() -> None:
        async with refusing.ahold("r"):
            pass

    with pytest.raises(LeaseBackendError):
        asyncio.run(hold())
    assert "was lost" not in caplog.text
    assert "held until its TTL" not in caplog.text


def _caused(error: RedisConnectionError, cause: BaseException) -> RedisConnectionError:
    error.__cause__ = cause
    return error


def test_only_an_error_after_the_request_may_have_gone_out_is_a_lost_reply() -> None:
    refused = _caused(RedisConnectionError("Error 111 connecting"), ConnectionRefusedError(111))
    reset = _caused(RedisConnectionError("Error while reading"), ConnectionResetError(104))
    one = Send([Command(("GET", "k"))], once=True)
    retried = Send([Command(("GET", "k"))], once=False)
    assert not failure_of(refused, one).lost
    assert failure_of(reset, one).lost
    assert failure_of(RedisConnectionError("Connection closed by server."), one).lost
    # the client may have sent it on an earlier attempt, then been refused on its retry
    assert failure_of(refused, retried).lost
    assert failure_of(refused).lost
