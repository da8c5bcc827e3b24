"""django-celery-beat's ``DatabaseScheduler`` with the mixin, composed as docs/beat.md shows.

Django is set up first (``tests.integration.beat.djsettings``), as a Django project's
``celery.py`` does before beat loads the scheduler.
"""

from __future__ import annotations

import os

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.integration.beat.djsettings")
django.setup()

from django_celery_beat.schedulers import DatabaseScheduler  # noqa: E402

from celery_leases.beat import LeasedSchedulerMixin  # noqa: E402


class Scheduler(LeasedSchedulerMixin, DatabaseScheduler):
    pass
