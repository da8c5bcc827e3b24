"""Key names: escaping is injective, hash tags cannot be broken, a prefix contains its keys."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from celery_leases._keys import (
    Keyspace,
    OwnerParts,
    escape,
    escaped_node_of_owner,
    fenced_keys,
    holder_parts,
    node_of_owner,
    owner_id,
    pid_of_owner,
    split_owner,
    unescape,
)
from tests.support.cluster import hash_tag

# no example database written into the work tree, and no per-example deadline on slow CI
settings.register_profile("celery_leases_keys", database=None, deadline=None)
settings.load_profile("celery_leases_keys")

TRICKY = [
    "",
    "a",
    "a:b",
    "a::b",
    ":",
    "{",
    "}",
    "{}",
    "}{",
    "{a}",
    "{a",
    "a}",
    "{{a}}",
    "%",
    "%%",
    "%7B",
    "%7Ba%7D",
    "%257B",
    "%7b",
    "a b",
    "a%20b",
    "a\nb",
    "a%0Ab",
    "a\tb",
    "a\x00b",
    "a\x7fb",
    "\r\n",
    "ключ",
    "锁🔒",
    "é",
    "e\u0301",
    "\u2028",
    "x" * 5000,
    "/",
    "a/b/c",
    "leases:0}:x:a",
    "{leases:1}:x:a",
]

# names that escape() must turn into text without braces, white space or control characters
text_names = st.text(max_size=60)
tricky_alphabet = st.text(alphabet=st.sampled_from("{}%:7BbDd0A2 \n\x00é/"), max_size=30)
names = st.one_of(text_names, tricky_alphabet, st.sampled_from(TRICKY))


def all_keys(ks: Keyspace, name: str) -> list[str]:
    return [*ks.resource_keys(name), ks.channel(name), ks.named("once", name)]


def test_tricky_names_escape_to_distinct_texts():
    escaped = [escape(n) for n in TRICKY]
    assert len(set(escaped)) == len(TRICKY)
    for name, text in zip(TRICKY, escaped, strict=True):
        assert unescape(text) == name


@given(names)
def test_unescape_inverts_escape(name):
    # a left inverse proves escape() injective: two names never share a key
    assert unescape(escape(name)) == name


@given(names, names)
def test_distinct_names_give_distinct_keys(a, b):
    ks = Keyspace("p")
    if a != b:
        assert ks.exclusive(a) != ks.exclusive(b)
        assert ks.counter(a) != ks.counter(b)
    else:
        assert ks.exclusive(a) == ks.exclusive(b)


@given(names)
def test_escaped_text_has_no_brace_space_or_control(name):
    text = escape(name)
    assert not set(text) & {"{", "}"}
    assert not any(ch.isspace() and ord(ch) < 0x80 for ch in text)
    assert all(0x20 < ord(ch) != 0x7F for ch in text if ord(ch) < 0x80)
    # every % left in the text starts an escape
    assert all(text[i + 1 : i + 3].isalnum() for i, ch in enumerate(text) if ch == "%")


@pytest.mark.parametrize("groups", [1, 16])
@given(name=names)
def test_braces_in_a_name_cannot_form_another_hash_tag(groups, name):
    ks = Keyspace("tenant-a", groups)
    group = ks.group_of(name)
    for key in [*ks.resource_keys(name), ks.channel(name)]:
        assert hash_tag(key) == f"tenant-a:{group}"
    # a named object (receipt, beat claim) sits in a group of its own, still under the prefix
    assert hash_tag(ks.named("once", name)) in {f"tenant-a:{g}" for g in range(groups)}


@given(prefix=st.from_regex(r"[A-Za-z0-9_.:\-]{1,20}", fullmatch=True), name=names)
def test_every_key_stays_inside_its_prefix(prefix, name):
    ks = Keyspace(prefix)
    keys = [
        *all_keys(ks, name),
        ks.registry(owner_id(name or "n", "inc", 1), 0),
        ks.epoch(0),
        ks.lifetime(0),
        ks.owners,
        ks.node(name),
        ks.nodes,
    ]
    for key in keys:
        assert key.startswith("{" + prefix + ":0}:")
        assert hash_tag(key) == f"{prefix}:0"


@pytest.mark.parametrize(
    ("a", "b"),
    [("p", "p:0"), ("p", "p:1"), ("p:1", "p:10"), ("a", "a-b"), ("x", "x.")],
)
def test_two_prefixes_never_share_a_key_or_a_tag(a, b):
    for groups in (1, 12):
        ka, kb = Keyspace(a, groups), Keyspace(b, groups)
        tags_a = {ka.tag(g) for g in range(groups)}
        tags_b = {kb.tag(g) for g in range(groups)}
        assert not tags_a & tags_b
        for name in TRICKY:
            assert not set(all_keys(ka, name)) & set(all_keys(kb, name))


@given(names)
def test_group_of_is_stable_and_in_range(name):
    ks = Keyspace("p", 7)
    group = ks.group_of(name)
    assert 0 <= group < 7
    assert Keyspace("p", 7).group_of(name) == group
    assert Keyspace("p", 1).group_of(name) == 0


def test_group_of_is_the_same_in_every_process():
    names_ = ["repo:1", "{a}", "ключ", "x" * 300]
    ks = Keyspace("p", 64)
    here = [ks.group_of(n) for n in names_]
    assert len(set(here)) > 1, "the sample should spread over several groups"
    code = (
        "import sys; from celery_leases._keys import Keyspace; "
        f"print([Keyspace('p', 64).group_of(n) for n in {names_!r}])"
    )
    for seed in ("0", "12345"):
        out = subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout
        assert out.strip() == repr(here)


def test_group_spreads_resources():
    ks = Keyspace("p", 16)
    groups = {ks.group_of(f"repo:{i}") for i in range(500)}
    assert groups == set(range(16))


@given(st.text(min_size=1, max_size=40))
def test_node_survives_the_owner_id(node):
    owner = owner_id(node, "abc123", 4242)
    assert node_of_owner(owner) == node
    assert " " not in owner  # owner ids are written space-separated in holder values
    assert split_owner(owner) == OwnerParts(node, "abc123", "4242")
    assert escaped_node_of_owner(owner) == escape(node)
    assert pid_of_owner(owner) == 4242
    assert holder_parts(f"17 {owner}") == ("17", owner)


def test_owner_parse_edge_cases():
    assert pid_of_owner("n/inc/notapid") is None
    with pytest.raises(ValueError, match="unpack"):
        split_owner("no-slashes")
    assert holder_parts("17") == ("17", "")
    assert holder_parts("x y z") == ("x", "y z")


@given(prefix=names.filter(bool), name=names.filter(bool))
def test_a_fenced_key_and_its_record_share_one_whole_key_hash_tag(prefix, name):
    data, record = fenced_keys(prefix, name)
    assert record == data + ":fence"
    # the data key is exactly one hash tag, and the record hashes the same text
    assert data[0] == "{"
    assert data[-1] == "}"
    assert hash_tag(data) == hash_tag(record) == data[1:-1]


@given(st.tuples(names, names), st.tuples(names, names))
def test_fenced_keys_are_distinct_for_distinct_prefix_and_name(a, b):
    if a != b:
        assert set(fenced_keys(*a)).isdisjoint(fenced_keys(*b))


@pytest.mark.parametrize(
    ("a", "b"),
    [(("a", "b:c"), ("a:b", "c")), (("a", "%3A"), ("a%", "3A")), (("x", "}"), ("x}", ""))],
)
def test_fenced_keys_of_tricky_pairs_differ(a, b):
    assert set(fenced_keys(*a)).isdisjoint(fenced_keys(*b))


@pytest.mark.parametrize("resource", ["plain", "a b{c}%d", "ünï:cödé", "x" * 300])
@pytest.mark.parametrize("groups", [1, 16])
def test_per_resource_names_are_those_of_the_single_methods(resource: str, groups: int) -> None:
    keys = Keyspace("pre", groups)
    assert keys.per_resource(resource) == (
        keys.exclusive(resource),
        keys.shared(resource),
        keys.counter(resource),
        keys.channel(resource),
        keys.waiters(resource),
        keys.ticket_expiry(resource),
        keys.handed(resource),
        keys.resource_history(resource),
        keys.record(resource),
        keys.group_of(resource),
    )
