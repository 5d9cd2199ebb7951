"""The hostile values `hpd fuzz` gives a valid request (``hpd_fleet.fuzz``): one to three
fields of any protobuf message, at any depth, set to zero, negative, huge, NaN, infinity,
subnormal, empty, 10,000 characters, control characters, unknown enum numbers, a cleared
sub-message or hundreds of repeated entries. :func:`mutate` changes a message in place and
says what it did, so a failure can be replayed with the same seed."""

from __future__ import annotations

import math
import os
import random
from collections.abc import Iterator
from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

__all__ = ["mutate"]


_F = FieldDescriptor


_INTS = {_F.TYPE_INT32, _F.TYPE_SINT32, _F.TYPE_SFIXED32, _F.TYPE_INT64, _F.TYPE_SINT64,
         _F.TYPE_SFIXED64}  # fmt: skip


_UINTS = {_F.TYPE_UINT32, _F.TYPE_FIXED32, _F.TYPE_UINT64, _F.TYPE_FIXED64}


_FLOATS = {_F.TYPE_FLOAT, _F.TYPE_DOUBLE}


_BITS = {
    _F.TYPE_INT32: 32, _F.TYPE_SINT32: 32, _F.TYPE_SFIXED32: 32, _F.TYPE_UINT32: 32,
    _F.TYPE_FIXED32: 32, _F.TYPE_INT64: 64, _F.TYPE_SINT64: 64, _F.TYPE_SFIXED64: 64,
    _F.TYPE_UINT64: 64, _F.TYPE_FIXED64: 64,
}  # fmt: skip


_STRINGS = [
    "", " ", "x" * 10_000, "a\x00b", "line\nbreak", "\x1b[31m", "../../etc/passwd", "ünï©ødé",
    "🙂" * 64, "*", "%s%s%n", "-1", "NaN", "a" * 129, "hpd:worker:x", "' OR 1=1 --",
]  # fmt: skip


def _hostile(fd: Any, rng: random.Random) -> Any:
    """A hostile value for one scalar field of its type."""
    if fd.type in _FLOATS:
        return rng.choice([0.0, -1.0, 1e-308, 5e-324, 1e308, -1e308, math.inf, -math.inf,
                           math.nan, 1e30, 0.5])  # fmt: skip
    if fd.type in _INTS:
        bits = _BITS[fd.type]
        return rng.choice([0, -1, 1, -(2 ** (bits - 1)), 2 ** (bits - 1) - 1, 10**6])
    if fd.type in _UINTS:
        bits = _BITS[fd.type]
        return rng.choice([0, 1, 2**bits - 1, 2 ** (bits - 1), 10**9 % 2**bits])
    if fd.type == _F.TYPE_BOOL:
        return rng.random() < 0.5
    if fd.type == _F.TYPE_STRING:
        return rng.choice(_STRINGS)
    if fd.type == _F.TYPE_BYTES:
        return rng.choice([b"", b"\x00" * 64, os.urandom(32), b"\xff" * 4096])
    if fd.type == _F.TYPE_ENUM:
        known = [v.number for v in fd.enum_type.values]
        return rng.choice([*known, 0, 999, -5, 2**31 - 1])
    raise TypeError(fd.type)


def _paths(msg: Message, prefix: str = "", depth: int = 0) -> Iterator[tuple[str, Message, Any]]:
    """Every (path, containing message, field descriptor) reachable from ``msg``."""
    fields: list[Any] = list(msg.DESCRIPTOR.fields)
    for fd in fields:
        path = f"{prefix}{fd.name}"
        yield path, msg, fd
        if fd.type == _F.TYPE_MESSAGE and depth < 4 and not fd.message_type.GetOptions().map_entry:
            if _is_repeated(fd):
                for i, sub in enumerate(getattr(msg, fd.name)):
                    yield from _paths(sub, f"{path}[{i}].", depth + 1)
            elif msg.HasField(fd.name):
                yield from _paths(getattr(msg, fd.name), f"{path}.", depth + 1)


def _is_repeated(fd: Any) -> bool:
    flag = getattr(fd, "is_repeated", None)  # newer protobuf; `label` is deprecated there
    if flag is not None:
        return bool(flag() if callable(flag) else flag)
    return bool(fd.label == _F.LABEL_REPEATED)


def mutate(msg: Message, rng: random.Random) -> list[str]:
    """Give one to three fields of ``msg`` (in place) hostile values; what was done."""
    done: list[str] = []
    for _ in range(rng.randint(1, 3)):
        paths = list(_paths(msg))
        if not paths:
            break
        path, owner, fd = rng.choice(paths)
        target = getattr(owner, fd.name)
        try:
            if fd.type == _F.TYPE_MESSAGE:
                if fd.message_type.GetOptions().map_entry:
                    for i in range(rng.choice([1, 100, 300])):
                        key_fd = fd.message_type.fields_by_name["key"]
                        val_fd = fd.message_type.fields_by_name["value"]
                        if val_fd.type == _F.TYPE_MESSAGE:
                            break
                        key = _hostile(key_fd, rng)
                        target[f"{key}{i}" if isinstance(key, str) else key] = _hostile(val_fd, rng)
                    done.append(f"{path}: map entries")
                elif _is_repeated(fd):
                    if rng.random() < 0.5:
                        del target[:]
                        done.append(f"{path}: emptied")
                    else:
                        for _ in range(rng.choice([65, 300])):
                            target.add()
                        done.append(f"{path}: many empty entries")
                else:
                    owner.ClearField(fd.name)
                    done.append(f"{path}: cleared")
            elif _is_repeated(fd):
                n = rng.choice([0, 1, 65, 300])
                del target[:]
                target.extend(_hostile(fd, rng) for _ in range(n))
                done.append(f"{path}: {n} hostile entries")
            else:
                value = _hostile(fd, rng)
                setattr(owner, fd.name, value)
                shown = repr(value) if not isinstance(value, str) else repr(value[:24])
                done.append(f"{path}={shown}")
        except (ValueError, TypeError) as exc:  # the protobuf runtime refused the value
            done.append(f"{path}: not settable ({type(exc).__name__})")
    return done
