"""The scheduling policy core: pure, synchronous, no I/O; time and randomness injected.

Typical use (the scheduler service and the simulator call exactly this)::

    profile = builtin_profile("default")            # or load_profile(path)
    planner = Planner(profile)
    fleet = Fleet.build(worker_views, now_s, links=LinkModel(...))   # once per fleet change
    decision = planner.plan(request, fleet, now_s, rng)
    apply_reservations(fleet, decision)             # until the outcome comes back
    record = decision.to_dict()                     # JSON-ready route record
"""

from hpd_common import native as _native

# the compiled modules of this package, when built and current (hpd_common.native)
__path__ = _native.search_path(__name__, __path__)

from .balance import (
    BatchChange,
    BatchRecommendation,
    Move,
    RebalancePlan,
    adapt_batch_size,
    detect_imbalance,
    rebalance_plan,
)
from .capacity import StalenessPolicy, confidence
from .config import Profile, SideSpec, SloObjective
from .decision import Decision, DecisionRecord, Estimates, FallbackStep, RejectClass, RoutePlan
from .domain import (
    SCHEDULABLE_HEALTH,
    DecisionKind,
    Health,
    LearnedSpeed,
    LearnedStep,
    LoadReport,
    Mode,
    NetworkLocation,
    Request,
    ResourceNeed,
    Role,
    Stage,
    Tier,
    WorkerSpec,
    WorkerView,
    declared_stages,
)
from .errors import ConfigError, InvalidInputError, PolicyError, UnknownPluginError
from .fleet import Fleet, WorkerState
from .framework import Candidate, Filter, FilterResult, Option, Picker, PluginRegistry, Scorer
from .links import Link, LinkModel, Locality
from .mechanisms import classify_need
from .planner import Planner, apply_reservations, release_reservations
from .plugins import REGISTRY
from .profile_loader import builtin_profile, builtin_profile_names, load_profile, parse_profile
from .serving import DEFAULT_LADDER, Action, LadderStep, Protects, ServingAction, select_action
from .worker_state import PromptMix

__all__ = [
    "DEFAULT_LADDER",
    "REGISTRY",
    "SCHEDULABLE_HEALTH",
    "Action",
    "BatchChange",
    "BatchRecommendation",
    "Candidate",
    "ConfigError",
    "Decision",
    "DecisionKind",
    "DecisionRecord",
    "Estimates",
    "FallbackStep",
    "Filter",
    "FilterResult",
    "Fleet",
    "Health",
    "InvalidInputError",
    "LadderStep",
    "LearnedSpeed",
    "LearnedStep",
    "Link",
    "LinkModel",
    "LoadReport",
    "Locality",
    "Mode",
    "Move",
    "NetworkLocation",
    "Option",
    "Picker",
    "Planner",
    "PluginRegistry",
    "PolicyError",
    "Profile",
    "PromptMix",
    "Protects",
    "RebalancePlan",
    "RejectClass",
    "Request",
    "ResourceNeed",
    "Role",
    "RoutePlan",
    "Scorer",
    "ServingAction",
    "SideSpec",
    "SloObjective",
    "Stage",
    "StalenessPolicy",
    "Tier",
    "UnknownPluginError",
    "WorkerSpec",
    "WorkerState",
    "WorkerView",
    "adapt_batch_size",
    "apply_reservations",
    "builtin_profile",
    "builtin_profile_names",
    "classify_need",
    "confidence",
    "declared_stages",
    "detect_imbalance",
    "load_profile",
    "parse_profile",
    "rebalance_plan",
    "release_reservations",
    "select_action",
]
