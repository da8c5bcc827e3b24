"""Write docs/configuration.md from the settings model (never copy settings by hand).

Usage: python scripts/gen_config_docs.py [--check]
"""

from __future__ import annotations

import sys
from pathlib import Path

from celery_leases.config import CONF_PREFIX, ENV_PREFIX, LeaseSettings

TARGET = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"

HEADER = """# Configuration

<!-- generated from celery_leases.config.LeaseSettings by scripts/gen_config_docs.py -->

Every setting can be given in four places; the first that has it wins:

1. keyword arguments: `Leases(app, ttl=60)`
2. the Celery config: `app.conf.leases_ttl = 60`
3. the environment: `CELERY_LEASES_TTL=60`
4. the default below.

A wrong value fails at `Leases(app)` with a `LeaseConfigError` (also a `ValueError`) that names
the setting and where it came from, e.g. `setting 'ttl' from app.conf.leases_ttl: Input should
be greater than or equal to 0.05 (got -1)`. An unknown `app.conf.leases_*` key is an error too,
so a typo never goes unnoticed.

Per task, `LeasedTask` takes `lease_ttl`, `on_busy`, `on_lost`, `busy_timeout` and
`wait_timeout` as task options; the settings below are their app-wide defaults.

| setting | `app.conf` key / environment variable | default | meaning |
| --- | --- | --- | --- |
"""


def render() -> str:
    rows = []
    for name, field in LeaseSettings.model_fields.items():
        default = field.default
        shown = "*(see meaning)*" if default is None else f"`{default!r}`"
        where = f"`{CONF_PREFIX}{name}`<br>`{ENV_PREFIX}{name.upper()}`"
        # "|" would end the table cell; "[" would start a Markdown reference link, as in
        # "host:port[,host:port...][/db]", which mkdocs-autorefs then reports as unresolved
        meaning = (field.description or "").replace("|", "\\|").replace("[", "\\[")
        rows.append(f"| `{name}` | {where} | {shown} | {meaning} |")
    return HEADER + "\n".join(rows) + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if TARGET.read_text() != text:
            print(f"{TARGET} is out of date: run python scripts/gen_config_docs.py")
            return 1
        return 0
    TARGET.write_text(text)
    print(f"wrote {TARGET}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
