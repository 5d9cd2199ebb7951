"""The gateway's front door with API keys over real vLLM engines: the tests/security cases
that need an engine's own word (its stated context length, its answer to a good request)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from hpd_fleet.real_processes import AgentProcess, pick_port, wait_http
from tests.real_engine.conftest import RealFleet
from tests.real_engine.test_gateway import fresh_prompt

STD = "real-standard-key-0123456789ab"


@pytest.fixture(scope="module")
def keyed_gateway(real: RealFleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder = tmp_path_factory.mktemp("keys")
    keys = folder / "keys.yaml"
    keys.write_text(yaml.safe_dump({"keys": [{"tenant": "acme", "key": STD, "tier": "standard"}]}))
    keys.chmod(0o600)
    port = pick_port()
    gw = AgentProcess(
        "gw-keys",
        [
            "--port", str(port), "--scheduler", real.scheduler_addr, "--broker", real.broker_addr,
            "--registry", real.registry_addr, "--tokenizer", f"tiny={real.model_dir}",
            "--api-keys", str(keys), "--log-level", "info",
        ],
        real.log_dir,
        command="gateway",
    )  # fmt: skip
    gw.start()
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/health", 30)
        yield url
    finally:
        gw.stop()


def post(url: str, body: Any, headers: dict[str, str]) -> tuple[int, dict[str, Any]]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(
        url + "/v1/completions", data=data, headers={"Content-Type": "application/json", **headers}
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_keys_tiers_and_context_over_real_engines(pd_pair: RealFleet, keyed_gateway: str) -> None:
    del pd_pair
    auth = {"Authorization": f"Bearer {STD}"}
    body = {"model": "tiny", "prompt": fresh_prompt(20), "max_tokens": 4}
    status, answer = post(keyed_gateway, body, {})
    assert status == 401 and answer["error"]["code"] == "invalid_api_key"
    status, answer = post(keyed_gateway, body, {**auth, "x-hpd-tier": "interactive"})
    assert status == 403 and answer["error"]["code"] == "tier_not_allowed"
    status, answer = post(keyed_gateway, body, auth)
    assert status == 200 and answer["choices"][0]["text"] is not None
    # the engine states max_model_len 1,024 (its agent registers it): a prompt of about 1,500
    # tokens is refused before planning
    status, answer = post(keyed_gateway, {**body, "prompt": fresh_prompt(300)}, auth)
    assert status == 400 and answer["error"]["code"] == "context_length_exceeded", answer
    status, answer = post(keyed_gateway, b'{"model": "tiny", "prompt": "a \\ud800"}', auth)
    assert status == 400 and answer["error"]["param"] == "prompt"
