"""Registry entries with the grant call's id (issue 26, part 8), and those written without."""

from __future__ import annotations

from celery_leases._registry import Entry, parse_entry, task_in_registry


def test_an_entry_with_a_call_id_reads_back_as_written():
    text = "x 17 task%201/a%cff01 job:{42} 100% ключ"
    entry = parse_entry(text)
    assert entry == Entry("x", 17, "task 1/a", "job:{42} 100% ключ", call="ff01")
    assert entry.text == text


def test_an_entry_of_an_older_version_reads_as_before_without_a_call_id():
    entry = parse_entry("s 17 - r")
    assert entry == Entry("s", 17, None, "r")
    assert entry.call == ""
    assert entry.text == "s 17 - r"


def test_a_task_id_holding_percent_c_is_no_call_id():
    # escape() writes "%" as "%25": "%c" in an entry is always the call id's mark
    entry = Entry("x", 5, "a%cb", "r", call="9")
    assert entry.text == "x 5 a%25cb%c9 r"
    assert parse_entry(entry.text) == entry


def test_a_handoff_entry_has_no_call_id():
    entry = parse_entry("h 100000000000001 - r")
    assert entry == Entry("x", 0, None, "r", 100000000000001)


def test_the_task_of_an_entry_with_a_call_id_is_found():
    assert task_in_registry(["x 5 t1%c3 r", "~"], "r", 5) == "t1"
