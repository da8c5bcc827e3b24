"""A task's templates (leases, its unique key, its rate limits), checked against its
signature once, when the task is declared."""

from __future__ import annotations

import inspect
import string
from collections.abc import Mapping
from typing import Any

from ._lease import Shared, Want, check_name_size, check_user_name
from .exceptions import LeaseConfigError

__all__ = ("Template", "plain_params")


class Template:
    """A resource template checked against a task signature once, at declaration."""

    __slots__ = ("fields", "limit", "mode", "text", "what")

    def __init__(
        self,
        task_name: str,
        item: object,
        params: Mapping[str, inspect.Parameter],
        what: str = "lease",
    ):
        if isinstance(item, Shared):
            text, self.mode, self.limit = item.name, "s", item.limit or 0
        elif isinstance(item, str) and item:
            text, self.mode, self.limit = item, "x", 0
        else:
            msg = (
                f"task {task_name!r}: a lease must be a non-empty str or Shared(...), not {item!r}"
            )
            raise LeaseConfigError(msg)
        self.text = text
        try:
            parsed = list(string.Formatter().parse(text))
        except ValueError as exc:
            msg = f"task {task_name!r}: {what} template {text!r} is malformed: {exc}"
            raise LeaseConfigError(msg) from None
        accepts_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        fields: list[str] = []
        for _, field, _, _ in parsed:
            if field is None:
                continue
            root = field.split(".", 1)[0].split("[", 1)[0]
            if not root or root.isdigit():
                msg = (
                    f"task {task_name!r}: {what} template {text!r} has a positional field "
                    f"{{{field}}}; name the argument instead, e.g. {{analysis_id}}"
                )
                raise LeaseConfigError(msg)
            param = params.get(root)
            if param is None and not accepts_any:
                msg = (
                    f"task {task_name!r}: {what} template {text!r} names {{{root}}}, which is not "
                    f"a parameter of the task (parameters: {', '.join(params) or 'none'})"
                )
                raise LeaseConfigError(msg)
            if param is not None and param.kind is inspect.Parameter.VAR_POSITIONAL:
                msg = f"task {task_name!r}: {what} template {text!r} cannot name *{root}"
                raise LeaseConfigError(msg)
            fields.append(root)
        self.fields = tuple(fields)
        self.what = what
        # its names are at least as long as its text outside the fields: known now
        literal = "".join(text for text, _, _, _ in parsed)
        check_name_size(literal, f"task {task_name!r}: {what} template, without its fields,")

    def render(self, task_name: str, bound: Mapping[str, Any]) -> Want:
        try:
            name = self.text.format_map(bound)
        except (KeyError, AttributeError, IndexError, ValueError, TypeError) as exc:
            msg = f"task {task_name!r}: cannot render {self.what} {self.text!r}: {exc!r}"
            raise LeaseConfigError(msg) from None
        if not name:
            msg = (
                f"task {task_name!r}: {self.what} template {self.text!r} renders to an empty "
                "name for these arguments"
            )
            raise LeaseConfigError(msg)
        check_name_size(
            name, f"task {task_name!r}: {self.what} template {self.text!r} renders to a name that"
        )
        if self.what == "lease":
            check_user_name(name, f"task {task_name!r}: lease {self.text!r} renders to")
        return Want(name, "x" if self.mode == "x" else "s", self.limit)


def plain_params(signature: inspect.Signature) -> tuple[tuple[str, ...], dict[str, Any]] | None:
    """``(names, defaults)`` of a signature whose parameters are all positional-or-keyword;
    None for any other (``*args``, ``**kwargs``, keyword-only, positional-only)."""
    params = signature.parameters.values()
    if any(p.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params):
        return None
    names = tuple(p.name for p in params)
    defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
    return names, defaults
