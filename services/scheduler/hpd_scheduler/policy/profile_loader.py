"""Reading a profile: YAML (a file, text, or a built-in name) validated into a
:class:`~.config.Profile`, every error a :class:`ConfigError` naming the offending key's
dotted path (see `config.py` for what a profile holds)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from hpd_common.yamlsafe import YamlLimitError, load_bounded

from .config import (
    DEFAULT_TIERS,
    PAIRINGS,
    PRESELECT_MODES,
    Profile,
    SideSpec,
    SloObjective,
)
from .domain import ResourceNeed, Role, Tier
from .errors import ConfigError, InvalidInputError
from .framework import Filter, OptionFilter, Picker, Plugin, PluginRegistry, Scorer
from .plugins import REGISTRY
from .serving import DEFAULT_LADDER, Action, LadderStep, Protects

__all__ = ["builtin_profile", "builtin_profile_names", "load_profile", "parse_profile"]

_PROTECTS = {
    Action.THROTTLE_ADMISSION: Protects.RESIDENCY,
    Action.LOWER_BATCH_CAP: Protects.LATENCY,
    Action.FALLBACK_TO_SHARED: Protects.RESIDENCY,
    Action.SHED_LOWEST_TIER: Protects.HIGHER_TIERS,
}

_TOP_KEYS = {
    "profile",
    "plugins",
    "preselect",
    "pairing",
    "handoff",
    "picker",
    "classification",
    "side_weights",
    "prefill",
    "decode",
    "ladder",
    "tiers",
    "chain_length",
    "description",
    "slo_objective",
    "option_filters",
}


def _req(cond: bool, path: str, msg: str) -> None:
    if not cond:
        raise ConfigError(path, msg)


def _int(data: Mapping[str, Any], key: str, default: int, path: str, lo: int = 1) -> int:
    value = data.get(key, default)
    _req(
        isinstance(value, int) and not isinstance(value, bool),
        f"{path}.{key}",
        "must be an integer",
    )
    _req(value >= lo, f"{path}.{key}", f"must be >= {lo}, got {value}")
    return int(value)


def _num(value: Any, path: str) -> float:
    _req(
        isinstance(value, int | float) and not isinstance(value, bool),
        path,
        f"must be a number, got {value!r}",
    )
    out = float(value)
    _req(math.isfinite(out), path, "must be finite")
    return out


def _map(value: Any, path: str) -> Mapping[str, Any]:
    _req(isinstance(value, Mapping), path, "must be a mapping")
    return value  # type: ignore[no-any-return]


def parse_profile(doc: Any, registry: PluginRegistry = REGISTRY, root: str = "") -> Profile:
    """Validate a parsed YAML document into a :class:`Profile` (see the module docstring).
    Sections are checked in document order of importance (name, plugins, the two sides,
    picker, preselection, pairing, classification, side weights, ladder, tiers, SLO
    objective); the first error found is raised, naming its key."""
    p = (root + ".") if root else ""
    data = _map(doc, root or "profile")
    for key in data:
        _req(key in _TOP_KEYS, f"{p}{key}", f"unknown key; expected one of {sorted(_TOP_KEYS)}")
    name = data.get("profile")
    _req(isinstance(name, str) and bool(name), f"{p}profile", "a profile needs a name")

    instances = _plugin_instances(data, p, registry)
    prefill = _side(data, "prefill", Role.PREFILL, p, instances)
    decode = _side(data, "decode", Role.DECODE, p, instances)
    _req("picker" in data, f"{p}picker", "a profile needs a picker")
    picker = _ref(instances, data["picker"], f"{p}picker", Picker)
    assert isinstance(picker, Picker)

    pre = _map(data.get("preselect", {}) or {}, f"{p}preselect")
    for k in pre:
        _req(
            k in {"key", "top_k_prefill", "top_k_decode", "max_scan"},
            f"{p}preselect.{k}",
            "unknown key",
        )
    key = pre.get("key", "capacity")
    _req(key in PRESELECT_MODES, f"{p}preselect.key", f"must be one of {list(PRESELECT_MODES)}")
    pairing = data.get("pairing", "joint")
    _req(pairing in PAIRINGS, f"{p}pairing", f"must be one of {list(PAIRINGS)}")

    cls_raw = _map(data.get("classification", {}) or {}, f"{p}classification")
    for k in cls_raw:
        _req(
            k in {"long_prompt_tokens", "long_decode_tokens"},
            f"{p}classification.{k}",
            "unknown key",
        )
    sw = _side_weights(data, p)
    ladder = _ladder(data["ladder"], p) if "ladder" in data else DEFAULT_LADDER
    tiers, default_tier = (
        _tiers(data["tiers"], p) if "tiers" in data else (dict(DEFAULT_TIERS), "standard")
    )
    slo_objective = None
    if data.get("slo_objective") is not None:
        slo_objective = _slo_objective(data["slo_objective"], p)
    option_filters: tuple[OptionFilter, ...] | None = None
    if "option_filters" in data:  # absent: the built-in ones (admission.default_option_filters)
        raw = data["option_filters"] or []
        _req(isinstance(raw, list), f"{p}option_filters", "must be a list of plugin names")
        option_filters = tuple(
            _option_filter(instances, name, f"{p}option_filters[{i}]") for i, name in enumerate(raw)
        )

    return Profile(
        name=str(name),
        prefill=prefill,
        decode=decode,
        picker=picker,
        preselect=str(key),
        top_k_prefill=_int(pre, "top_k_prefill", 6, f"{p}preselect"),
        top_k_decode=_int(pre, "top_k_decode", 6, f"{p}preselect"),
        max_scan=_int(pre, "max_scan", 256, f"{p}preselect"),
        pairing=str(pairing),
        long_prompt_tokens=_int(cls_raw, "long_prompt_tokens", 2048, f"{p}classification", 0),
        long_decode_tokens=_int(cls_raw, "long_decode_tokens", 256, f"{p}classification", 0),
        side_weights=sw,
        ladder=ladder,
        tiers=tiers,
        default_tier=default_tier,
        chain_length=_int(data, "chain_length", 3, p.rstrip(".") or "profile", 0),
        slo_objective=slo_objective,
        option_filters=option_filters,
    )


def _option_filter(instances: dict[str, Plugin], value: Any, path: str) -> OptionFilter:
    """The option filter instance ``value`` names (``option_filters:``, in order)."""
    f = _ref(instances, value, path, OptionFilter)
    assert isinstance(f, OptionFilter)
    return f


def _plugin_instances(
    data: Mapping[str, Any], p: str, registry: PluginRegistry
) -> dict[str, Plugin]:
    """The ``plugins`` section: every instance by its (unique) name."""
    instances: dict[str, Plugin] = {}
    raw_plugins = data.get("plugins", [])
    _req(isinstance(raw_plugins, list), f"{p}plugins", "must be a list")
    for i, spec in enumerate(raw_plugins):
        path = f"{p}plugins[{i}]"
        spec = _map(spec, path)
        for key in spec:
            _req(key in {"name", "type", "params"}, f"{path}.{key}", "unknown key")
        pname = spec.get("name")
        ptype = spec.get("type")
        _req(isinstance(pname, str) and bool(pname), f"{path}.name", "required string")
        _req(isinstance(ptype, str) and bool(ptype), f"{path}.type", "required string")
        _req(pname not in instances, f"{path}.name", f"duplicate plugin name {pname!r}")
        params = spec.get("params") or {}
        instances[str(pname)] = registry.create(str(ptype), str(pname), params, path)
    return instances


def _ref(instances: dict[str, Plugin], value: Any, path: str, kind: type[Plugin]) -> Plugin:
    """The plugin instance ``value`` names, which must be a ``kind``."""
    _req(isinstance(value, str), path, "must name a plugin instance")
    inst = instances.get(value)
    _req(inst is not None, path, f"no plugin instance named {value!r}")
    assert inst is not None
    _req(isinstance(inst, kind), path, f"{value!r} is a {inst.kind}, not a {kind.kind}")
    return inst


def _side(
    data: Mapping[str, Any], key: str, role: Role, p: str, instances: dict[str, Plugin]
) -> SideSpec:
    """One side's filters and weighted scorers (``prefill`` or ``decode``)."""
    path = f"{p}{key}"
    raw = _map(data.get(key, {}), path)
    for k in raw:
        _req(k in {"filters", "scorers"}, f"{path}.{k}", "unknown key")
    filters: list[Filter] = []
    for i, fname in enumerate(raw.get("filters", []) or []):
        f = _ref(instances, fname, f"{path}.filters[{i}]", Filter)
        assert isinstance(f, Filter)
        filters.append(f)
    scorers: list[tuple[Scorer, float]] = []
    seen: set[str] = set()
    for i, spec in enumerate(raw.get("scorers", []) or []):
        spath = f"{path}.scorers[{i}]"
        spec = _map(spec, spath)
        for k in spec:
            _req(k in {"plugin", "weight"}, f"{spath}.{k}", "unknown key")
        s = _ref(instances, spec.get("plugin"), f"{spath}.plugin", Scorer)
        assert isinstance(s, Scorer)
        _req(role in s.roles, f"{spath}.plugin", f"{s.type_name} does not score {role} workers")
        _req(s.name not in seen, f"{spath}.plugin", f"scorer {s.name!r} listed twice")
        seen.add(s.name)
        _req("weight" in spec, f"{spath}.weight", "required")
        w = _num(spec["weight"], f"{spath}.weight")
        _req(w > 0, f"{spath}.weight", f"must be > 0, got {w}")
        scorers.append((s, w))
    _req(bool(scorers), f"{path}.scorers", "at least one scorer is required")
    return SideSpec(tuple(filters), tuple(scorers))


def _side_weights(data: Mapping[str, Any], p: str) -> dict[ResourceNeed, tuple[float, float]]:
    """How much each side's score counts, per resource need, normalised to sum to 1."""
    sw: dict[ResourceNeed, tuple[float, float]] = {
        ResourceNeed.PREFILL: (0.65, 0.35),
        ResourceNeed.DECODE: (0.35, 0.65),
        ResourceNeed.SHARED: (0.5, 0.5),
    }
    for k, v in _map(data.get("side_weights", {}) or {}, f"{p}side_weights").items():
        path = f"{p}side_weights.{k}"
        _req(k in {n.value for n in ResourceNeed}, path, "unknown resource need")
        _req(isinstance(v, list) and len(v) == 2, path, "must be [prefill_weight, decode_weight]")
        a, b = _num(v[0], f"{path}[0]"), _num(v[1], f"{path}[1]")
        _req(a > 0, f"{path}[0]", "must be > 0")
        _req(b > 0, f"{path}[1]", "must be > 0")
        sw[ResourceNeed(k)] = (a / (a + b), b / (a + b))
    return sw


def _ladder(raw_ladder: Any, p: str) -> tuple[LadderStep, ...]:
    """The serving-action ladder: actions at ascending memory pressure."""
    _req(isinstance(raw_ladder, list), f"{p}ladder", "must be a list")
    steps: list[LadderStep] = []
    for i, spec in enumerate(raw_ladder):
        path = f"{p}ladder[{i}]"
        spec = _map(spec, path)
        try:
            action = Action(str(spec.get("action")))
        except ValueError:
            raise ConfigError(f"{path}.action", f"must be one of {list(_PROTECTS)}") from None
        _req(action in _PROTECTS, f"{path}.action", "not a ladder action")
        above = _num(spec.get("above"), f"{path}.above")
        _req(0 <= above <= 1, f"{path}.above", "must be in [0, 1]")
        _req(not steps or above >= steps[-1].above, f"{path}.above", "ladder must ascend")
        steps.append(LadderStep(action, above, _PROTECTS[action]))
    return tuple(steps)


_TIER_KEYS = frozenset(
    {"ttft_ms", "tpot_ms", "queue_budget_ms", "priority", "may_throttle", "may_shed",
     "hard_ttft_ms"}
)  # fmt: skip


def _tiers(raw: Any, p: str) -> tuple[dict[str, Tier], str]:
    """The serving tiers (classes replacing the defaults when given) and the default one."""
    tiers = dict(DEFAULT_TIERS)
    default_tier = "standard"
    traw = _map(raw, f"{p}tiers")
    classes = _map(traw.get("classes", {}), f"{p}tiers.classes")
    if classes:
        tiers = {}
    for tname, spec in classes.items():
        path = f"{p}tiers.classes.{tname}"
        spec = _map(spec, path)
        for k in spec:
            _req(k in _TIER_KEYS, f"{path}.{k}", "unknown key")
        try:
            tier = Tier(
                str(tname),
                ttft_ms=_num(spec.get("ttft_ms"), f"{path}.ttft_ms"),
                tpot_ms=_num(spec.get("tpot_ms"), f"{path}.tpot_ms"),
                queue_budget_ms=_num(spec.get("queue_budget_ms"), f"{path}.queue_budget_ms"),
                priority=int(spec.get("priority", 1)),
                may_throttle=bool(spec.get("may_throttle", False)),
                may_shed=bool(spec.get("may_shed", False)),
                hard_ttft_ms=(
                    None
                    if spec.get("hard_ttft_ms") is None
                    else _num(spec["hard_ttft_ms"], f"{path}.hard_ttft_ms")
                ),
            )
            tier.validate(path)
        except InvalidInputError as exc:
            raise ConfigError(exc.field, exc.message) from None
        tiers[str(tname)] = tier
    default_tier = str(traw.get("default", default_tier))
    _req(default_tier in tiers, f"{p}tiers.default", f"no tier named {default_tier!r}")
    return tiers, default_tier


_SLO_KEYS = frozenset(
    {
        "ttft_fraction",
        "tpot_fraction",
        "slack_weight",
        "conditional",
        "admit_ttft_factor",
        "admit_tpot_factor",
    }
)


def _slo_objective(raw: Any, p: str) -> SloObjective:
    """The SLO objective: how options are judged against the tier's targets."""
    sraw = _map(raw, f"{p}slo_objective")
    fractions: dict[str, Any] = {}
    for k, v in sraw.items():
        path = f"{p}slo_objective.{k}"
        _req(k in _SLO_KEYS, path, "unknown key")
        if k == "conditional":
            _req(isinstance(v, bool), path, "must be true or false")
            fractions[k] = v
            continue
        f = _num(v, path)
        if k == "slack_weight":
            _req(0 <= f <= 1, path, "must be in [0, 1]")
        elif k in ("admit_ttft_factor", "admit_tpot_factor"):
            _req(0 <= f <= 4, path, "must be 0 (off) or in (0, 4]")
        else:
            _req(0 < f <= 4, path, "must be in (0, 4]")
        fractions[str(k)] = f
    return SloObjective(**fractions)


def load_profile(source: str | Path, registry: PluginRegistry = REGISTRY) -> Profile:
    """Load a profile from a YAML file path, or from YAML text when ``source`` is a str
    containing a newline."""
    if isinstance(source, str) and "\n" in source:
        text = source
    else:
        try:
            text = Path(source).read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError("profile", f"cannot read {source}: {exc.strerror}") from None
    try:
        doc = load_bounded(text)
    except YamlLimitError as exc:
        raise ConfigError("profile", f"refused: {exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError("profile", f"invalid YAML: {exc}") from None
    return parse_profile(doc, registry)


def builtin_profile_names() -> list[str]:
    """Names of the profiles shipped in ``policy/profiles/``."""
    root = resources.files("hpd_scheduler.policy") / "profiles"
    return sorted(e.name[:-5] for e in root.iterdir() if e.name.endswith(".yaml"))


def builtin_profile(name: str = "default", registry: PluginRegistry = REGISTRY) -> Profile:
    """Load a shipped profile by name (``default``, ``seed``, ``least_loaded``,
    ``round_robin``, ``random``, ``colocated``)."""
    res = resources.files("hpd_scheduler.policy") / "profiles" / f"{name}.yaml"
    if not res.is_file():
        raise ConfigError(
            "profile", f"no built-in profile {name!r}; known: {builtin_profile_names()}"
        )
    return load_profile(res.read_text(encoding="utf-8"), registry)
