"""The scheduler inside the gateway: ``hpd gateway`` plans in its own process by default.

A request then costs no process hop to plan: the gateway runs a full scheduler replica
(``hpd_scheduler.service.SchedulerService``, the same object the scheduler service
serves over gRPC) on its own event loop, over the fleet view the gateway already follows
(one registry watch for both) and the control plane's Redis. It is one more replica
among the scheduler services and other gateways: reservations are taken by the same
Redis scripts (no worker's limit is exceeded whoever plans), route records, explanations
and learned figures are written to the same keys, so ``hpd routes`` and
``GetRouteRecord`` on any scheduler service show a plan an embedded replica made, and
its outcome report releases and teaches exactly as ``ReportOutcome`` does.

The replica's settings are ``hpd scheduler``'s (``--scheduler-config FILE``, the same
YAML keys as ``hpd scheduler --config``): its profile, tiers, key prefix and the rest.
The gateway supplies what it already knows: the Redis URL (``--redis-url``), the
registry and the broker. With auth on, the replica calls the broker (KV sessions) and
the registry (directives) as a scheduler: give it the scheduler's credentials in that
file (``call_cert_file`` / ``call_key_file`` / ``call_ca_file`` or ``call_token``);
without them it presents the gateway's own.

Errors are the policy's own (``hpd_common.errors``); the caller maps them to the same
HTTP answers as the gRPC statuses of a remote scheduler (``rpc.status_for``), so a client
cannot tell the two modes apart.
"""

from __future__ import annotations

import argparse
import dataclasses

from hetero_pd.v1 import scheduler_pb2 as s
from hpd_common import redis_conn
from hpd_common.channels import CallIdentity
from hpd_common.clock import SystemClock
from hpd_common.errors import InvalidArgument
from hpd_common.settings import load_settings
from hpd_registry.informer import FleetInformer
from hpd_scheduler import convert as cv
from hpd_scheduler.broker_client import KvSessionOpener, session_opener
from hpd_scheduler.service import SchedulerService
from hpd_scheduler.settings import SchedulerSettings

__all__ = ["EmbeddedScheduler", "replica_settings"]


def replica_settings(
    config_file: str,
    redis_url: str,
    registry: str,
    broker: str,
    identity: CallIdentity,
) -> SchedulerSettings:
    """The embedded replica's settings: ``config_file`` (``hpd scheduler``'s YAML keys; ''
    = the defaults), then the gateway's own: its Redis URL (when given), its registry and
    its broker (the replica follows the gateway's fleet view and opens the KV sessions the
    gateway completes, so both must be the gateway's), and its credentials where the file
    gives none (module docstring). Raises ``InvalidArgument`` naming a bad setting."""
    base = load_settings(SchedulerSettings, argparse.Namespace(config=config_file or None), env={})
    out = dataclasses.replace(
        base, redis_url=redis_url or base.redis_url, registry_target=registry,
        broker_target=broker,
    )  # fmt: skip
    if not (base.call_token or base.call_cert_file):
        out = dataclasses.replace(
            out, call_token=identity.token, call_ca_file=identity.ca_file,
            call_cert_file=identity.cert_file, call_key_file=identity.key_file,
        )  # fmt: skip
    if not out.redis_url:
        raise InvalidArgument(
            "redis_url", "planning in the gateway needs the control plane's Redis "
            "(--redis-url redis://HOST:6379/0), or give --scheduler HOST:PORT to plan there",
        )  # fmt: skip
    out.validate()
    return out


class EmbeddedScheduler:
    """A scheduler replica in the gateway's process (module docstring)."""

    def __init__(
        self,
        settings: SchedulerSettings,
        informer: FleetInformer,
        opener: KvSessionOpener | None = None,
    ) -> None:
        self.client = redis_conn.connect(settings.redis_url)
        if opener is None:
            opener = session_opener(settings)
        self.service = SchedulerService(
            settings, self.client, SystemClock(), None, opener, informer=informer
        )

    async def start(self) -> None:
        """Starts the replica and with it the shared fleet view (the informer)."""
        await self.service.start()

    async def close(self) -> None:
        await self.service.stop()
        await self.client.aclose()

    async def schedule(self, req: s.ScheduleRequest) -> s.RoutePlan:
        """The plan for ``req``, exactly as the service's ``Schedule`` answers it (a retried
        request id replays its stored plan); the policy's errors propagate."""
        out = await self.service.schedule(cv.request_from_pb(req))
        return cv.plan_to_pb(out.head)

    async def report(self, req: s.ReportOutcomeRequest) -> None:
        """``ReportOutcome``'s use case: release, attach the outcome, learn (idempotent)."""
        await self.service.report_outcome(req.request_id, cv.outcome_from_pb(req))
