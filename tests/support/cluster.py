"""Redis Cluster's key-slot rule, written independently of the library for the tests."""

from __future__ import annotations


def hash_tag(key: str) -> str:
    """The part of ``key`` Redis Cluster hashes (CLUSTER KEYSLOT's rule)."""
    start = key.find("{")
    if start != -1:
        end = key.find("}", start + 1)
        if end > start + 1:
            return key[start + 1 : end]
    return key
