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


# --- TLS on Sentinel and Cluster --------------------------------------------------------------
TLS_FILES = "ssl_ca_certs=/ca.pem&ssl_certfile=/c.pem&ssl_keyfile=/k.pem&ssl_cert_reqs=required"
TLS_OPTIONS = {
    "ssl_ca_certs": "/ca.pem",
    "ssl_certfile": "/c.pem",
    "ssl_keyfile": "/k.pem",
    "ssl_cert_reqs": "required",
}


def test_sentinel_over_tls_to_the_sentinels_and_the_master():
    url = f"sentinel://:pw@s1:26379,s2:26379/2?master_name=m&ssl=true&sentinel_ssl=true&{TLS_FILES}"
    t = parse_target(url)
    assert t.options == {**TLS_OPTIONS, "password": "pw", "db": 2, "ssl": True}
    # the sentinels get the same files (and not the master's password)
    assert t.sentinel_options == {**TLS_OPTIONS, "ssl": True}
    assert resolve_settings(None, redis_url=url).redis_url == url


def test_sentinel_tls_on_one_side_only_and_sentinel_only_files():
    master_only = parse_target(f"sentinel://s1/0?master_name=m&ssl=true&{TLS_FILES}")
    assert master_only.options["ssl"] is True
    assert master_only.sentinel_options == {}
    sentinels_only = parse_target(
        f"sentinel://s1/0?master_name=m&sentinel_ssl=yes&{TLS_FILES}&sentinel_password=sp"
        "&sentinel_ssl_certfile=/sc.pem&sentinel_ssl_keyfile=/sk.pem&sentinel_ssl_password=kp"
    )
    assert sentinels_only.options == {"db": 0}  # plain to the master, no TLS files
    assert sentinels_only.sentinel_options == {
        **TLS_OPTIONS,
        "ssl_certfile": "/sc.pem",
        "ssl_keyfile": "/sk.pem",
        "ssl_password": "kp",
        "password": "sp",
        "ssl": True,
    }
    plain = parse_target("sentinel://s1/0?master_name=m&ssl=false&sentinel_ssl=0")
    assert "ssl" not in plain.options
    assert plain.sentinel_options == {}


def test_cluster_over_tls_takes_the_tls_files():
    t = parse_target(f"rediss+cluster://n1:7000,n2:7001?{TLS_FILES}&ssl_check_hostname=false")
    assert t.options == {**TLS_OPTIONS, "ssl_check_hostname": False, "ssl": True}


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        (f"sentinel://s1/0?master_name=m&{TLS_FILES}", "add ssl=true"),
        ("sentinel://s1/0?master_name=m&ssl=on", "ssl='on'; write ssl=true or ssl=false"),
        ("sentinel://s1/0?master_name=m&sentinel_ssl=2", "sentinel_ssl=true or sentinel_ssl"),
        (
            "sentinel://s1/0?master_name=m&ssl=true&sentinel_ssl_ca_certs=/ca.pem",
            "TLS options for the sentinels (sentinel_ssl_ca_certs) without sentinel_ssl=true",
        ),
        (
            "sentinel://s1/0?master_name=m&sentinel_ssl=true&sentinel_ssl_ca_cert=/ca.pem",
            "URL option 'sentinel_ssl_ca_cert'",
        ),
        ("sentinel://s1/0?master_name=m&ssl=true&ssl_ca_cert=/ca.pem", "URL option 'ssl_ca_cert'"),
        (
            "sentinel://s1/0?master_name=m&sentinel_ssl=true&ssl_cert_reqs=CERT_REQUIRED",
            "CERT_REQUIRED",
        ),
        (
            f"redis+cluster://n1:7000?{TLS_FILES}",
            "'ssl_ca_certs' (TLS options need a rediss+cluster:// URL)",
        ),
    ],
)
def test_bad_tls_combinations_are_refused_at_start_up(url, problem):
    with pytest.raises(LeaseConfigError) as info:
        resolve_settings(None, redis_url=url)
    assert "redis_url" in str(info.value)
    assert problem in str(info.value)


def test_tls_key_passwords_are_hidden_in_sentinel_and_cluster_urls():
    for url in (
        "sentinel://s1/0?master_name=m&ssl=true&ssl_password=hunter2",
        "sentinel://s1/0?master_name=m&sentinel_ssl=true&sentinel_ssl_password=hunter2",
        "rediss+cluster://n1:7000?ssl_keyfile=/k.pem&ssl_password=hunter2",
    ):
        shown = safe_url(url)
        assert "hunter2" not in shown
        assert "password=***" in shown
