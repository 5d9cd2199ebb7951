"""Nothing listens beyond loopback unprotected unless told to: each of these started (open
to anyone who could reach it) before."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hpd_common.errors import InvalidArgument
from hpd_common.exposure import is_loopback
from hpd_registry.settings import RegistrySettings

HPD = Path(sys.executable).parent / "hpd"


@pytest.mark.parametrize(
    ("host", "loopback"),
    [("127.0.0.1", True), ("127.8.0.1", True), ("::1", True), ("[::1]", True),
     ("localhost", True), ("0.0.0.0", False), ("::", False), ("10.0.0.5", False),
     ("registry", False)],
)  # fmt: skip
def test_loopback_is_this_machine_only(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


@pytest.mark.parametrize(
    "argv",
    [
        pytest.param(["up", "--host", "0.0.0.0"], id="up"),
        pytest.param(["up", "--host", "0.0.0.0", "--auth"], id="up-auth-without-tls"),
        pytest.param(["registry", "--host", "0.0.0.0"], id="registry"),
        pytest.param(["gateway", "--host", "0.0.0.0"], id="gateway"),
    ],
)
def test_listening_beyond_loopback_unprotected_exits_naming_insecure(
    argv: list[str], tmp_path: Path
) -> None:
    done = subprocess.run(
        [str(HPD), *argv], capture_output=True, text=True, timeout=60, cwd=tmp_path, check=False
    )
    assert done.returncode != 0
    assert "--insecure" in done.stderr, done.stderr
    assert not (tmp_path / ".hpd" / "redis").exists()  # refused before starting anything


def test_a_service_setting_beyond_loopback_needs_auth_and_tls() -> None:
    with pytest.raises(InvalidArgument, match="--insecure"):
        RegistrySettings(host="0.0.0.0", auth_tokens_file="tokens.yaml")
    assert RegistrySettings(host="0.0.0.0", insecure=True).insecure
    assert RegistrySettings(host="0.0.0.0", auth_tokens_file="t", tls_cert_file="c").host
