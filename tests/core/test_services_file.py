"""The services file and the environment (``core/services_file.py``): the addresses they give are validated
(one rule, ``core/addresses.py``), and a file that is not a services file is an error naming the fix, not a
crash. Secrets following their addresses: ``test_services_file_secrets.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

from bagua_lightning.core.addresses import check_port, parse_address
from bagua_lightning.core.errors import ConfigurationError
from bagua_lightning.core.services_file import (
    ServicesFileError,
    read_services_file,
    resolve_autotune_address,
    resolve_redis_hosts,
)


def test_addresses_from_the_environment_and_arguments_are_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    for bad in (0, 65536, 99999, -1, "80x", True):
        with pytest.raises(ConfigurationError, match=repr(bad).replace("(", r"\(")):
            check_port(bad)
    assert parse_address("[::1]:7000") == ("::1", 7000)
    with pytest.raises(ConfigurationError, match="99999"):
        resolve_autotune_address("127.0.0.1:99999")
    monkeypatch.setenv("BAGUA_LIGHTNING_REDIS_HOSTS", "127.0.0.1:7000,127.0.0.1:0")
    with pytest.raises(ConfigurationError, match=r"127\.0\.0\.1:0"):
        resolve_redis_hosts()
    # str.isdigit() accepts these; int() would then fail with a ValueError or read another number.
    for text in ("²", "7²", "٣", "\u0667\u0660\u0660\u0660", "\uff17\uff10\uff10\uff10"):
        with pytest.raises(ConfigurationError, match=text):
            check_port(text)
        with pytest.raises(ConfigurationError, match=text):
            parse_address(f"127.0.0.1:{text}")
    monkeypatch.setenv("BAGUA_LIGHTNING_REDIS_HOSTS", "127.0.0.1:7²")
    with pytest.raises(ConfigurationError, match="7²"):
        resolve_redis_hosts()


def test_deep_services_file_is_an_error_not_a_recursion(tmp_path: Path) -> None:
    path = tmp_path / "services.json"
    path.write_text('{"a":' * 100000 + "1" + "}" * 100000)
    with pytest.raises(ServicesFileError, match="delete it"):
        read_services_file(path)
