"""The scheduling framework: filters, scorers and pickers, and the registry of their types.

Modelled on the Kubernetes scheduler framework and the inference gateway's endpoint picker:

* a :class:`Filter` keeps some workers and gives a reason for each one it drops;
* a :class:`Scorer` maps a worker (or a worker and its partner) to a value in [0, 1]; it knows
  no weight, the profile does;
* an :class:`OptionFilter` keeps the paired options within a limit (the tier's hard TTFT,
  admission past capacity); when it keeps none the request is refused with its reason;
* a :class:`Picker` returns its input ranked; the head is the plan, the tail the fallbacks.

Each plugin type has a kebab-case type name, a frozen ``Params`` dataclass of validated
parameters with defaults, and a docstring with its formula. Profiles (``config.py``) name
instances of these types and weight the scorers.

A plugin of one's own subclasses these and is registered in a ``PluginRegistry`` passed to
the profile loader. With the compiled core in use (``hpd_common.native``) a compiled base
class takes no interpreted subclass's instance: run such a plugin on the pure-Python core
(``HPD_NATIVE=0``) or add its module to ``native.MODULES`` so it is compiled with the core.
"""

from __future__ import annotations

import dataclasses
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, Protocol, TypeVar

from .domain import Mode, Request, ResourceNeed, Role, Tier
from .errors import ConfigError, UnknownPluginError
from .fleet import Fleet, ModelIndex, WorkerState
from .prefix import cached_tokens

__all__ = [
    "KEBAB",
    "Candidate",
    "Filter",
    "FilterResult",
    "NoParams",
    "Option",
    "OptionFilter",
    "Picker",
    "Plugin",
    "PluginRegistry",
    "RequestContext",
    "Scorer",
]

KEBAB = re.compile(r"^[a-z][a-z0-9]*(-[a-z0-9]+)*$")


class RequestContext:
    """Everything a plugin may read about the request being placed (built once per plan)."""

    __slots__ = (
        "decode_index",
        "fleet",
        "matched",
        "need",
        "now_s",
        "prefill_index",
        "request",
        "tier",
    )

    def __init__(
        self,
        request: Request,
        tier: Tier,
        need: ResourceNeed,
        now_s: float,
        fleet: Fleet,
        prefill_index: ModelIndex | None,
        decode_index: ModelIndex | None,
    ) -> None:
        self.request = request
        self.tier = tier
        self.need = need
        self.now_s = now_s
        self.fleet = fleet
        self.prefill_index = prefill_index
        self.decode_index = decode_index
        # worker idx -> blocks of the request's prefix it holds (>= 1 only), once per plan
        self.matched: dict[int, int] | None = None


_DECODE = Role.DECODE
_NO_FACTORS: dict[str, float] = {}


class Candidate:
    """A worker considered for one role of one request, with request-specific estimates.

    ``wait_ms``: queued prefill work ahead of this request (prefill role or a local option);
    ``cached_tokens``: the prompt's prefix this worker's engine holds (``policy.prefix``);
    ``run_ms``: this worker's prefill time for the rest of the prompt, ``f(P) - f(C)`` with
    ``f(n) = lin x n + quad x n^2`` (the new tokens' own cost plus their attention to the
    cached ones; the perf model's prefill FLOPs); ``step_ms``: predicted decode
    step with this request added; ``kv_need``: KV bytes of prompt + output in this worker's
    format. ``factors`` holds the per-scorer values, ``score`` the weighted total of the
    pair-independent scorers (normalised by their weights).
    """

    __slots__ = (
        "cached_tokens",
        "factors",
        "kv_need",
        "role",
        "run_ms",
        "score",
        "step_ms",
        "wait_ms",
        "ws",
    )

    def __init__(
        self,
        ws: WorkerState,
        role: Role,
        request: Request,
        ref_tokens: int,
        matched: int = -1,
    ) -> None:
        # The estimates are WorkerState.prefill_wait_ms(), .prefill_ms(prompt) and
        # .step_ms(extra) written out: a decision builds ~15 candidates and the method calls
        # were a third of their cost (a unit test holds the two forms equal).
        self.ws = ws
        self.role = role
        cap = ws.cap
        m_p = ws.m_p
        prompt = request.prompt_tokens
        n = float(prompt)
        held = ws.held
        cached = 0
        blocks = request.prefix_blocks
        if matched >= 0:  # known for this plan (planner.prefix_matches)
            if matched and prompt > 1:
                cached = min(matched * request.prefix_block_tokens, prompt - 1)
        elif (
            held is not None
            and blocks
            and blocks[0] in held  # most workers fail here: no call, no match loop
            and ws.held_block_tokens == request.prefix_block_tokens
        ):
            cached = cached_tokens(blocks, held, request.prefix_block_tokens, prompt)
        self.cached_tokens = cached
        if cached:
            k = float(cached)
            run = cap.lin_ms * (n - k) + cap.quad_ms * (n * n - k * k)
        else:
            run = cap.lin_ms * n + cap.quad_ms * n * n
        self.run_ms = (run if run > cap.floor_ms else cap.floor_ms) * m_p + ws.p_fixed
        q = ws.backlog_tokens + ws.live_tokens
        self.wait_ms = q / cap.prefill_tps * 1000.0 * m_p + q * ws.fixed_per_token
        self.kv_need = (prompt + request.expected_output_tokens) * cap.kv_bytes_per_token
        if role is _DECODE:
            # queued sequences get admitted too; this one holds its prompt plus, on average,
            # half its output
            extra = (
                (ws.queue + ws.live_reqs) * ref_tokens
                + prompt
                + request.expected_output_tokens * 0.5
            )
            self.step_ms = (
                cap.weights_ms + (ws.ctx_tokens + extra) * cap.kv_ms_per_token
            ) * ws.m_d + ws.d_seq * ws.step_sequences()
        else:
            self.step_ms = 0.0
        self.factors: dict[str, float] = {}
        self.score = 0.0

    @property
    def tiebreak(self) -> tuple[int, int]:
        """Deterministic tie-break: the worker's position in the snapshot."""
        return (self.ws.idx, 0)


class Option:
    """A complete alternative: prefill candidate, decode candidate, hand-off mode, estimates.

    For RECOMPUTE and SAME_POOL the prefill candidate is the decode worker itself.
    ``ttft_ms`` = prefill wait + prefill time (+ transfer and conversion for TRANSFER).
    ``tpot_ms``: the TPOT estimate the SLO objective judges the option by (0 without one):
    the decode worker's, or, when the option's prefill stalls a running batch and that is
    worse, the batch's.
    """

    __slots__ = (
        "admit_extra_ms",
        "conversion_ms",
        "d",
        "factors",
        "kv_reasons",
        "mode",
        "p",
        "recompute_ms",
        "score",
        "tpot_ms",
        "transfer_ms",
        "ttft_ms",
    )

    def __init__(
        self,
        p: Candidate,
        d: Candidate,
        mode: Mode,
        transfer_ms: float,
        recompute_ms: float,
        conversion_ms: float,
        ttft_ms: float,
        kv_reasons: tuple[str, ...] = (),
    ) -> None:
        self.p = p
        self.d = d
        self.mode = mode
        self.transfer_ms = transfer_ms
        self.recompute_ms = recompute_ms
        self.conversion_ms = conversion_ms
        self.ttft_ms = ttft_ms
        # the SLO objective's TPOT estimate (pairing._apply_slo); 0 when not estimated
        self.tpot_ms = 0.0
        # what admission past capacity adds to ttft_ms for a request that would hold its
        # decode slot longer than the traffic's mean (pairing._apply_slo); 0 otherwise
        self.admit_extra_ms = 0.0
        self.kv_reasons = kv_reasons
        # joint options keep their factors on their candidates; only the independent pairing
        # gives an option its own dict (by assignment): share one empty dict until then
        self.factors: dict[str, float] = _NO_FACTORS
        self.score = 0.0

    @property
    def tiebreak(self) -> tuple[int, int]:
        """Deterministic tie-break: prefill then decode worker position in the snapshot."""
        return (self.p.ws.idx, self.d.ws.idx)


@dataclass(frozen=True, slots=True)
class NoParams:
    """Parameters of a plugin that takes none."""


class Plugin:
    """Base of every plugin: a type name (class attribute), an instance name, parameters."""

    type_name: ClassVar[str] = ""
    kind: ClassVar[str] = ""
    Params: ClassVar[type[Any]] = NoParams

    def __init__(self, name: str, params: Any = None) -> None:
        self.name = name
        self.params = params if params is not None else self.Params()


@dataclass(frozen=True, slots=True)
class FilterResult:
    """Workers kept (a subset of the input, order preserved) and a reason per dropped id."""

    kept: list[WorkerState]
    dropped: dict[str, str]


def split_workers(
    workers: Sequence[WorkerState], reason: Callable[[WorkerState], str | None]
) -> FilterResult:
    """The workers ``reason`` keeps (None), in order, and the reason for each it drops."""
    kept: list[WorkerState] = []
    dropped: dict[str, str] = {}
    for ws in workers:
        why = reason(ws)
        if why is None:
            kept.append(ws)
        else:
            dropped[ws.worker_id] = why
    return FilterResult(kept, dropped)


class Filter(Plugin):
    """Drops workers that cannot take the request; says why for each."""

    kind: ClassVar[str] = "filter"
    roles: ClassVar[frozenset[Role]] = frozenset({Role.PREFILL, Role.DECODE})

    def drop_reason(self, ws: WorkerState, role: Role, ctx: RequestContext) -> str | None:
        """A reason code to drop ``ws`` for ``role``, or None to keep it."""
        raise NotImplementedError

    def filter(
        self, workers: Sequence[WorkerState], role: Role, ctx: RequestContext
    ) -> FilterResult:
        """Apply :meth:`drop_reason` to each worker; never adds a worker."""
        return split_workers(workers, lambda ws: self.drop_reason(ws, role, ctx))


class OptionFilter(Plugin):
    """After pairing: the options within this filter's limit for the request.

    ``bound(ctx)`` is the limit for this request (None: the filter does not apply to it);
    ``keep(options, ctx, bound)`` the options it keeps (all at once, so a filter may judge
    an option against the others). When it keeps none the planner refuses the request
    (SATURATED) with ``reject_reason``, notes ``all_options_exceed_<note>:<bound>`` in the
    record, and suggests ``retry_ms(options, bound, default_ms)`` (by default the tier's
    queue budget, ``default_ms``)."""

    kind: ClassVar[str] = "filter of options"
    note: ClassVar[str] = ""
    reject_reason: ClassVar[str] = ""

    def bound(self, ctx: RequestContext) -> float | None:
        raise NotImplementedError

    def keep(self, options: list[Option], ctx: RequestContext, bound: float) -> list[Option]:
        raise NotImplementedError

    def retry_ms(self, options: list[Option], bound: float, default_ms: float) -> float:
        return default_ms


class Scorer(Plugin):
    """Maps a candidate to [0, 1]. Pairwise scorers also see the partner and the transfer
    estimate (None when the partner is not known yet)."""

    kind: ClassVar[str] = "scorer"
    roles: ClassVar[frozenset[Role]] = frozenset({Role.PREFILL, Role.DECODE})
    pairwise: ClassVar[bool] = False

    def score(self, c: Candidate, ctx: RequestContext) -> float:
        """Pair-independent value in [0, 1]."""
        raise NotImplementedError

    def score_pair(self, c: Candidate, transfer_ms: float | None, ctx: RequestContext) -> float:
        """Pair-dependent value in [0, 1] (pairwise scorers only)."""
        raise NotImplementedError


class _Scored(Protocol):
    score: float

    @property
    def tiebreak(self) -> tuple[int, int]: ...


T = TypeVar("T", bound=_Scored)


class Picker(Plugin, Generic[T]):
    """Ranks scored items; returns a permutation of (a subset of) its input."""

    kind: ClassVar[str] = "picker"

    def rank(self, items: Sequence[T], rng: random.Random) -> list[T]:
        """Best first."""
        raise NotImplementedError


PluginFactory = Callable[[str, Any], Plugin]


class PluginRegistry:
    """Plugin types by kebab-case type name; refuses duplicates and malformed names."""

    def __init__(self) -> None:
        self._types: dict[str, type[Plugin]] = {}

    def register(self, cls: type[Plugin]) -> type[Plugin]:
        """Add a plugin class (usable as a decorator)."""
        name = cls.type_name
        if not KEBAB.match(name):
            raise ConfigError(f"plugin_types.{name or '?'}", "type name must be kebab-case")
        if name in self._types:
            raise ConfigError(f"plugin_types.{name}", "duplicate plugin type name")
        self._types[name] = cls
        return cls

    def get(self, type_name: str, key_path: str) -> type[Plugin]:
        """The class for ``type_name``; :class:`UnknownPluginError` naming ``key_path``."""
        cls = self._types.get(type_name)
        if cls is None:
            raise UnknownPluginError(
                key_path, f"unknown plugin type {type_name!r}; known: {sorted(self._types)}"
            )
        return cls

    def names(self) -> list[str]:
        """Registered type names, sorted."""
        return sorted(self._types)

    def create(self, type_name: str, name: str, params: dict[str, Any], key_path: str) -> Plugin:
        """Instantiate with validated params (unknown or ill-typed params name their key)."""
        cls = self.get(type_name, f"{key_path}.type")
        return cls(name, build_params(cls.Params, params, f"{key_path}.params"))


def build_params(params_cls: type[Any], raw: dict[str, Any], key_path: str) -> Any:
    """Build a ``Params`` dataclass from a mapping, checking names and types; the dataclass's
    own ``__post_init__`` checks ranges (a ``ValueError`` there names the field)."""
    if not isinstance(raw, dict):
        raise ConfigError(key_path, "params must be a mapping")
    fields = {f.name: f for f in dataclasses.fields(params_cls)}
    values: dict[str, Any] = {}
    for key, value in raw.items():
        f = fields.get(key)
        if f is None:
            raise ConfigError(f"{key_path}.{key}", f"unknown parameter; known: {sorted(fields)}")
        default = f.default if f.default is not dataclasses.MISSING else None
        values[key] = _coerce(value, default, f"{key_path}.{key}")
    try:
        return params_cls(**values)
    except ValueError as exc:
        field = getattr(exc, "field", None) or (str(exc).split(":")[0] if ":" in str(exc) else "")
        raise ConfigError(
            f"{key_path}.{field}" if field in fields else key_path, str(exc)
        ) from None


def _coerce(value: Any, default: Any, key_path: str) -> Any:
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ConfigError(key_path, f"must be a boolean, got {value!r}")
        return value
    if isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(key_path, f"must be an integer, got {value!r}")
        return value
    if isinstance(default, float):
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(key_path, f"must be a number, got {value!r}")
        return float(value)
    if isinstance(default, str):
        if not isinstance(value, str):
            raise ConfigError(key_path, f"must be a string, got {value!r}")
        return value
    return value
