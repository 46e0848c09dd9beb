"""``kvstore calibrate-tiers``: each tier of a config measured by the fastest of a few reads
of a scratch chunk, printed as the ``restore.tier_speeds`` a store starts from."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kvstore import KVStore
from kvstore.cli import main
from kvstore.config import StoreConfig
from kvstore.errors import ConfigError
from kvstore.testing.data import small_layout

LAYOUT_FLAGS = ["--layers", "3", "--kv-heads", "2", "--head-dim", "16", "--block-tokens", "8"]


def test_it_prints_a_section_a_store_starts_from(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    disk = tmp_path / "disk"
    config = tmp_path / "store.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "tiers": [
                    {"kind": "host", "capacity": "1MiB"},
                    {"kind": "disk", "path": str(disk), "capacity": "16MiB"},
                ]
            }
        )
    )
    out = tmp_path / "restore.yaml"
    flags = [*LAYOUT_FLAGS, "--dtype", "bfloat16"]
    code = main(["calibrate-tiers", "--config", str(config), *flags, "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0
    assert out.read_text() == printed
    section = yaml.safe_load(printed)
    speeds = section["restore"]["tier_speeds"]
    assert set(speeds) == {"host:0", "disk:0"}
    assert all(gbps > 0 and ms >= 0 for gbps, ms in speeds.values())
    assert not list(disk.rglob("*.kvb"))  # the scratch chunk is gone
    store_config = {**yaml.safe_load(config.read_text()), **section}
    with KVStore(small_layout(), StoreConfig.from_dict(store_config)) as store:
        tiers = store.stats()["tiers"]
        for i, tier in enumerate(("host:0", "disk:0")):
            figures = (tiers[i]["read_gbps_estimate"], tiers[i]["read_latency_ms_estimate"])
            assert figures == tuple(speeds[tier])


def test_a_bad_count_of_reads_is_one_line_and_measures_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["calibrate-tiers", "--reads", "0", *LAYOUT_FLAGS])
    err = capsys.readouterr().err
    assert code == 2 and err.strip().count("\n") == 0 and "--reads" in err


def test_bad_tier_speeds_in_a_config_are_refused() -> None:
    with pytest.raises(ConfigError, match="tier id such as disk:0"):
        StoreConfig.from_dict({"restore": {"tier_speeds": {"disk": [1.0, 2.0]}}})
    with pytest.raises(ConfigError, match=r"GB/s must be > 0"):
        StoreConfig.from_dict({"restore": {"tier_speeds": {"disk:0": [0, 2.0]}}})
    env = {"KVSTORE_RESTORE_TIER_SPEEDS": '{"s3:0": [0.1, 30]}'}
    assert StoreConfig.from_dict({}, env).restore.declared_speed("s3:0") == (0.1, 30.0)
