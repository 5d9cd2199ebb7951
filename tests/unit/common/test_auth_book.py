"""The tokens file as `TokenBook` reads it: tokens, hashes and mTLS identities."""

from __future__ import annotations

from typing import Any

import pytest

from hpd_common.auth import Principal, Role, TokenBook, hash_token
from hpd_common.auth_interceptor import certificate_names
from hpd_common.errors import InvalidArgument

TOKEN = "a-gateway-token-of-length"


def test_tokens_hashes_and_certificate_names_each_name_a_principal() -> None:
    book = TokenBook.parse(
        {
            "tokens": [
                {"name": "gw", "role": "gateway", "token": TOKEN},
                {"name": "ops", "role": "operator", "token_sha256": hash_token("x" * 20)},
                {"name": "gw-2", "role": "gateway", "cert_name": "gateway-2.prod"},
            ]
        },
        "test",
    )
    assert book.lookup(TOKEN) == Principal("gw", Role.GATEWAY)
    assert book.lookup("x" * 20) == Principal("ops", Role.OPERATOR)
    assert book.has_certificates and len(book) == 3
    assert book.lookup_certificate(["other", "gateway-2.prod"]) == Principal("gw-2", Role.GATEWAY)
    assert book.lookup_certificate(["gateway-2"]) is None
    assert book.lookup("gateway-2.prod") is None  # a certificate name is not a token


BAD: list[tuple[str, dict[str, Any], str]] = [
    ("token and cert", {"name": "a", "role": "worker", "token": TOKEN, "cert_name": "c"},
     "exactly one"),
    ("neither", {"name": "a", "role": "worker"}, "exactly one"),
    ("empty cert", {"name": "a", "role": "worker", "cert_name": " "}, "empty"),
]  # fmt: skip


@pytest.mark.parametrize(("_id", "entry", "says"), BAD, ids=[b[0] for b in BAD])
def test_a_bad_entry_is_refused_naming_it(_id: str, entry: dict[str, Any], says: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        TokenBook.parse({"tokens": [entry]}, "f")
    assert "tokens[0]" in err.value.field and says in str(err.value)


def test_a_certificate_name_twice_is_refused() -> None:
    entries = [
        {"name": "a", "role": "worker", "cert_name": "w"},
        {"name": "b", "role": "operator", "cert_name": "w"},
    ]
    with pytest.raises(InvalidArgument, match="appears twice"):
        TokenBook.parse({"tokens": entries}, "f")


def test_certificate_names_come_common_name_first() -> None:
    ctx = {
        "x509_common_name": [b"hpd-gateway"],
        "x509_subject_alternative_name": [b"gw.example", b"hpd-gateway"],
        "transport_security_type": [b"ssl"],
    }
    assert certificate_names(ctx) == ["hpd-gateway", "gw.example"]
    assert certificate_names({}) == []
