"""The server: section and the remote tier's settings: parsing, env, checks, secrets."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore.config import RemoteTierConfig, ServerConfig, StoreConfig
from kvstore.config.server import is_loopback
from kvstore.errors import ConfigError

TOKEN = "a-token-of-at-least-16-chars"


def test_defaults_listen_on_loopback_only() -> None:
    server = StoreConfig.default(environ={}).server
    assert server.listen == "127.0.0.1:7070" and server.exposure() is None
    server.check_startable()
    assert server.credentials() == []


def test_yaml_and_env_configure_the_server(tmp_path: Path) -> None:
    path = tmp_path / "store.yaml"
    path.write_text(
        "server:\n  listen: 0.0.0.0:9000\n  max_stores: 3\n  tokens:\n"
        f"    - {{name: a, token: {TOKEN}, namespaces: [team-a]}}\n"
    )
    env = {"KVSTORE_SERVER_TOKEN": "env-token-0123456789", "KVSTORE_SERVER_IO_TIMEOUT_S": "5"}
    server = StoreConfig.from_yaml(path, environ=env).server
    assert (server.listen, server.max_stores, server.io_timeout_s) == ("0.0.0.0:9000", 3, 5.0)
    creds = server.credentials()
    assert [(c.name, c.namespaces) for c in creds] == [
        ("default", None),
        ("a", frozenset({"team-a"})),
    ]
    server.check_startable()  # exposed, but with tokens


def test_token_files_are_read_and_checked(tmp_path: Path) -> None:
    good, short = tmp_path / "good", tmp_path / "short"
    good.write_text(TOKEN + "\n\nignored")
    short.write_text("tiny\n")
    assert ServerConfig(token_file=str(good)).credentials()[0].secret == TOKEN.encode()
    with pytest.raises(ConfigError, match="at least 16"):
        ServerConfig(token_file=str(short)).credentials()
    with pytest.raises(ConfigError, match="No such file"):
        ServerConfig(token_file=str(tmp_path / "none")).credentials()


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"listen": "nowhere"}, "HOST:PORT"),
        ({"listen": None, "unix_socket": None}, "listen or unix_socket"),
        ({"listen": ""}, "non-empty string"),
        ({"listen": "unix:/x"}, "use unix_socket"),
        ({"tls_cert": "/c.pem"}, "both tls_cert and tls_key"),
        ({"token": TOKEN, "token_file": "/t"}, "not both"),
        ({"max_frame_bytes": 0}, "max_frame_bytes"),
        ({"tokens": [{"name": "x"}]}, "exactly one of token and token_file"),
        ({"tokens": [{"token": TOKEN, "namespaces": ["no/slash"]}]}, "namespace"),
        ({"tokens": {"token": TOKEN}}, "a list of tokens"),
        ({"max_conections": 3}, "unknown key"),
    ],
)
def test_bad_server_settings_name_the_key(data: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        StoreConfig.from_dict({"server": data}, environ={})


def test_duplicate_tokens_are_refused() -> None:
    config = ServerConfig(
        token=TOKEN,
        tokens=StoreConfig.from_dict(
            {"server": {"tokens": [{"token": TOKEN}]}}, environ={}
        ).server.tokens,
    )
    with pytest.raises(ConfigError, match="same token"):
        config.credentials()


@pytest.mark.parametrize(
    ("address", "loopback"),
    [
        ("127.0.0.1:1", True),
        ("127.8.9.1:1", True),
        ("[::1]:1", True),
        ("localhost:1", True),
        ("unix:/run/x.sock", True),
        ("0.0.0.0:1", False),
        ("10.0.0.1:1", False),
        ("host.example:1", False),
    ],
)
def test_loopback(address: str, loopback: bool) -> None:
    assert is_loopback(address) is loopback


def test_remote_tier_settings_and_round_trip(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text(TOKEN)
    tier = {"kind": "remote", "address": "unix:/run/kv.sock", "token_file": str(token)}
    config = StoreConfig.from_dict({"tiers": [tier]}, environ={})
    remote = config.tiers[0]
    assert isinstance(remote, RemoteTierConfig) and remote.namespace == "default"
    assert remote.secret() == TOKEN.encode()
    assert StoreConfig.from_dict(config.to_dict(), environ={}) == config
    env = {"KVSTORE_REMOTE_ADDRESS": "10.0.0.5:7070", "KVSTORE_REMOTE_NAMESPACE": "team-a"}
    moved = StoreConfig.from_dict({"tiers": [tier]}, environ=env).tiers[0]
    assert isinstance(moved, RemoteTierConfig)
    assert (moved.address, moved.namespace) == ("10.0.0.5:7070", "team-a")
    with pytest.raises(ConfigError, match="not used over a Unix socket"):
        StoreConfig.from_dict({"tiers": [{**tier, "tls": True}]}, environ={})
