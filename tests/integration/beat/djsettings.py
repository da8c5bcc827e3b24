"""Django settings for django-celery-beat's ``DatabaseScheduler`` in the beat tests.

The database is the sqlite file ``LEASES_BEAT_DJANGO_DB``, shared by the replicas of a test
(migrated once before they start, in WAL mode; a busy writer makes the others wait up to
``timeout`` seconds instead of failing with "database is locked"). Transactions begin
IMMEDIATE: a deferred one (django-celery-beat's ``update_or_create`` of an entry at start-up
reads, then writes) fails at once with "database is locked" when another replica wrote in
between, without waiting: a replica then ran without the entry (seen under load).
"""

from __future__ import annotations

import os

SECRET_KEY = "celery-leases-tests"
USE_TZ = True
TIME_ZONE = "UTC"
INSTALLED_APPS = ["django_celery_beat"]
DEFAULT_AUTO_FIELD = "django.db.models.AutoField"
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": os.environ.get("LEASES_BEAT_DJANGO_DB", ":memory:"),
        "OPTIONS": {"timeout": 20, "transaction_mode": "IMMEDIATE"},
    }
}
