"""`hpd up` reads its settings as every service does: flags over HPD_<FLAG> environment
variables over a --config YAML file over the defaults."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpd_common.errors import InvalidArgument
from hpd_tools.up import parse


def test_flags_win_over_the_environment_which_wins_over_the_file(tmp_path: Path) -> None:
    cfg = tmp_path / "up.yaml"
    cfg.write_text("registry_port: 5000\nscheduler_port: 5001\nauth: true\nstate_dir: /srv/hpd\n")
    env = {"HPD_CONFIG": str(cfg), "HPD_SCHEDULER_PORT": "6001"}
    args = parse(["--state-dir", "/tmp/x"], env)
    assert (args.registry_port, args.scheduler_port, args.auth) == (5000, 6001, True)
    assert args.state_dir == "/tmp/x"
    assert parse([], {}).registry_port == 50051  # nothing set: the default


@pytest.mark.parametrize(
    ("text", "env", "field"),
    [
        ("nope: 1\n", {}, "config.nope"),
        ("", {"HPD_AUTH": "maybe"}, "auth"),
        ("", {"HPD_REGISTRY_PORT": "fifty"}, "registry_port"),
    ],
)
def test_a_bad_setting_is_named(tmp_path: Path, text: str, env: dict[str, str], field: str) -> None:
    cfg = tmp_path / "up.yaml"
    cfg.write_text(text)
    with pytest.raises(InvalidArgument) as err:
        parse(["--config", str(cfg)], env)
    assert err.value.field == field
