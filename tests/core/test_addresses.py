"""One host/port rule for the whole package (``core/addresses.py``): the client, the services file and the
command line parse addresses alike and refuse bad ones with the same error type, naming the value."""

from __future__ import annotations

import pytest

from bagua_lightning.client.autotune import AutotuneClient
from bagua_lightning.core.addresses import (
    check_host,
    check_port,
    format_address,
    is_ascii_number,
    parse_address,
    parse_host_list,
)
from bagua_lightning.core.errors import ConfigurationError


@pytest.mark.parametrize(("text", "expected"), [
    ("127.0.0.1:7000", ("127.0.0.1", 7000)),
    ("[::1]:7000", ("::1", 7000)),
    ("redis-0.bagua-redis.svc:6379", ("redis-0.bagua-redis.svc", 6379)),
    ("localhost:29600", ("localhost", 29600)),
])
def test_addresses_parse_the_same_everywhere(text: str, expected: tuple[str, int]) -> None:
    assert parse_address(text) == expected
    assert format_address(*expected) == text
    assert parse_host_list(f"{text},{text}", "hosts") == [dict(zip(("host", "port"), expected, strict=True))] * 2


@pytest.mark.parametrize("text", ["127.0.0.1", "127.0.0.1: 7000", "127.0.0.1:+7000", "127.0.0.1:0", "127.0.0.1:65536",
                                  "bad host:7000", "[::1:7000", "127.0.0.1:\u0667\u0660\u0660\u0660"])
def test_bad_addresses_are_one_error_type_naming_the_value(text: str) -> None:
    with pytest.raises(ConfigurationError, match=r"is not|has no numeric port") as info:
        parse_address(text, "the address")
    assert repr(text) in str(info.value) or repr(text.rpartition(":")[0]) in str(info.value) \
        or repr(int(text.rpartition(":")[2])) in str(info.value)
    assert isinstance(info.value, ValueError)  # callers catching ValueError keep working


def test_hosts_and_ports() -> None:
    assert check_host("[::1]") == "::1" and check_host("10.0.0.1") == "10.0.0.1"
    assert check_port(7000) == check_port("7000") == 7000
    for bad in (True, 0, " 80", "80 ", 1.5, None):
        with pytest.raises(ConfigurationError):
            check_port(bad)


def test_the_client_uses_the_same_rule() -> None:
    assert AutotuneClient(host="::1", port=29600).target == "[::1]:29600"  # brackets for IPv6
    for kwargs in ({"target": "no-port-here"}, {"host": "bad host", "port": 1}, {"host": "127.0.0.1", "port": 0}):
        with pytest.raises(ConfigurationError):
            AutotuneClient(**kwargs)  # type: ignore[arg-type]


def test_the_library_parses_ports_as_strictly() -> None:
    for text in (" 80", "80 ", "+80", "8 0", ""):
        assert not is_ascii_number(text)
        with pytest.raises(ConfigurationError, match=repr(text).replace("+", r"\+")):
            check_port(text)
    assert check_port("80") == 80 and is_ascii_number("0080")
    with pytest.raises(ConfigurationError, match="port ' 7000' is not a TCP port"):
        parse_address("127.0.0.1: 7000")
    assert parse_address(" 127.0.0.1:7000 ") == ("127.0.0.1", 7000)  # around the whole address: a pasted value
