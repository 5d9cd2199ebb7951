"""Every gRPC channel hetero-pd opens, with the caller's identity: TLS and a bearer token.

One function per flavour (:func:`aio_channel`, :func:`sync_channel`) so that turning on
TLS or auth for a server never cuts off one of its own clients (the scheduler's informer,
its directive sender, the broker opener, the gateway, the agent, the CLI tables).

:class:`CallIdentity`: ``ca_file`` (PEM roots: the channel speaks TLS), ``cert_file`` and
``key_file`` (a client certificate, for servers that ask for mTLS), ``token`` (sent as
``authorization: Bearer <token>`` on every call; see :mod:`hpd_common.auth`). The CLI and
the agent read them from ``HPD_TOKEN``, ``HPD_CA_FILE``, ``HPD_CERT_FILE`` and
``HPD_KEY_FILE`` (:meth:`CallIdentity.from_env`); services from their ``call_*`` settings.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from hpd_common import tracing_interceptor
from hpd_common.errors import InvalidArgument

Options = Sequence[tuple[str, Any]]


@dataclass(frozen=True, slots=True)
class CallIdentity:
    token: str = ""
    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> CallIdentity:
        env = os.environ if env is None else env
        return cls(
            token=env.get("HPD_TOKEN", ""),
            ca_file=env.get("HPD_CA_FILE", ""),
            cert_file=env.get("HPD_CERT_FILE", ""),
            key_file=env.get("HPD_KEY_FILE", ""),
        )

    @property
    def tls(self) -> bool:
        return bool(self.ca_file)

    def credentials(self) -> grpc.ChannelCredentials | None:
        """TLS channel credentials, or None for plaintext."""
        if not self.ca_file:
            if self.cert_file or self.key_file:
                raise InvalidArgument("ca_file", "a client certificate needs the CA (TLS) too")
            return None
        if bool(self.cert_file) != bool(self.key_file):
            raise InvalidArgument("cert_file", "a client certificate needs both cert and key")

        def read(name: str, path: str) -> bytes | None:
            if not path:
                return None
            try:
                return Path(path).read_bytes()
            except OSError as exc:
                raise InvalidArgument(name, f"cannot read {path}: {exc.strerror}") from exc

        return grpc.ssl_channel_credentials(
            root_certificates=read("ca_file", self.ca_file),
            private_key=read("key_file", self.key_file),
            certificate_chain=read("cert_file", self.cert_file),
        )

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()


@dataclass(frozen=True, slots=True)
class CallSettings:
    """How a process's own clients reach the control plane's services: a settings base
    (every field a flag, ``HPD_<NAME>`` and a YAML key) for the services and the gateway."""

    call_token: str = field(
        default="",
        metadata={"help": "bearer token presented to the other services (hpd up --auth)"},
    )
    call_ca_file: str = field(
        default="", metadata={"help": "PEM CA to verify the other services by (TLS to them)"}
    )
    call_cert_file: str = field(
        default="", metadata={"help": "PEM client certificate for mTLS to the other services"}
    )
    call_key_file: str = field(default="", metadata={"help": "PEM key of call_cert_file"})

    def call_identity(self) -> CallIdentity:
        return CallIdentity(
            self.call_token, self.call_ca_file, self.call_cert_file, self.call_key_file
        )


def _with_token(metadata: Any, extra: tuple[tuple[str, str], ...]) -> grpc.aio.Metadata:
    md = grpc.aio.Metadata(*(tuple(metadata) if metadata else ()))
    if "authorization" not in md:  # else the call chose its own identity
        for key, value in extra:
            md.add(key, value)
    return md


class _AioToken:
    """Adds the token to a call's metadata (unless the call brought its own)."""

    def __init__(self, extra: tuple[tuple[str, str], ...]) -> None:
        self.extra = extra

    def _details(self, d: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        return grpc.aio.ClientCallDetails(
            d.method, d.timeout, _with_token(d.metadata, self.extra), d.credentials,
            d.wait_for_ready,
        )  # fmt: skip


# grpc.aio files each interceptor under the first call kind it implements, so one class
# per kind
class _AioUnaryUnary(_AioToken, grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    async def intercept_unary_unary(self, continuation: Any, d: Any, request: Any) -> Any:
        return await continuation(self._details(d), request)


class _AioUnaryStream(_AioToken, grpc.aio.UnaryStreamClientInterceptor):  # type: ignore[misc]
    async def intercept_unary_stream(self, continuation: Any, d: Any, request: Any) -> Any:
        return await continuation(self._details(d), request)


class _AioStreamUnary(_AioToken, grpc.aio.StreamUnaryClientInterceptor):  # type: ignore[misc]
    async def intercept_stream_unary(self, continuation: Any, d: Any, requests: Any) -> Any:
        return await continuation(self._details(d), requests)


class _AioStreamStream(_AioToken, grpc.aio.StreamStreamClientInterceptor):  # type: ignore[misc]
    async def intercept_stream_stream(self, continuation: Any, d: Any, requests: Any) -> Any:
        return await continuation(self._details(d), requests)


class _SyncDetails(grpc.ClientCallDetails):  # type: ignore[misc]
    def __init__(self, d: Any, metadata: Any) -> None:
        self.method = d.method
        self.timeout = d.timeout
        self.metadata = metadata
        self.credentials = d.credentials
        self.wait_for_ready = getattr(d, "wait_for_ready", None)
        self.compression = getattr(d, "compression", None)


class _SyncToken(
    grpc.UnaryUnaryClientInterceptor,  # type: ignore[misc]
    grpc.UnaryStreamClientInterceptor,  # type: ignore[misc]
    grpc.StreamUnaryClientInterceptor,  # type: ignore[misc]
    grpc.StreamStreamClientInterceptor,  # type: ignore[misc]
):
    def __init__(self, extra: tuple[tuple[str, str], ...]) -> None:
        self.extra = extra

    def _details(self, d: Any) -> Any:
        have = list(d.metadata or ())
        if any(k == "authorization" for k, _ in have):
            return d
        return _SyncDetails(d, [*have, *self.extra])

    def intercept_unary_unary(self, continuation: Any, d: Any, request: Any) -> Any:
        return continuation(self._details(d), request)

    def intercept_unary_stream(self, continuation: Any, d: Any, request: Any) -> Any:
        return continuation(self._details(d), request)

    def intercept_stream_unary(self, continuation: Any, d: Any, requests: Any) -> Any:
        return continuation(self._details(d), requests)

    def intercept_stream_stream(self, continuation: Any, d: Any, requests: Any) -> Any:
        return continuation(self._details(d), requests)


def aio_channel(
    target: str, identity: CallIdentity | None = None, options: Options | None = None
) -> grpc.aio.Channel:
    """An asyncio channel to ``target`` speaking as ``identity`` (plaintext, anonymous when
    None); while this process traces, its unary calls carry their trace context."""
    identity = identity or CallIdentity()
    creds = identity.credentials()
    extra = identity.metadata()
    interceptors: list[Any] = tracing_interceptor.client_interceptors()  # none while off
    if identity.token:
        interceptors += [
            k(extra) for k in (_AioUnaryUnary, _AioUnaryStream, _AioStreamUnary, _AioStreamStream)
        ]
    if creds is not None:
        return grpc.aio.secure_channel(
            target, creds, options=options, interceptors=interceptors or None
        )
    return grpc.aio.insecure_channel(target, options=options, interceptors=interceptors or None)


def sync_channel(
    target: str, identity: CallIdentity | None = None, options: Options | None = None
) -> grpc.Channel:
    """A blocking channel to ``target`` speaking as ``identity`` (the CLI's tables)."""
    identity = identity or CallIdentity()
    creds = identity.credentials()
    channel = (
        grpc.secure_channel(target, creds, options=options)
        if creds is not None
        else grpc.insecure_channel(target, options=options)
    )
    if identity.token:
        return grpc.intercept_channel(channel, _SyncToken(identity.metadata()))
    return channel
