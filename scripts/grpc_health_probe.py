#!/usr/bin/env python3
"""Asks a gRPC server's grpc.health.v1.Health/Check and exits 0 only when it is SERVING.

The container image's health check and the compose end-to-end script use it. It needs
the standard library and grpcio, nothing else: the one-field request and response are
encoded by hand, so neither grpcio-health-checking nor generated code is imported.

    grpc_health_probe.py                          # 127.0.0.1:$HPD_PORT (default 50051)
    grpc_health_probe.py --addr 127.0.0.1:50052 --service hetero_pd.v1.SchedulerService
    grpc_health_probe.py --addr 127.0.0.1:50051 --wait 60   # poll until SERVING or 60 s
    grpc_health_probe.py --ca-file tls/ca.pem --cert-file tls/client.pem --key-file tls/client.key

Exit codes: 0 SERVING; 1 answered but not SERVING (NOT_SERVING, SERVICE_UNKNOWN, ...);
2 no answer (unreachable, deadline exceeded, unknown service name); 64 bad arguments.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import grpc

CHECK_METHOD = "/grpc.health.v1.Health/Check"
STATUS_NAMES = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}
SERVING = 1


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def encode_request(service: str) -> bytes:
    """HealthCheckRequest{service = 1 (string)}: tag 0x0A, length, UTF-8 bytes."""
    if not service:
        return b""
    raw = service.encode()
    return b"\x0a" + _varint(len(raw)) + raw


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    shift = result = 0
    while True:
        if pos >= len(data):
            raise ValueError("truncated varint")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def decode_status(data: bytes) -> int:
    """HealthCheckResponse{status = 1 (enum)}; an absent field is 0 (UNKNOWN).

    Unknown fields are skipped by wire type (0 varint, 1 fixed64, 2 length-delimited,
    5 fixed32), so a newer server that adds fields still parses.
    """
    pos, status = 0, 0
    while pos < len(data):
        key, pos = _read_varint(data, pos)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _read_varint(data, pos)
            if field == 1:
                status = value
        elif wire == 1:
            pos += 8
        elif wire == 2:
            length, pos = _read_varint(data, pos)
            pos += length
        elif wire == 5:
            pos += 4
        else:
            raise ValueError(f"unsupported wire type {wire}")
    return status


class Tls(NamedTuple):
    """PEM files for a TLS server (``ca``) that may ask for a client certificate."""

    ca: str = ""
    cert: str = ""
    key: str = ""

    def channel(self, addr: str) -> grpc.Channel:
        if not self.ca:
            return grpc.insecure_channel(addr)

        def read(path: str) -> bytes | None:
            return Path(path).read_bytes() if path else None

        creds = grpc.ssl_channel_credentials(read(self.ca), read(self.key), read(self.cert))
        return grpc.secure_channel(addr, creds)


PLAINTEXT = Tls()


def check(addr: str, service: str, timeout_s: float, tls: Tls = PLAINTEXT) -> int:
    """One Health/Check call; returns the status number or raises grpc.RpcError."""
    with tls.channel(addr) as channel:
        call: Callable[..., bytes] = channel.unary_unary(CHECK_METHOD)
        return decode_status(call(encode_request(service), timeout=timeout_s))


def probe(
    addr: str, service: str, timeout_s: float, wait_s: float, tls: Tls = PLAINTEXT
) -> tuple[int, str]:
    """Checks once, or every 0.5 s until SERVING or `wait_s` seconds have passed."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            status = check(addr, service, timeout_s, tls)
            code, text = (0 if status == SERVING else 1), STATUS_NAMES.get(status, str(status))
        except grpc.RpcError as exc:
            rpc_code = exc.code() if isinstance(exc, grpc.Call) else None
            code, text = 2, rpc_code.name if rpc_code is not None else "RPC_ERROR"
        if code == 0 or time.monotonic() >= deadline:
            return code, text
        time.sleep(0.5)


def main(argv: Sequence[str] | None = None) -> int:
    default_addr = f"127.0.0.1:{os.environ.get('HPD_PORT') or '50051'}"
    p = argparse.ArgumentParser(description="gRPC health probe (exit 0 when SERVING)")
    p.add_argument("--addr", default=default_addr, help=f"host:port (default {default_addr})")
    p.add_argument("--service", default="", help="service name ('' = the whole server)")
    p.add_argument("--timeout", type=float, default=3.0, help="deadline per call, seconds")
    p.add_argument("--wait", type=float, default=0.0, help="keep polling this many seconds")
    p.add_argument("-q", "--quiet", action="store_true", help="print nothing")
    env = os.environ.get
    p.add_argument(
        "--ca-file", default=env("HPD_CA_FILE", ""), help="TLS: the servers' CA (HPD_CA_FILE)"
    )
    p.add_argument(
        "--cert-file", default=env("HPD_CERT_FILE", ""), help="mTLS: client cert (HPD_CERT_FILE)"
    )
    p.add_argument(
        "--key-file", default=env("HPD_KEY_FILE", ""), help="mTLS: its key (HPD_KEY_FILE)"
    )
    try:
        args = p.parse_args(argv)
    except SystemExit as exc:
        return 0 if exc.code == 0 else 64
    tls = Tls(args.ca_file, args.cert_file, args.key_file)
    code, text = probe(args.addr, args.service, args.timeout, args.wait, tls)
    if not args.quiet:
        print(f"{args.addr} {args.service or '(server)'}: {text}")
    return code


if __name__ == "__main__":
    sys.exit(main())
