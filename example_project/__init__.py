"""A small analysis pipeline that uses celery_leases (see demo.py)."""
