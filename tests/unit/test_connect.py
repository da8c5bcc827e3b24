"""Lease URLs: which deployment each form names, what is refused, and what logs show."""

from __future__ import annotations

import pytest
from celery import Celery

from celery_leases import LeaseConfigError
from celery_leases._connect import parse_target
from celery_leases.config import resolve_settings, safe_url


def test_one_server_forms():
    for url in ("redis://h:1/2", "rediss://h/0?ssl_cert_reqs=required", "unix:///s.sock?db=3"):
        assert parse_target(url).kind == "single"


def test_sentinel_url_with_several_sentinels():
    t = parse_target("sentinel://u:pw@s1:26379,s2:26380,[::1]/3?master_name=mymaster")
    assert t.kind == "sentinel"
    assert t.hosts == (("s1", 26379), ("s2", 26380), ("::1", 26379))
    assert t.master_name == "mymaster"
    assert t.options["db"] == 3
    assert t.options["username"] == "u"
    assert t.options["password"] == "pw"
    assert "host" not in t.options


def test_sentinel_url_in_celerys_joined_form():
    url = "sentinel://:pw@s1:26379/1;sentinel://:pw@s2:26379/1?master_name=m&sentinel_password=sp"
    t = parse_target(url)
    assert t.hosts == (("s1", 26379), ("s2", 26379))
    assert t.master_name == "m"
    assert t.options["db"] == 1
    assert t.options["password"] == "pw"
    assert t.sentinel_options == {"password": "sp"}


def test_cluster_urls():
    t = parse_target("redis+cluster://u:pw@n1:7000,n2:7001?socket_keepalive=true")
    assert t.kind == "cluster"
    assert t.hosts == (("n1", 7000), ("n2", 7001))
    assert t.options["password"] == "pw"
    assert "ssl" not in t.options
    assert parse_target("rediss+cluster://n1:7000").options["ssl"] is True


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("http://h:1", "must be a redis://"),
        ("valkey://h:1", "must be a redis://"),
        ("sentinel://s1:26379/0", "master_name"),
        ("sentinel://s1:26379;redis://h:1?master_name=m", "not sentinel://"),
        ("redis+cluster://n1:7000/2", "database other than 0"),
        ("redis+cluster://n1:notaport", "bad port"),
        ("redis+cluster://n1:7000,,n2:7001", "empty"),
    ],
)
def test_bad_urls_are_refused_at_start_up_naming_the_problem(url, problem):
    with pytest.raises(LeaseConfigError) as info:
        resolve_settings(None, redis_url=url)
    assert "redis_url" in str(info.value)
    assert problem in str(info.value)


def test_the_master_name_comes_from_celerys_transport_options():
    app = Celery("s", broker="sentinel://s1:26379;sentinel://s2:26379", set_as_current=False)
    app.conf.broker_transport_options = {"master_name": "cluster1"}
    url = resolve_settings(app).url
    t = parse_target(url)
    assert t.kind == "sentinel"
    assert t.master_name == "cluster1"
    assert t.hosts == (("s1", 26379), ("s2", 26379))


@pytest.mark.parametrize(
    "url",
    [
        "redis+cluster://u:hunter2@n1:7000,n2:7001",
        "sentinel://:hunter2@s1:26379,s2:26379/0?master_name=m",
        "sentinel://:hunter2@s1:26379/0;sentinel://:hunter2@s2:26379/0?master_name=m",
        "sentinel://s1:26379/0?master_name=m&sentinel_password=hunter2",
        "redis://h:1/0?PASSWORD=hunter2",
    ],
)
def test_passwords_are_hidden_in_every_form(url):
    shown = safe_url(url)
    assert "hunter2" not in shown
    assert "***" in shown


def test_hosts_stay_readable_when_hidden():
    shown = safe_url("redis+cluster://u:pw@n1:7000,n2:7001")
    assert shown == "redis+cluster://u:***@n1:7000,n2:7001"


def test_a_settings_error_does_not_show_the_password():
    with pytest.raises(LeaseConfigError) as info:
        resolve_settings(None, redis_url="sentinel://:hunter2@s1:26379/0")
    assert "hunter2" not in str(info.value)
