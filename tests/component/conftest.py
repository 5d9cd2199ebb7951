"""Fixtures shared by the component tests."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from hpd_tools.controlplane import ControlPlane, ControlPlaneSettings
from hpd_tools.embedded_redis import EmbeddedRedis


@pytest.fixture
async def plane(redis_server: EmbeddedRedis, key_prefix: str) -> AsyncIterator[ControlPlane]:
    """The whole control plane (``hpd up``'s wiring) in this process, on the test's Redis."""
    cp = ControlPlane(ControlPlaneSettings(redis_url=redis_server.url, key_prefix=key_prefix))
    await cp.start()
    try:
        yield cp
    finally:
        await cp.stop()
