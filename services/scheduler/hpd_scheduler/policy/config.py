"""Scheduler profiles: named compositions of plugins, loaded from YAML and validated up front.

A profile document::

    profile: default
    plugins:                      # instances: a unique name, a registered type, params
      - {name: gate, type: execution-gate-filter}
      - {name: compute, type: capacity-compute-scorer}
      - {name: best, type: max-score-picker}
    preselect: {key: capacity, top_k_prefill: 6, top_k_decode: 6, max_scan: 256}
    pairing: joint                # joint | independent | colocated
    picker: best                  # a picker instance
    classification: {long_prompt_tokens: 2048, long_decode_tokens: 256}
    side_weights: {prefill: [0.65, 0.35], decode: [0.35, 0.65], shared: [0.5, 0.5]}
    prefill: {filters: [gate], scorers: [{plugin: compute, weight: 0.30}]}
    decode:  {filters: [gate], scorers: [...]}
    ladder: [{action: throttle_admission, above: 0.80}, ...]
    tiers: {default: standard, classes: {standard: {ttft_ms: 3000, tpot_ms: 100, ...}}}

Any error raises :class:`ConfigError` with the dotted key path of the offending key: unknown
plugin type, duplicate instance name, a reference to an instance that does not exist or is of
the wrong kind, a weight <= 0, a missing picker, unknown keys, ill-typed values.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from hpd_common.yamlsafe import YamlLimitError, load_bounded

from .domain import ResourceNeed, Role, Tier
from .errors import ConfigError, InvalidInputError
from .framework import Filter, Picker, Plugin, PluginRegistry, Scorer
from .plugins import REGISTRY
from .serving import DEFAULT_LADDER, Action, LadderStep, Protects

__all__ = [
    "DEFAULT_TIERS",
    "PRESELECT_MODES",
    "Profile",
    "SideSpec",
    "SloObjective",
    "builtin_profile",
    "builtin_profile_names",
    "load_profile",
    "parse_profile",
]

PRESELECT_MODES = ("capacity", "blind", "rotation", "random", "all")
PAIRINGS = ("joint", "independent", "colocated")

DEFAULT_TIERS: dict[str, Tier] = {
    "interactive": Tier(
        "interactive",
        ttft_ms=1000.0,
        tpot_ms=50.0,
        queue_budget_ms=300.0,
        priority=2,
        hard_ttft_ms=10_000.0,
    ),
    "standard": Tier("standard", ttft_ms=3000.0, tpot_ms=100.0, queue_budget_ms=1000.0, priority=1),
    "batch": Tier(
        "batch",
        ttft_ms=30_000.0,
        tpot_ms=200.0,
        queue_budget_ms=20_000.0,
        priority=0,
        may_throttle=True,
        may_shed=True,
    ),
}

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
}


@dataclass(frozen=True, slots=True)
class SideSpec:
    """Filters and weighted scorers of one role."""

    filters: tuple[Filter, ...]
    scorers: tuple[tuple[Scorer, float], ...]

    @property
    def total_weight(self) -> float:
        """Sum of the scorer weights (totals are divided by it, so they stay in [0, 1])."""
        return sum(w for _, w in self.scorers) or 1.0

    def weights(self) -> dict[str, float]:
        """Weight per scorer instance name."""
        return {s.name: w for s, w in self.scorers}


@dataclass(frozen=True, slots=True)
class SloObjective:
    """Rank pairs by the SLOs they are predicted to keep before the weighted score.

    With it, every joint option's TTFT estimate is the whole path (prefill queue wait in ms
    of that worker's own work + prefill + hand-off + the decode worker's admission wait,
    ``WorkerState.admission_wait_ms``) and its TPOT estimate is the decode worker's
    predicted step with the request admitted (``Candidate.step_ms``). An option *keeps*
    the TTFT target when ``ttft_est <= ttft_fraction x tier.ttft_ms`` and the TPOT target
    when ``tpot_est <= tpot_fraction x tier.tpot_ms``; its final score is
    ``(q + targets kept) / 3`` with ``q`` in [0, 1] (below), so an option predicted to keep
    both SLOs always beats one predicted to miss one, whatever their factor scores (the
    factors only order options of equal standing). Fractions below 1 keep a margin for what
    the estimates cannot see (arrivals bursting behind the request, sequences joining the
    batch later).
    ``slack_weight`` ``s`` blends the TTFT slack into the order within a standing:
    ``q = (1 - s) x weighted score + s x T / (T + ttft_est)``, ``T`` the tier's
    TTFT target, so of two options that both keep their SLOs the one leaving more headroom
    for the next burst is preferred (0: the weighted factors alone).
    ``conditional``: every decode worker also offers its own prefill (RECOMPUTE, or SAME_POOL
    on a worker serving both stages), not only where the seed rule would recompute, and the
    estimates above choose between it and a transfer; such an option's TPOT estimate adds
    the stall its prefill puts on a non-empty running batch, ``(queued local prefill +
    this prefill) / expected output tokens``; a transfer whose prefill worker also decodes
    (it serves both stages) is judged by the same stall on that worker's running batch.
    ``admit_ttft_factor`` ``a`` (0: off): refuse a request (SATURATED,
    ``ttft_over_admission_limit``) when no option has ``ttft_est <= a x tier.ttft_ms``, except
    an option whose own work (prefill, hand-off) is at least half its estimate, i.e. a prompt
    too long for the target that waits no longer than it works.
    Absent (the seed and the baselines): options are ranked by the weighted score alone."""

    ttft_fraction: float = 1.0
    tpot_fraction: float = 1.0
    slack_weight: float = 0.0
    conditional: bool = False
    admit_ttft_factor: float = 0.0


@dataclass(frozen=True)
class Profile:
    """A validated, ready-to-run scheduler profile."""

    name: str
    prefill: SideSpec
    decode: SideSpec
    picker: Picker[Any]
    preselect: str = "capacity"
    top_k_prefill: int = 6
    top_k_decode: int = 6
    max_scan: int = 256
    pairing: str = "joint"
    long_prompt_tokens: int = 2048
    long_decode_tokens: int = 256
    side_weights: Mapping[ResourceNeed, tuple[float, float]] = field(
        default_factory=lambda: {
            ResourceNeed.PREFILL: (0.65, 0.35),
            ResourceNeed.DECODE: (0.35, 0.65),
            ResourceNeed.SHARED: (0.5, 0.5),
        }
    )
    ladder: tuple[LadderStep, ...] = DEFAULT_LADDER
    tiers: Mapping[str, Tier] = field(default_factory=lambda: dict(DEFAULT_TIERS))
    default_tier: str = "standard"
    chain_length: int = 3
    slo_objective: SloObjective | None = None

    def tier(self, name: str) -> Tier:
        """The tier called ``name`` ('' = the default tier); InvalidInputError if unknown."""
        tier = self.tiers.get(name or self.default_tier)
        if tier is None:
            raise InvalidInputError("tier", f"unknown tier {name!r}; known: {sorted(self.tiers)}")
        return tier

    def lowest_sheddable_tier(self) -> str | None:
        """Name of the lowest-priority tier that may be shed (None if none may)."""
        sheddable = [t for t in self.tiers.values() if t.may_shed]
        if not sheddable:
            return None
        return min(sheddable, key=lambda t: (t.priority, t.name)).name


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
    """Validate a parsed YAML document into a :class:`Profile` (see the module docstring)."""
    p = (root + ".") if root else ""
    data = _map(doc, root or "profile")
    for key in data:
        _req(key in _TOP_KEYS, f"{p}{key}", f"unknown key; expected one of {sorted(_TOP_KEYS)}")
    name = data.get("profile")
    _req(isinstance(name, str) and bool(name), f"{p}profile", "a profile needs a name")

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

    def ref(value: Any, path: str, kind: type[Plugin]) -> Plugin:
        _req(isinstance(value, str), path, "must name a plugin instance")
        inst = instances.get(value)
        _req(inst is not None, path, f"no plugin instance named {value!r}")
        assert inst is not None
        _req(isinstance(inst, kind), path, f"{value!r} is a {inst.kind}, not a {kind.kind}")
        return inst

    def side(key: str, role: Role) -> SideSpec:
        path = f"{p}{key}"
        raw = _map(data.get(key, {}), path)
        for k in raw:
            _req(k in {"filters", "scorers"}, f"{path}.{k}", "unknown key")
        filters: list[Filter] = []
        for i, fname in enumerate(raw.get("filters", []) or []):
            f = ref(fname, f"{path}.filters[{i}]", Filter)
            assert isinstance(f, Filter)
            filters.append(f)
        scorers: list[tuple[Scorer, float]] = []
        seen: set[str] = set()
        for i, spec in enumerate(raw.get("scorers", []) or []):
            spath = f"{path}.scorers[{i}]"
            spec = _map(spec, spath)
            for k in spec:
                _req(k in {"plugin", "weight"}, f"{spath}.{k}", "unknown key")
            s = ref(spec.get("plugin"), f"{spath}.plugin", Scorer)
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

    prefill = side("prefill", Role.PREFILL)
    decode = side("decode", Role.DECODE)
    _req("picker" in data, f"{p}picker", "a profile needs a picker")
    picker = ref(data["picker"], f"{p}picker", Picker)
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

    ladder = DEFAULT_LADDER
    if "ladder" in data:
        raw_ladder = data["ladder"]
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
        ladder = tuple(steps)

    tiers = dict(DEFAULT_TIERS)
    default_tier = "standard"
    if "tiers" in data:
        traw = _map(data["tiers"], f"{p}tiers")
        classes = _map(traw.get("classes", {}), f"{p}tiers.classes")
        if classes:
            tiers = {}
        for tname, spec in classes.items():
            path = f"{p}tiers.classes.{tname}"
            spec = _map(spec, path)
            allowed = {
                "ttft_ms",
                "tpot_ms",
                "queue_budget_ms",
                "priority",
                "may_throttle",
                "may_shed",
                "hard_ttft_ms",
            }
            for k in spec:
                _req(k in allowed, f"{path}.{k}", "unknown key")
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

    slo_objective: SloObjective | None = None
    if data.get("slo_objective") is not None:
        sraw = _map(data["slo_objective"], f"{p}slo_objective")
        fractions: dict[str, Any] = {}
        for k, v in sraw.items():
            path = f"{p}slo_objective.{k}"
            _req(
                k
                in {
                    "ttft_fraction",
                    "tpot_fraction",
                    "slack_weight",
                    "conditional",
                    "admit_ttft_factor",
                },
                path,
                "unknown key",
            )
            if k == "conditional":
                _req(isinstance(v, bool), path, "must be true or false")
                fractions[k] = v
                continue
            f = _num(v, path)
            if k == "slack_weight":
                _req(0 <= f <= 1, path, "must be in [0, 1]")
            elif k == "admit_ttft_factor":
                _req(f == 0 or f >= 1, path, "must be 0 (off) or >= 1")
            else:
                _req(0 < f <= 4, path, "must be in (0, 4]")
            fractions[str(k)] = f
        slo_objective = SloObjective(**fractions)

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
    )


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
