"""The code blocks of README.md and docs/: read, and run as written against a real Redis.

Every ```python block of README.md and of the pages in docs/ runs (``python -m
tests.support.docs_blocks --redis-url URL``, a step of ``scripts/test``; also
tests/integration/test_docs_blocks.py), each page in a process of its own, its blocks in
order in one namespace, as a reader pastes them one after the other:

- A block that is a fragment (it uses names the page does not define, a service the test
  machine lacks, or shows a shape rather than a program) says so on the line just before it,
  with why: ``<!-- fragment: needs a Django project -->``. The runner skips it and counts it.
- A block whose first line is ``# path/to/module.py`` (optionally ``, ...`` after it) is a
  file: it is written there (appended, if an earlier block wrote the file) in the page's
  scratch directory, which is on ``sys.path``, and imported; its names join the namespace.
- A page's namespace starts with the quickstart's names: ``app`` (``Celery("proj")``),
  ``Celery``, ``Leases``, ``LeasedTask``, ``Shared``, ``current_leases``, and ``leases =
  Leases(app)`` unless a block of the page makes its own ``Leases(app``. A block that makes
  its own (an alternative set-up, such as each of metrics.md's) gets a new ``app`` first,
  unless it makes its ``app`` too.
- Before it runs anything, the page's blocks are checked for names used and never defined
  (ruff's F821, over all of them laid at their lines of the page): a function's body that
  only runs later, in a worker, must not use a name the page does not give it.
- Top-level ``await`` and ``async with`` run on one event loop per page.
- ``redis://localhost:6379/N`` is the test Redis, a ``broker=`` is ``memory://`` (nothing
  is sent to a real queue), and every ``key_prefix`` and ``prefix="..."`` gets this run's
  own prefix; the keys under it are deleted afterwards (no other key is touched).

The runner prints, per page and in all, how many blocks ran and how many were skipped as
fragments, and exits 1 when a block failed.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import importlib
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
import traceback
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
_FENCE = re.compile(r"^```python\n", re.M)
#: the marker on the line before a block the runner skips (HTML comment: not rendered)
FRAGMENT = re.compile(r"^<!--\s*fragment:\s*(?P<why>.+?)\s*-->\s*$")
_FILE = re.compile(r"^#\s*(?P<path>[\w/]+\.py)\b")


def python_blocks(page: str) -> list[str]:
    """The ```python blocks of one page of docs/, in order."""
    return _BLOCK.findall((ROOT / "docs" / page).read_text())


def pages() -> list[Path]:
    """README.md and every page of docs/ that has a ```python block, but generated ones."""
    found = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return [
        p
        for p in found
        if _FENCE.search(p.read_text()) and not p.read_text().startswith("<!-- generated")
    ]


@dataclass(frozen=True)
class Block:
    """One ```python block of a page."""

    page: str  # relative to the repository
    line: int  # of its first line of code, 1-based
    code: str
    fragment: str | None  # why it is skipped, from its marker; None: it runs

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def file(self) -> str | None:
        """The module path its first line names (``# proj/app.py``), if it is a file."""
        first = self.code.split("\n", 1)[0]
        match = _FILE.match(first)
        return match["path"] if match else None


def blocks(path: Path) -> list[Block]:
    """The ```python blocks of ``path``, with the fragment marker of each."""
    text = path.read_text()
    out: list[Block] = []
    for match in _BLOCK.finditer(text):
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = FRAGMENT.match(before.strip())
        line = text.count("\n", 0, match.start(1)) + 1
        page = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)
        out.append(Block(page, line, match.group(1), marker["why"] if marker else None))
    return out


@dataclass
class PageResult:
    """What running one page's blocks did."""

    page: str
    ran: int = 0
    skipped: int = 0
    failures: list[str] = field(default_factory=list)


def adapt(code: str, redis_url: str, prefix: str) -> str:
    """``code`` pointed at the test Redis, an in-memory broker and this run's prefix."""
    code = re.sub(r"broker=\"redis://[^\"]*\"", 'broker="memory://"', code)
    code = re.sub(r"redis://localhost:6379/\d+", redis_url, code)
    code = re.sub(r"\bprefix=\"", f'prefix="{prefix}-', code)
    return code


def _import_file(scratch: Path, rel: str, code: str, ns: dict[str, Any]) -> None:
    target = scratch / rel
    target.parent.mkdir(parents=True, exist_ok=True)
    for parent in target.relative_to(scratch).parents:
        init = scratch / parent / "__init__.py"
        if parent != Path(".") and not init.exists():
            init.write_text("")
    with target.open("a") as out:
        out.write(code + "\n")
    name = rel.removesuffix(".py").replace("/", ".")
    importlib.invalidate_caches()
    module = sys.modules.get(name)
    module = importlib.reload(module) if module else importlib.import_module(name)
    ns.update({k: v for k, v in vars(module).items() if not k.startswith("__")})


def _new_app() -> Any:
    from celery import Celery

    return Celery("proj", broker="memory://", set_as_current=False)


def _base_namespace(path: Path) -> dict[str, Any]:
    from celery import Celery

    from celery_leases import LeasedTask, Leases, Shared, current_leases

    app = _new_app()
    ns: dict[str, Any] = {
        "__name__": "__docs__",
        "Celery": Celery,
        "Leases": Leases,
        "LeasedTask": LeasedTask,
        "Shared": Shared,
        "current_leases": current_leases,
        "app": app,
    }
    if not any("Leases(app" in b.code for b in blocks(path) if b.fragment is None):
        ns["leases"] = Leases(app)
    return ns


#: the names a page's namespace starts with (see the module's docstring)
BASE_NAMES: tuple[str, ...] = (
    "app",
    "leases",
    "Celery",
    "Leases",
    "LeasedTask",
    "Shared",
    "current_leases",
)


def undefined_names(path: Path) -> list[str]:
    """``page:line: ...`` for each name the page's runnable blocks use and never define."""
    lines: list[str] = []
    for block in blocks(path):
        if block.fragment is None:
            lines += [""] * (block.line - 1 - len(lines))
            lines += block.code.splitlines()
    builtins = "[" + ", ".join(f"'{name}'" for name in BASE_NAMES) + "]"
    argv = ["ruff", "check", "--isolated", "--no-cache", "--select", "F821"]
    argv += ["--config", f"builtins = {builtins}", "--output-format", "concise"]
    argv += ["--stdin-filename", str(path.with_suffix(".py")), "-"]
    proc = subprocess.run(
        argv, input="\n".join(lines) + "\n", capture_output=True, text=True, check=False
    )
    page = str(path.relative_to(ROOT))
    if proc.returncode not in (0, 1):  # 2: ruff itself failed
        return [f"{page}: ruff could not check the blocks: {proc.stderr.strip()[:300]}"]
    found = re.findall(r"\.py:(\d+):\d+: (F821 .*)", proc.stdout)
    return [f"{page}:{line}: {what}" for line, what in found]


def run_page(path: Path, redis_url: str, prefix: str) -> PageResult:
    """Run the blocks of one page, in this process (see the module's docstring)."""
    result = PageResult(str(path.relative_to(ROOT)))
    result.failures += undefined_names(path)
    loop = asyncio.new_event_loop()
    ns = _base_namespace(path)
    with tempfile.TemporaryDirectory(prefix="docs-blocks-") as tmp:
        scratch = Path(tmp)
        sys.path.insert(0, tmp)
        cwd = os.getcwd()
        os.chdir(tmp)
        try:
            for block in blocks(path):
                if block.fragment is not None:
                    result.skipped += 1
                    continue
                code = adapt(block.code, redis_url, prefix)
                if "Leases(app" in code and not re.search(r"^app = ", code, re.M):
                    ns["app"] = _new_app()
                try:
                    if block.file is not None:
                        _import_file(scratch, block.file, code, ns)
                    else:
                        # line numbers of tracebacks are the page's
                        source = "\n" * (block.line - 1) + code
                        compiled = compile(
                            source, block.page, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT
                        )
                        done = eval(compiled, ns)
                        if inspect.iscoroutine(done):
                            loop.run_until_complete(done)
                except BaseException as exc:
                    if isinstance(exc, KeyboardInterrupt):
                        raise
                    tail = traceback.format_exception_only(type(exc), exc)[-1].strip()
                    result.failures.append(f"{block.where}: {tail}")
                else:
                    result.ran += 1
        finally:
            os.chdir(cwd)
            sys.path.remove(tmp)
            loop.close()
    return result


def _clean(redis_url: str, prefix: str) -> None:
    import redis

    client = redis.Redis.from_url(redis_url)
    try:
        keys = list(client.scan_iter(match=f"*{prefix}*", count=1000))
        for key in keys:
            client.delete(key)
    finally:
        client.close()


def run_all(redis_url: str, selected: list[Path] | None = None) -> list[PageResult]:
    """Every page, each in a subprocess of its own; the keys it made deleted after."""
    results: list[PageResult] = []
    for path in selected or pages():
        prefix = f"docsblocks-{uuid.uuid4().hex[:8]}"
        env = {
            **os.environ,
            "CELERY_LEASES_KEY_PREFIX": prefix,
            "CELERY_LEASES_REDIS_URL": redis_url,
        }
        argv = [sys.executable, "-m", "tests.support.docs_blocks", "--one", str(path)]
        argv += ["--redis-url", redis_url, "--prefix", prefix]
        try:
            proc = subprocess.run(
                argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False
            )
        finally:
            _clean(redis_url, prefix)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        if proc.returncode != 0 or not lines:
            page = str(path.relative_to(ROOT))
            why = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
            results.append(PageResult(page, failures=[f"{page}: the run died: {' | '.join(why)}"]))
            continue
        results.append(PageResult(**json.loads(lines[-1])))
    return results


def report(results: list[PageResult]) -> str:
    """The lines the runner prints: one per page, then the totals."""
    out = [
        f"{r.page}: {r.ran} ran, {r.skipped} skipped (fragments)"
        + (f", {len(r.failures)} FAILED" if r.failures else "")
        for r in results
    ]
    out += [f"  {failure}" for r in results for failure in r.failures]
    ran, skipped = sum(r.ran for r in results), sum(r.skipped for r in results)
    failed = sum(len(r.failures) for r in results)
    out.append(
        f"docs blocks: {ran} ran, {skipped} skipped (fragments), {failed} failed, "
        f"in {len(results)} pages"
    )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--redis-url", default=os.environ.get("CELERY_LEASES_TEST_REDIS_URL"))
    parser.add_argument("--one", help="run one page in this process (JSON on stdout)")
    parser.add_argument("--prefix", default=f"docsblocks-{uuid.uuid4().hex[:8]}")
    parser.add_argument("pages", nargs="*", help="pages to run (default: all)")
    args = parser.parse_args(argv)
    if not args.redis_url:
        parser.error("--redis-url (or CELERY_LEASES_TEST_REDIS_URL) is required")
    if args.one:
        result = run_page(Path(args.one).resolve(), args.redis_url, args.prefix)
        sys.stdout.write(json.dumps(result.__dict__) + "\n")
        return 0
    selected = [Path(p).resolve() for p in args.pages] or None
    results = run_all(args.redis_url, selected)
    print(report(results))
    return 1 if any(r.failures for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
