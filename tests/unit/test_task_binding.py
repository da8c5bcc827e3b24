"""A leased task's arguments are bound to its signature as ``Signature.bind`` would bind them.

Plain signatures take a fast path (``LeasedTask._bound_values`` without ``bind``): every call
here is checked against ``bind`` + ``apply_defaults``, and calls that do not fit must still be
refused with bind's reason.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest
from celery import Celery

from celery_leases import LeasedTask
from celery_leases.exceptions import LeaseConfigError

app = Celery("binding", set_as_current=False)


@app.task(base=LeasedTask, lease="r:{a}:{b}:{c}", shared=False)
def plain(a: Any, b: Any = 2, c: Any = 3) -> None: ...


@app.task(base=LeasedTask, lease="r:{a}:{rest}", shared=False)
def with_kwargs(a: Any, **rest: Any) -> None: ...


@app.task(base=LeasedTask, lease="r:{a}:{k}", shared=False)
def keyword_only(a: Any, *, k: Any = 1) -> None: ...


def expected(task: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    bound = task._lease_signature.bind(*args, **kwargs)
    bound.apply_defaults()
    values = dict(bound.arguments)
    for param in task._lease_signature.parameters.values():
        if param.kind is inspect.Parameter.VAR_KEYWORD:
            values.update(values.pop(param.name, {}))
    return values


FITTING = [
    ((1,), {}),
    ((1, 5), {}),
    ((1, 5, 6), {}),
    ((), {"a": 1}),
    ((1,), {"c": 9}),
    ((), {"c": 9, "a": 1, "b": 0}),
    ((None,), {"b": None}),
]


@pytest.mark.parametrize(("args", "kwargs"), FITTING)
def test_the_fast_path_binds_as_signature_bind(args: tuple[Any, ...], kwargs: dict[str, Any]):
    assert plain._plain_params is not None  # the fast path is taken
    assert plain._bound_values(args, kwargs) == expected(plain, args, kwargs)


@pytest.mark.parametrize(
    ("args", "kwargs", "reason"),
    [
        ((), {}, "missing a required argument: 'a'"),
        ((1, 2, 3, 4), {}, "too many positional arguments"),
        ((1,), {"a": 1}, "multiple values for argument 'a'"),
        ((1,), {"d": 1}, "unexpected keyword argument 'd'"),
        ((), {"b": 1}, "missing a required argument: 'a'"),
    ],
)
def test_arguments_that_do_not_fit_are_refused_with_binds_reason(
    args: tuple[Any, ...], kwargs: dict[str, Any], reason: str
):
    with pytest.raises(LeaseConfigError, match="arguments do not fit the task") as info:
        plain._bound_values(args, kwargs)
    assert reason in str(info.value)


@pytest.mark.parametrize(
    ("task", "args", "kwargs"),
    [
        (with_kwargs, (1,), {"rest": 2, "x": 3}),
        (keyword_only, (1,), {}),
        (keyword_only, (1,), {"k": 5}),
    ],
)
def test_other_signatures_bind_through_signature_bind(
    task: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
):
    assert task._plain_params is None
    assert task._bound_values(args, kwargs) == expected(task, args, kwargs)
