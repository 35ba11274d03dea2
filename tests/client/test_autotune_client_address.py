"""``AutotuneClient()`` finds the deployment like every other client: argument, then
``BAGUA_LIGHTNING_AUTOTUNE_SERVICE``, then the services file, then ``127.0.0.1:29600``; the recorded token and
CA go only to the address the services file records."""

from __future__ import annotations

from pathlib import Path

import pytest

from bagua_lightning.client.autotune import AutotuneClient
from bagua_lightning.core import procs, services_file
from bagua_lightning.core.services_file import ServicesInfo
from bagua_lightning.core.tls_trust import TLS_ENV, ClientTLS
from bagua_lightning.services.redis_tls import make_node_certificates

TOKEN = "recorded-token-for-the-address-test"


@pytest.fixture
def clean_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for name in ("BAGUA_LIGHTNING_AUTOTUNE_SERVICE", "BAGUA_LIGHTNING_AUTOTUNE_TOKEN", *TLS_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.setenv("BAGUA_LIGHTNING_SERVICES_FILE", str(tmp_path / "services.json"))
    return tmp_path


def _record(tmp: Path, autotune: str) -> ClientTLS:
    make_node_certificates(tmp / "tls", [1], ["127.0.0.1"], clients=True)
    tls = ClientTLS(ca=str(tmp / "tls" / "ca.crt"), cert=str(tmp / "tls" / "client.crt"),
                    key=str(tmp / "tls" / "client.key"))
    token = str(procs.write_private(tmp / "secrets" / "autotune-token", TOKEN))
    services_file.write_services_file(ServicesInfo(autotune=autotune, deployment="d" * 32,
                                                   secrets={"autotune_token": token}, tls=tls))
    return tls


def _sends_token(client: AutotuneClient) -> bool:
    return any(TOKEN in value for _, value in client._metadata)


def test_no_argument_no_environment_no_file_is_the_default(clean_env: Path) -> None:
    with AutotuneClient() as client:
        assert client.target == "127.0.0.1:29600" and client.tls_ca is None and not _sends_token(client)


def test_no_argument_finds_the_recorded_service_with_its_token_and_ca(clean_env: Path) -> None:
    tls = _record(clean_env, "127.0.0.1:41234")
    with AutotuneClient() as client:
        assert client.target == "127.0.0.1:41234"
        assert str(client.tls_ca) == tls.ca and _sends_token(client)


def test_the_environment_comes_before_the_file_and_gets_no_recorded_secret(clean_env: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    _record(clean_env, "127.0.0.1:41234")
    monkeypatch.setenv("BAGUA_LIGHTNING_AUTOTUNE_SERVICE", "127.0.0.1:41999")
    with AutotuneClient() as client:
        assert client.target == "127.0.0.1:41999"
        assert client.tls_ca is None and not _sends_token(client)  # not the recorded address
    monkeypatch.setenv("BAGUA_LIGHTNING_AUTOTUNE_SERVICE", "127.0.0.1:41234")  # the recorded one, by env
    with AutotuneClient() as client:
        assert client.tls_ca is not None and _sends_token(client)


def test_an_argument_comes_first(clean_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tls = _record(clean_env, "127.0.0.1:41234")
    monkeypatch.setenv("BAGUA_LIGHTNING_AUTOTUNE_SERVICE", "127.0.0.1:41999")
    with AutotuneClient(target="127.0.0.1:42000") as client:
        assert client.target == "127.0.0.1:42000" and client.tls_ca is None and not _sends_token(client)
    with AutotuneClient(port=42001) as client:
        assert client.target == "127.0.0.1:42001"
    # The CA from the environment or an argument pins any address (the user's explicit choice).
    monkeypatch.setenv("BAGUA_LIGHTNING_TLS_CA", tls.ca)
    with AutotuneClient(target="127.0.0.1:42000") as client:
        assert str(client.tls_ca) == tls.ca and not _sends_token(client)
    with pytest.raises(ValueError, match="root_certificates= or tls_ca="):
        AutotuneClient(target="127.0.0.1:42000", tls_ca=tls.ca, root_certificates=b"pem")


def test_a_bad_environment_address_is_refused_naming_it(clean_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BAGUA_LIGHTNING_AUTOTUNE_SERVICE", "no-port-here")
    with pytest.raises(ValueError, match="no-port-here"):
        AutotuneClient()
