"""Secure by default: nothing listens beyond loopback unprotected unless told to.

A service (or ``hpd up``, or ``hpd gateway``) asked to listen on an address other than
loopback without both auth (a tokens file; the gateway's API keys) and TLS refuses to start
and names ``--insecure`` (``HPD_INSECURE=true``) as the way to insist: a registry open to
the network lets anyone register a decode worker with an endpoint of their own and receive
users' prompts; a plaintext gateway carries users' keys in the clear.
"""

from __future__ import annotations

import ipaddress

from hpd_common.errors import InvalidArgument

__all__ = ["check_exposure", "is_loopback"]


def is_loopback(host: str) -> bool:
    """``localhost``, 127.0.0.0/8 and ::1; everything else (``0.0.0.0``, ``::``, a name, a
    public or private address) reaches beyond this machine."""
    h = host.strip().strip("[]")
    if h.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


def check_exposure(host: str, *, auth: bool, tls: bool, insecure: bool, what: str) -> None:
    """InvalidArgument naming ``--insecure`` when ``what`` would listen on ``host`` beyond
    loopback without auth and TLS (and ``insecure`` is not set)."""
    if insecure or is_loopback(host) or (auth and tls):
        return
    missing = " and ".join(n for n, ok in (("auth", auth), ("TLS", tls)) if not ok)
    raise InvalidArgument(
        "host",
        f"{what} would listen on {host} without {missing}: anyone who reaches it could use "
        f"it. Turn on {missing}, listen on 127.0.0.1, or pass --insecure (HPD_INSECURE=true) "
        "to insist",
    )
