"""The plumbing of ``celery leases``'s commands: their class, shared options, exit statuses."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final, TypeVar

import click
from celery._state import get_current_app
from celery.bin.base import CeleryCommand, CLIContext

from .app import Leases, find_leases
from .exceptions import LeaseBackendError, LeaseConfigError, LeaseError

if TYPE_CHECKING:
    from celery import Celery


#: exit statuses (sysexits.h) beyond click's 1 (failure) and 2 (usage)
EX_UNAVAILABLE: Final = 69
EX_TEMPFAIL: Final = 75
EX_CONFIG: Final = 78

F = TypeVar("F", bound=Callable[..., Any])


class Failure(click.ClickException):
    """One line on stderr (``Error: ...``) and a non-zero exit, never a traceback."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()))


class _ConfigFailure(Failure):
    exit_code = EX_CONFIG


class BackendFailure(Failure):
    exit_code = EX_UNAVAILABLE


class TryAgain(Failure):
    exit_code = EX_TEMPFAIL


class Command(CeleryCommand):
    """A ``celery leases`` sub-command: library errors become one line and an exit status."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except LeaseConfigError as exc:
            raise _ConfigFailure(str(exc)) from None
        except LeaseBackendError as exc:
            raise BackendFailure(str(exc)) from None
        except LeaseError as exc:
            raise Failure(str(exc)) from None


def json_option(f: F) -> F:
    return click.option(
        "--json", "as_json", is_flag=True, allow_from_autoenv=False, help="Print JSON."
    )(f)


def app_of(ctx: click.Context) -> Celery:
    obj = ctx.find_object(CLIContext)
    return obj.app if obj is not None else get_current_app()


def leases_of(ctx: click.Context) -> Leases:
    """The app's ``Leases`` (made by the app module), or one made now from its settings."""
    app = app_of(ctx)
    return find_leases(app) or Leases(app)


def echo_json(value: object) -> None:
    click.echo(json.dumps(value, indent=2))


def non_empty(what: str, value: str | None) -> None:
    if value is not None and not value.strip():
        raise click.UsageError(f"{what} must not be empty")
