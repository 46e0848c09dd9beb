"""The ``server.tenants`` section: forms accepted, one-line refusals, the credentials made."""

from __future__ import annotations

from typing import Any

import pytest

from kvstore.config import StoreConfig
from kvstore.errors import ConfigError

A = "a-token-0123456789abcdef"
B = "b-token-0123456789abcdef"
OPS = "ops-token-0123456789abcdef"


def load(server: dict[str, Any]) -> StoreConfig:
    return StoreConfig.from_dict({"server": server}, environ={})


def test_mapping_and_list_forms_give_the_same_tenants() -> None:
    body = {"namespaces": ["ns-a"], "tokens": [{"name": "a", "token": A, "scopes": "read"}]}
    by_map = load({"tenants": {"team-a": body}}).server.tenants
    by_list = load({"tenants": [{"name": "team-a", **body}]}).server.tenants
    assert by_map == by_list
    assert by_map[0].tokens[0].scopes == ("read",)


def test_credentials_carry_tenant_scopes_and_namespaces() -> None:
    server = load(
        {
            "token": OPS,
            "tokens": [{"name": "legacy", "token": B, "namespaces": ["other"]}],
            "tenants": {"team-a": {"namespaces": ["ns-a"], "tokens": [{"token": A}]}},
        }
    ).server
    creds = {c.name: c for c in server.credentials()}
    assert creds["default"].scopes == {"read", "write", "manage", "admin"}
    assert creds["legacy"].tenant == "legacy" and creds["legacy"].namespaces == {"other"}
    tenant_token = creds["server.tenants.team-a.tokens[0]"]
    assert tenant_token.tenant == "team-a" and tenant_token.namespaces == {"ns-a"}
    assert tenant_token.scopes == {"read", "write"}
    assert server.owners() == {"ns-a": "team-a"}
    assert load(server.to_dict()).server == server  # to_dict reads back


@pytest.mark.parametrize(
    ("server", "match"),
    [
        ({"tenants": "x"}, r"server\.tenants: expected a mapping"),
        ({"tenants": {"t": {"colour": 1}}}, r"server\.tenants\.t\.colour: unknown key"),
        ({"tenants": {"bad name": {}}}, r"server\.tenants\.bad name\.name"),
        ({"tenants": {"t": {"tokens": [{"token": A, "scopes": ["root"]}]}}}, "unknown scope"),
        ({"tenants": {"t": {"tokens": [{"token": A, "token_file": "/x"}]}}}, "exactly one"),
        ({"tenants": {"t": {"events_endpoint": "http://x"}}}, r"tenants\.t\.events_endpoint"),
        (
            {"tenants": {"t": {"events_replay_endpoint": "tcp://127.0.0.1:0"}}},
            "give events_endpoint too",
        ),
        ({"tenants": {"t": {"events_auth": True}}}, r"t\.events_auth: give events_endpoint too"),
        (
            {"tenants": {"t": {"events_endpoint": "tcp://127.0.0.1:0", "events_auth": "maybe"}}},
            r"server\.tenants\.t\.events_auth: expected true or false",
        ),
        (
            {"tenants": {"t": {"namespaces": ["n"]}, "u": {"namespaces": ["n"]}}},
            "namespace 'n' already belongs to tenant 't'",
        ),
        (
            {
                "tenants": {"t": {"namespaces": ["n"]}},
                "tokens": [{"token": B, "namespaces": ["n"]}],
            },
            r"server\.tokens\[0\]\.namespaces: 'n' belongs to tenant 't'",
        ),
    ],
)
def test_bad_tenants_are_one_line_errors(server: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match) as info:
        load(server)
    assert "\n" not in str(info.value)


def test_two_tenants_with_one_secret_are_refused() -> None:
    server = load({"tenants": {"t": {"tokens": [{"token": A}]}, "u": {"tokens": [{"token": A}]}}})
    with pytest.raises(ConfigError, match="same token"):
        server.server.credentials()


@pytest.mark.parametrize(
    ("quotas", "match"),
    [
        ({"tape": {"share": "1MiB"}}, r"quotas\.tape: unknown tier kind"),
        ({"host": {"share": "2MiB", "limit": "1MiB"}}, r"quotas\.host\.limit: .* below the share"),
        ({"host": {"share": "lots"}}, r"quotas\.host\.share"),
        ({"host": "1MiB"}, r"quotas\.host: expected a mapping"),
        ({"host": {"share": 1, "cap": 2}}, r"quotas\.host\.cap: unknown key"),
    ],
)
def test_bad_quotas_are_one_line_errors(quotas: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match) as info:
        load({"tenants": {"t": {"quotas": quotas}}})
    assert "\n" not in str(info.value)


def test_quotas_read_back() -> None:
    server = load({"tenants": {"t": {"quotas": {"host": {"share": "1MiB", "limit": "2MiB"}}}}})
    quota = server.server.tenants[0].quotas[0]
    assert (quota.tier, quota.share, quota.limit) == ("host", 1 << 20, 2 << 20)
    assert load(server.server.to_dict()).server == server.server


def test_shares_past_a_tiers_capacity_refuse_to_start(tmp_path: Any) -> None:
    from kvstore.server import Server

    quotas = {"host": {"share": "12MiB"}}
    config = StoreConfig.from_dict(
        {
            "tiers": [{"kind": "host", "capacity": "16MiB"}],
            "server": {"tenants": {"a": {"quotas": quotas}, "b": {"quotas": quotas}}},
        },
        environ={},
    )
    with pytest.raises(ConfigError, match="host shares add up to 25165824 bytes, more than"):
        Server(config)
