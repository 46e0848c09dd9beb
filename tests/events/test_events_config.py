"""The events: section, read from a mapping with clear errors."""

from __future__ import annotations

import pytest

from kvstore.config.events import EventsConfig
from kvstore.errors import ConfigError


def test_defaults_and_a_full_section() -> None:
    assert EventsConfig() == EventsConfig.from_mapping({})
    assert EventsConfig.from_mapping(None).enabled is False
    section = {
        "enabled": "true",
        "endpoint": "tcp://*:6000",
        "replay_endpoint": "tcp://*:6001",
        "topic": "kv@10.0.0.1@llama",
        "block_size": "32",
        "buffer_steps": 10,
        "hwm": 0,
        "interval_s": "0.05",
        "token_journal": "/tmp/j",
        "data_parallel_rank": 2,
    }
    config = EventsConfig.from_mapping(section)
    assert config.enabled and config.block_size == 32 and config.interval_s == 0.05
    assert config.data_parallel_rank == 2 and config.topic == "kv@10.0.0.1@llama"
    assert EventsConfig.from_mapping(config.to_dict()) == config


@pytest.mark.parametrize(
    ("section", "match"),
    [
        ({"endpont": "tcp://*:1"}, r"events\.endpont: unknown key; allowed keys: block_size"),
        ({"endpoint": "http://x:1"}, r"events\.endpoint: expected tcp://"),
        ({"endpoint": "tcp://host"}, r"events\.endpoint: expected tcp://HOST:PORT"),
        ({"endpoint": "tcp://*:1", "replay_endpoint": "tcp://*:1"}, "must differ"),
        ({"block_size": 0}, r"events\.block_size: must be > 0"),
        ({"block_size": "x"}, r"events\.block_size: expected an integer"),
        ({"buffer_steps": -1}, r"events\.buffer_steps: must be > 0"),
        ({"hwm": -1}, r"events\.hwm: must be >= 0"),
        ({"interval_s": 0}, r"events\.interval_s: must be > 0"),
        ({"enabled": "maybe"}, r"events\.enabled: expected true or false"),
        ({"topic": 5}, r"events\.topic: expected a string"),
        ({"data_parallel_rank": -1}, r"events\.data_parallel_rank: must be >= 0"),
    ],
)
def test_bad_sections_are_refused(section: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        EventsConfig.from_mapping(section)


def test_the_block_size_must_divide_the_chunk() -> None:
    assert EventsConfig(block_size=16).check_block_tokens(256) == 16
    with pytest.raises(ConfigError, match="must divide the layout's block_tokens"):
        EventsConfig(block_size=16).check_block_tokens(40)
    with pytest.raises(ConfigError, match="expected a mapping"):
        EventsConfig.from_mapping(["x"])  # type: ignore[arg-type]
