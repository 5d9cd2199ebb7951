"""Settings: defaults < YAML file < environment < flags, with errors that name the key."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from hpd_common.errors import InvalidArgument
from hpd_common.settings import add_arguments, load_settings
from hpd_registry.settings import RegistrySettings


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p, RegistrySettings)
    return p.parse_args(argv)


def test_defaults() -> None:
    s = load_settings(RegistrySettings, parse([]), env={})
    assert s.port == 50051 and s.lease_ttl_ms == 10_000 and s.redis_url == ""


def test_precedence_yaml_env_flag(tmp_path: Path) -> None:
    cfg = tmp_path / "registry.yaml"
    cfg.write_text("lease_ttl_ms: 4000\nport: 6000\nkey-prefix: fromyaml\njson_logs: true\n")
    env = {"HPD_PORT": "7000", "HPD_LEASE_TTL_MS": "5000"}
    s = load_settings(RegistrySettings, parse(["--config", str(cfg), "--port", "8000"]), env=env)
    assert s.port == 8000  # flag beats env beats YAML
    assert s.lease_ttl_ms == 5000  # env beats YAML
    assert s.key_prefix == "fromyaml"
    assert s.json_logs is True


def test_config_from_environment_variable(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("sweep_interval_ms: 250\n")
    s = load_settings(RegistrySettings, parse([]), env={"HPD_CONFIG": str(cfg)})
    assert s.sweep_interval_ms == 250


@pytest.mark.parametrize(
    ("yaml_text", "env", "field"),
    [
        pytest.param("no_such_setting: 1\n", {}, "config.no_such_setting", id="unknown-key"),
        pytest.param("- a\n- b\n", {}, "config", id="not-a-mapping"),
        pytest.param("port: [1\n", {}, "config", id="bad-yaml"),
        pytest.param("", {"HPD_LEASE_TTL_MS": "soon"}, "lease_ttl_ms", id="bad-int-env"),
        pytest.param("", {"HPD_JSON_LOGS": "maybe"}, "json_logs", id="bad-bool-env"),
        pytest.param("lease_ttl_ms: 1.5\n", {}, "lease_ttl_ms", id="fractional-int"),
    ],
)
def test_bad_settings_name_the_key(
    tmp_path: Path, yaml_text: str, env: dict[str, str], field: str
) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml_text)
    with pytest.raises(InvalidArgument) as err:
        load_settings(RegistrySettings, parse(["--config", str(cfg)]), env=env)
    assert err.value.field == field


def test_missing_config_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument) as err:
        load_settings(RegistrySettings, parse(["--config", str(tmp_path / "nope.yaml")]), env={})
    assert err.value.field == "config" and "nope.yaml" in err.value.message


@pytest.mark.parametrize("ratio", [-0.1, 1.0, 1.5])
def test_the_redis_memory_limit_is_checked_for_every_service(ratio: float) -> None:
    """The setting is every service's (the broker refuses sessions by it as the scheduler
    refuses plans), so every service refuses a value outside [0, 1) at start, naming it."""
    from hpd_kvbroker.settings import KvBrokerSettings
    from hpd_registry.settings import RegistrySettings
    from hpd_scheduler.settings import SchedulerSettings

    for cls in (KvBrokerSettings, RegistrySettings, SchedulerSettings):
        with pytest.raises(InvalidArgument) as err:
            cls(redis_memory_limit_ratio=ratio)
        assert err.value.field == "redis_memory_limit_ratio"
