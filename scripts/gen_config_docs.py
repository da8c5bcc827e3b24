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
2. the Celery config: `app.conf.leases_ttl = 60`, or `CELERY_LEASES_TTL = 60` in the object
   given to `app.config_from_object(obj, namespace="CELERY")`
3. the environment: `CELERY_LEASES_TTL=60`
4. the default below.

The Celery config is read the way Celery reads its own settings. After
`app.config_from_object("django.conf:settings", namespace="CELERY")` a setting is looked up as
`CELERY_LEASES_<NAME>` first and as `leases_<name>` second, in each of Celery's maps in turn:
what was set on `app.conf` directly (`app.conf.leases_ttl = ...`, `app.conf.update(...)`)
before the config object. Without a namespace only `leases_<name>` keys count, as for Celery's
own settings. The environment variable `CELERY_LEASES_TTL` and the config key
`CELERY_LEASES_TTL` are different places: the config key wins, and the environment is read only
for a setting the config does not have.

A wrong value fails at `Leases(app)` with a `LeaseConfigError` (also a `ValueError`) that names
the setting and where it came from, e.g. `setting 'ttl' from app.conf.leases_ttl: Input should
be greater than or equal to 0.05 (got -1)`. An unknown key is an error too, under either
spelling (`leases_ttll`, or `CELERY_LEASES_TTLL` in a namespaced config object), and so is a
near-miss of the namespace that nothing would read (`CELERY_LEASE_LOST_MARGIN`, `lease_ttl`, or
`CELERY_LEASES_TTL` in a config loaded without `namespace=`); an unknown `CELERY_LEASES_*`
environment variable is logged (WARNING, once per process) and ignored, since the environment
is shared with other programs. Each names the setting it was probably meant to be (`did you
mean CELERY_LEASES_LOST_MARGIN?`), so a typo never goes unnoticed.

## When settings are read

Celery reads its configuration lazily, so `Leases(app)` may come before the config is complete
(a Django project's `celery.py` often makes the app, `Leases(app)`, and only then calls
`app.config_from_object`). The settings are resolved at `Leases(app)`, so that a wrong value
fails there, and **again at first use** — the first lease, `once`, receipt read, worker start
or beat start — which is what they then stay. A key set between `Leases(app)` and the first use
counts; an invalid one fails at the first use. Reading `leases.settings` is not a use: before
the first use it shows the settings resolved from the config as it is then.

After the first use they never change, and are never half-applied. A `leases_*` or
`CELERY_LEASES_*` key changed later is refused with a `LeaseConfigError` naming it and both
values (`... changed after their first use: leases_ttl (30.0 -> 9.0) ...`): every acquire looks
at what was written to `app.conf` and at a new `config_from_object` (about 1 µs), and worker and
beat start read every key again, the config object's included. Environment variables are read
at `Leases(app)` and at the first use, not after. To change a setting, restart the process.

One app has one `Leases(app)`: a second one raises `LeaseConfigError`; import the first one
(it is also `app.leases`).

## Timing checks

As Kubernetes' leader election checks its lease duration, renew deadline and retry period
against each other, the settings check the heartbeat's timing. A lease counts as held for
`ttl * (1 - lost_margin)` after each confirmed renewal (the horizon), is renewed every third
of that, and so a renewal sent on time has two thirds of the horizon (its slack) before the
lease counts as lost.

- **Refused** (`LeaseConfigError` at `Leases(app)`): `min_replicas` above 0 with a
  `min_replicas_timeout` at or above the slack. Every renewal then waits for the replicas,
  and one that must wait that long can never be confirmed in time. The message gives the
  numbers: `ttl 2 s with lost_margin 0.25 leaves 1.5 s after each renewal; renewed every
  0.5 s, a renewal has 1 s before its lease counts as lost: min_replicas_timeout (1 s) must
  be below 1 s, or the ttl above 2 s`.
- **Told** (a worker logs it at start-up, at INFO, as `leases: timing: ...`; the settings
  work and are safe): a `socket_timeout`
  that leaves no room for a second renewal attempt in the slack (one attempt, then the
  pause of at most 1 s before the next). A renewal is cut at its lease's deadline whatever
  the timeout, so nothing overlaps, but one stalled connection then loses the lease. The
  message names the `socket_timeout` or the ttl that fits: `ttl 3 s with lost_margin 0.1
  leaves 2.7 s after each renewal; renewed every 0.9 s, a renewal has 1.8 s ...:
  socket_timeout < 0.9 s (or a ttl of 10 s or more) leaves room for a second try`. Also
  warned: a `restart_grace` or `restore_grace` above 0 but below the `ttl`, since a holder
  counts its lease held up to `ttl` after its last renewal.

Per task, `LeasedTask` takes `lease_ttl`, `on_busy`, `on_lost`, `busy_timeout` and
`wait_timeout` as task options (also on a plain `@app.task` of an app with `Leases(app)`, see
[Tasks](tasks.md)); the settings below are their app-wide defaults.

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
