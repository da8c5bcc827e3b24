"""Wrong arguments to hold/ahold and wrong rendered names are refused clearly, before Redis.

The Leases here point at a port where nothing listens: every refusal must come before any
Redis call (a LeaseBackendError would mean the argument reached the store).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any

import pytest
from celery import Celery

from celery_leases import LeasedTask, Leases, Shared
from celery_leases._keys import UNIQUE_PREFIX, Keyspace
from celery_leases._lease import MAX_NAME_BYTES, Want
from celery_leases.exceptions import LeaseConfigError

NOWHERE = "redis://127.0.0.1:1/0"


def enter(hold: AbstractContextManager[Any]) -> None:
    """Enter a hold that must be refused on the way in."""
    with hold:
        raise AssertionError("not reached: the hold was granted")


@pytest.fixture
def leases() -> Iterator[Leases]:
    ext = Leases(Celery("args", set_as_current=False), redis_url=NOWHERE)
    yield ext
    ext.store.close()


@pytest.mark.parametrize("resource", [42, None, b"report:42", 4.5, {"a": 1}])
def test_hold_of_a_non_name_raises_type_error_naming_the_argument(
    leases: Leases, resource: Any
) -> None:
    with pytest.raises(TypeError, match=r"hold\(resource\).* must be a name \(str\)") as info:
        enter(leases.hold(resource))
    assert repr(resource) in str(info.value)
    assert "not iterable" not in str(info.value)
    # also a LeaseConfigError, which ahold(5) raised before: both old and new catches work
    assert isinstance(info.value, LeaseConfigError)


def test_hold_of_a_list_with_a_non_name_names_its_index(leases: Leases) -> None:
    with pytest.raises(TypeError, match=r"hold\(resource\[1\]\) must be a name.*42 \(int\)"):
        enter(leases.hold(["a", 42]))  # type: ignore[list-item]


def test_ahold_of_a_non_name_raises_type_error(leases: Leases) -> None:
    async def main() -> None:
        with pytest.raises(TypeError, match=r"ahold\(resource\)"):
            async with leases.ahold(42):  # type: ignore[call-overload]
                raise AssertionError("not reached")
        with pytest.raises(TypeError, match=r"ahold\(resource\[0\]\)"):
            async with leases.ahold([b"x", "y"]):  # type: ignore[list-item]
                raise AssertionError("not reached")

    asyncio.run(main())


@pytest.mark.parametrize("wait", [-1, -0.5, float("nan")])
def test_negative_wait_is_refused(leases: Leases, wait: float) -> None:
    with pytest.raises(LeaseConfigError, match="wait must be 0"):
        leases.hold("a", wait=wait)
    with pytest.raises(LeaseConfigError, match="wait must be 0"):
        leases.ahold("a", wait=wait)


def test_empty_name_is_still_refused(leases: Leases) -> None:
    with pytest.raises(LeaseConfigError, match="non-empty"), leases.hold(""):
        raise AssertionError("not reached")


@pytest.mark.parametrize(
    "resource",
    ["celery_leases:once:x", Shared("celery_leases:beat:leader"), ["ok", "celery_leases:unique:k"]],
)
def test_names_in_the_library_namespace_are_refused(leases: Leases, resource: Any) -> None:
    with pytest.raises(LeaseConfigError, match="celery_leases' own namespace"):
        enter(leases.hold(resource))


def test_a_refused_name_is_refused_at_every_hold(leases: Leases) -> None:
    # hold() keeps the Want of each plain name it accepted; a refusal is never kept
    for _ in range(3):
        with pytest.raises(LeaseConfigError, match="celery_leases' own namespace"):
            enter(leases.hold("celery_leases:once:again"))
        with pytest.raises(LeaseConfigError, match="non-empty"):
            enter(leases.hold(""))


def test_task_template_rendering_to_an_empty_name_is_refused() -> None:
    app = Celery("empty-render", set_as_current=False)

    @app.task(base=LeasedTask, shared=False, lease="{name}")
    def named(name: str) -> None: ...

    task = named._get_current_object()
    assert [w.resource for w in task._render_leases(("x",), {})] == ["x"]
    with pytest.raises(LeaseConfigError, match=r"'\{name\}' renders to an empty name"):
        task._render_leases(("",), {})


def test_task_templates_rendering_to_a_name_too_long_are_refused() -> None:
    # declared, a template cannot know its length: each rendering is checked
    app = Celery("long-render", set_as_current=False)

    @app.task(base=LeasedTask, shared=False, leases=["a:{x}", Shared("s:{x}")], unique="u:{x}")
    def long_named(x: str) -> None: ...

    task = long_named._get_current_object()
    fits = "x" * (MAX_NAME_BYTES - 2)
    assert [w.resource for w in task._render_leases((fits,), {})] == ["a:" + fits, "s:" + fits]
    assert task._unique_key((fits,), {}) == "u:" + fits
    too_long = fits + "é"
    with pytest.raises(LeaseConfigError) as info:
        task._render_leases((too_long,), {})
    assert str(info.value).startswith(
        f"task {task.name!r}: lease template 'a:{{x}}' renders to a name that is 1,026 bytes"
    )
    assert f"at most {MAX_NAME_BYTES:,} bytes" in str(info.value)
    with pytest.raises(LeaseConfigError, match=r"unique template 'u:\{x\}' renders to a name that"):
        task._unique_key((too_long,), {})


def test_a_name_too_long_is_refused_whatever_made_it() -> None:
    # every lease passes Want: the library's own prefix of a name it made is not counted
    Want(UNIQUE_PREFIX + "k" * MAX_NAME_BYTES)
    Want(Keyspace("p").once_resource("o" * MAX_NAME_BYTES))
    with pytest.raises(LeaseConfigError, match="1,025 bytes"):
        Want(UNIQUE_PREFIX + "k" * (MAX_NAME_BYTES + 1))
    with pytest.raises(LeaseConfigError, match="1,025 bytes"):
        Want("r" * (MAX_NAME_BYTES + 1), "s", 2)
    with pytest.raises(LeaseConfigError, match="UTF-8"):  # a name without a UTF-8 form
        Want("\udfff" * MAX_NAME_BYTES)


def test_a_refused_long_name_is_refused_at_every_hold(leases: Leases) -> None:
    for _ in range(3):
        with pytest.raises(LeaseConfigError, match=r"hold\(resource\) is 1,000,000 bytes"):
            enter(leases.hold("x" * 1_000_000))


def test_task_template_rendering_into_the_library_namespace_is_refused() -> None:
    app = Celery("reserved-render", set_as_current=False)

    @app.task(base=LeasedTask, shared=False, lease="{kind}:{x}")
    def kinded(kind: str, x: int) -> None: ...

    task = kinded._get_current_object()
    with pytest.raises(LeaseConfigError, match="celery_leases' own namespace"):
        task._render_leases(("celery_leases", 1), {})
