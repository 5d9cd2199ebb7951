"""Client identity at the front door: API keys bound to a tenant, its tiers and its limits.

``hpd gateway --api-keys FILE`` (YAML, mode 0600 as any secret; ``hpd gateway-key`` makes
an entry)::

    keys:
      - tenant: acme                 # who the key belongs to (metrics, logs, request ids)
        key_sha256: 9f86d081884c...  # the key's SHA-256 (hex); or `key:` the key itself
        tier: standard               # the tier of a request that names none
        tiers: [standard, batch]     # what `x-hpd-tier` may ask for (default: [tier])
        requests_per_s: 20           # token bucket: rate (0 = no limit) ...
        burst: 40                    # ... and depth (default: max(1, requests_per_s))
        max_concurrent: 64           # requests in flight (0 = no limit)
        tokens_per_min: 500000       # prompt + max output tokens admitted per minute (0 = none)

With keys configured every request needs ``Authorization: Bearer <key>``: no key or an
unknown one is 401, a tier outside the key's ``tiers`` is 403, a limit reached is 429 with
``Retry-After``. Keys are kept only as SHA-256 digests; a presented key is hashed and looked
up by digest, then the digests are compared with :func:`hmac.compare_digest`: the lookup's
timing can only tell an attacker about a digest, and finding a key from its digest is the
preimage problem. Limits are per key; metrics are per tenant.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from .protocol import GatewayError

__all__ = ["ApiKey", "ApiKeys", "KeyFileError", "TokenBucket", "hash_key", "new_key_entry"]

MIN_KEY_CHARS = 16


class KeyFileError(ValueError):
    """The keys file is unreadable or breaks its schema (the message names the entry)."""


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(slots=True)
class TokenBucket:
    """``rate`` per second up to ``depth``; :meth:`take` answers how long until ``n`` fit."""

    rate: float
    depth: float
    level: float = -1.0  # full at the first take
    at: float = 0.0

    def take(self, n: float, now: float) -> float:
        """Take ``n`` if they are there (0.0); else the seconds until they would be."""
        if self.level < 0:
            self.level, self.at = self.depth, now
        self.level = min(self.depth, self.level + (now - self.at) * self.rate)
        self.at = now
        if n <= self.level:
            self.level -= n
            return 0.0
        if n > self.depth:  # never fits: wait a whole refill, the caller refuses it outright
            return math.inf
        return (n - self.level) / self.rate


@dataclass(slots=True)
class ApiKey:
    """One entry of the keys file, with its live limits."""

    tenant: str
    digest: str
    tier: str
    tiers: frozenset[str]
    max_concurrent: int = 0
    requests: TokenBucket | None = None
    tokens: TokenBucket | None = None
    in_flight: int = 0

    def tier_for(self, asked: str) -> str:
        """The tier of a request that asked for ``asked`` ('' = none): 403 outside its own."""
        if not asked:
            return self.tier
        if asked not in self.tiers:
            raise GatewayError(
                403, f"this API key may use the tiers {sorted(self.tiers)}, not {asked!r}",
                type_="permission_error", code="tier_not_allowed", param="x-hpd-tier",
            )  # fmt: skip
        return asked

    def admit(self, now: float) -> None:
        """Count one request in (release it with :meth:`release`), or 429."""
        if self.max_concurrent and self.in_flight >= self.max_concurrent:
            raise _limited(f"{self.max_concurrent} requests in flight", 1)
        if self.requests is not None:
            wait = self.requests.take(1, now)
            if wait:
                raise _limited(f"{self.requests.rate:g} requests per second", wait)
        self.in_flight += 1

    def release(self) -> None:
        self.in_flight = max(0, self.in_flight - 1)

    def charge(self, tokens: int, now: float) -> None:
        """Charge a request's prompt and output tokens to the per-minute budget, or 429."""
        if self.tokens is None:
            return
        wait = self.tokens.take(tokens, now)
        if wait == math.inf:
            raise GatewayError(
                429, f"{tokens} tokens is more than this key's {self.tokens.depth:g} per minute",
                type_="rate_limit_error", code="tokens_per_min",
            )  # fmt: skip
        if wait:
            raise _limited(f"{self.tokens.depth:g} tokens per minute", wait)


def _limited(what: str, wait_s: float) -> GatewayError:
    return GatewayError(
        429, f"this API key's limit of {what} is reached", type_="rate_limit_error",
        code="rate_limited", retry_after_s=max(1, math.ceil(wait_s)),
    )  # fmt: skip


class ApiKeys:
    """The keys file: digest -> :class:`ApiKey`."""

    def __init__(self, keys: list[ApiKey]) -> None:
        self._by_digest = {k.digest: k for k in keys}
        self.tenants = sorted({k.tenant for k in keys})

    def __len__(self) -> int:
        return len(self._by_digest)

    def lookup(self, presented: str) -> ApiKey | None:
        if not presented:
            return None
        digest = hash_key(presented)
        found = self._by_digest.get(digest)
        if found is None or not hmac.compare_digest(found.digest, digest):
            return None
        return found

    def identify(self, authorization: str) -> ApiKey:
        """The key of an ``Authorization`` header, or 401."""
        scheme, _, presented = authorization.partition(" ")
        key = self.lookup(presented.strip()) if scheme.lower() == "bearer" else None
        if key is None:
            raise GatewayError(
                401, "a valid API key is required (Authorization: Bearer <key>)",
                type_="authentication_error", code="invalid_api_key",
            )  # fmt: skip
        return key

    @classmethod
    def load(cls, path: str | Path) -> ApiKeys:
        p = Path(path)
        try:
            doc = yaml.safe_load(p.read_text())
        except OSError as exc:
            raise KeyFileError(f"api_keys: cannot read {p}: {exc.strerror}") from exc
        except yaml.YAMLError as exc:
            raise KeyFileError(f"api_keys: {p} is not valid YAML: {exc}") from exc
        return cls.parse(doc, f"api_keys ({p})")

    @classmethod
    def parse(cls, doc: Any, where: str) -> ApiKeys:
        entries = doc.get("keys") if isinstance(doc, dict) else None
        if not isinstance(entries, list) or not entries:
            raise KeyFileError(
                f"{where}: must hold `keys:`, a list of {{tenant, key_sha256, tier}}"
            )
        out: list[ApiKey] = []
        seen: set[str] = set()
        for i, e in enumerate(entries):
            key = _entry(e, f"{where} keys[{i}]")
            if key.digest in seen:
                raise KeyFileError(f"{where} keys[{i}]: the same key appears twice")
            seen.add(key.digest)
            out.append(key)
        return cls(out)


_FIELDS = {"tenant", "key", "key_sha256", "tier", "tiers"} | {
    "requests_per_s", "burst", "max_concurrent", "tokens_per_min",
}  # fmt: skip


def _entry(e: Any, at: str) -> ApiKey:
    if not isinstance(e, dict):
        raise KeyFileError(f"{at}: must be a mapping")
    unknown = sorted(set(e) - _FIELDS)
    if unknown:
        raise KeyFileError(f"{at}: unknown key {unknown[0]!r} (known: {sorted(_FIELDS)})")
    tenant, tier = str(e.get("tenant") or ""), str(e.get("tier") or "")
    if not tenant or not tier:
        raise KeyFileError(f"{at}: needs a tenant and a tier")
    plain, digest = e.get("key"), e.get("key_sha256")
    if (plain is None) == (digest is None):
        raise KeyFileError(f"{at}: needs exactly one of key and key_sha256")
    if plain is not None:
        if len(str(plain)) < MIN_KEY_CHARS:
            raise KeyFileError(f"{at}: a key must be at least {MIN_KEY_CHARS} characters")
        digest = hash_key(str(plain))
    digest = str(digest).lower()
    if len(digest) != 64 or any(ch not in "0123456789abcdef" for ch in digest):
        raise KeyFileError(f"{at}: key_sha256 must be 64 hex digits")
    tiers = e.get("tiers", [tier])
    if not isinstance(tiers, list) or not all(isinstance(t, str) and t for t in tiers):
        raise KeyFileError(f"{at}: tiers must be a list of tier names")
    rps = _number(e, "requests_per_s", at)
    burst = _number(e, "burst", at) or max(1.0, rps)
    tpm = _number(e, "tokens_per_min", at)
    return ApiKey(
        tenant=tenant,
        digest=digest,
        tier=tier,
        tiers=frozenset({tier, *tiers}),
        max_concurrent=int(_number(e, "max_concurrent", at)),
        requests=TokenBucket(rps, burst) if rps > 0 else None,
        tokens=TokenBucket(tpm / 60.0, tpm) if tpm > 0 else None,
    )


def _number(e: Mapping[str, Any], name: str, at: str) -> float:
    v = e.get(name, 0)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise KeyFileError(f"{at}: {name} must be a number >= 0")
    return float(v)


def new_key_entry(tenant: str, tier: str) -> tuple[str, dict[str, Any]]:
    """A fresh random key and its keys-file entry (only the digest is kept)."""
    key = "hpd-" + secrets.token_urlsafe(32)
    return key, {"tenant": tenant, "key_sha256": hash_key(key), "tier": tier, "tiers": [tier]}
