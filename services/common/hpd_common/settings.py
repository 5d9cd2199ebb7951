"""Settings from defaults, a YAML file, the environment and flags (later wins).

Each service declares a frozen dataclass of its settings; every field becomes
a flag `--field-name`, an environment variable `HPD_FIELD_NAME`, and a YAML key
`field_name` (in the file given by `--config` or `HPD_CONFIG`). A field's `help`
metadata is its flag's help text.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml

from hpd_common.errors import InvalidArgument

T = TypeVar("T")


def _field_type(cls: type[Any], field: dataclasses.Field[Any]) -> type[Any]:
    hints = typing.get_type_hints(cls)
    hint = hints[field.name]
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = args[0]
    if not isinstance(hint, type):
        raise TypeError(f"unsupported settings type for {field.name}: {hint!r}")
    return hint


def coerce(name: str, kind: type[Any], raw: Any) -> Any:
    """``raw`` (a YAML value or an environment string) as ``kind``; InvalidArgument naming
    ``name`` when it is not one (booleans: 1/0, true/false, yes/no, on/off)."""
    if raw is None:
        return None
    try:
        if kind is bool:
            if isinstance(raw, bool):
                return raw
            text = str(raw).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ValueError(f"not a boolean: {raw!r}")
        if kind is int and isinstance(raw, float) and not raw.is_integer():
            raise ValueError(f"not an integer: {raw!r}")
        return kind(raw)
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(name, str(exc)) from exc


def settings_parser(prog: str, doc: str | None, cls: type[Any]) -> argparse.ArgumentParser:
    """A command's parser: its module docstring's first paragraph as the description, the
    rest (examples, what it needs) as the epilog, and a flag per field of ``cls``."""
    head, _, rest = (doc or "").partition("\n\n")
    parser = argparse.ArgumentParser(
        prog=prog,
        description=head or None,
        epilog=rest or None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser, cls)
    return parser


def add_arguments(parser: argparse.ArgumentParser, cls: type[Any]) -> None:
    """Adds a flag per settings field (default None, so unset flags do not override)."""
    parser.add_argument("--config", help="YAML file of settings (keys are the flag names with _)")
    for field in dataclasses.fields(cls):
        kind = _field_type(cls, field)
        flag = "--" + field.name.replace("_", "-")
        help_text = field.metadata.get("help", "")
        default = field.default if field.default is not dataclasses.MISSING else None
        env = "HPD_" + field.name.upper()
        full_help = f"{help_text} (env {env}; default {default!r})"
        if kind is bool:
            parser.add_argument(
                flag,
                dest=field.name,
                default=None,
                help=full_help,
                action=argparse.BooleanOptionalAction,
            )
        else:
            parser.add_argument(flag, dest=field.name, default=None, help=full_help)


def load_settings(
    cls: type[T],
    args: argparse.Namespace | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> T:
    """Builds `cls` from YAML (args.config or $HPD_CONFIG), then env, then flags, then overrides."""
    env = os.environ if env is None else env
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    values: dict[str, Any] = {}
    config_path = getattr(args, "config", None) or env.get("HPD_CONFIG")
    if config_path:
        path = Path(config_path)
        try:
            loaded = yaml.safe_load(path.read_text()) or {}
        except OSError as exc:
            raise InvalidArgument("config", f"cannot read {path}: {exc.strerror}") from exc
        except yaml.YAMLError as exc:
            raise InvalidArgument("config", f"{path} is not valid YAML: {exc}") from exc
        if not isinstance(loaded, dict):
            raise InvalidArgument("config", f"{path} must hold a mapping of settings")
        for key, raw in loaded.items():
            name = str(key).replace("-", "_")
            if name not in fields:
                raise InvalidArgument(f"config.{key}", f"unknown setting; known: {sorted(fields)}")
            values[name] = raw
    for name in fields:
        env_name = "HPD_" + name.upper()
        if env_name in env and env[env_name] != "":
            values[name] = env[env_name]
    if args is not None:
        for name in fields:
            raw = getattr(args, name, None)
            if raw is not None:
                values[name] = raw
    if overrides:
        values.update(overrides)
    coerced = {
        name: coerce(name, _field_type(cls, fields[name]), raw) for name, raw in values.items()
    }
    return cls(**coerced)


def split_csv(text: str) -> Sequence[str]:
    """`a, b,,c` -> ["a", "b", "c"]."""
    return [part.strip() for part in text.split(",") if part.strip()]
