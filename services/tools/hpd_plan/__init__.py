"""`hpd plan`: the offline capacity planner for heterogeneous prefill/decode fleets.

Given a traffic (a trace, or a rate and a prompt/output mix), its tiers' SLOs and a
catalogue of GPU kinds with prices and availability, it recommends the cheapest fleet:
workers per (GPU kind, worker size, role: prefill, decode or both), sized by an integer
program over request-size buckets (``milp``) on the shared performance model
(``capacity``), and verified in the simulator (``verify``) before it is kept
(``planner``). ``cli`` is the command; ``report`` its table and JSON.
"""

from .catalogue import Catalogue, CatalogueError, GpuKind, Learned, load_catalogue, parse_catalogue
from .planner import PlanInputs, PlanResult, plan

__all__ = [
    "Catalogue",
    "CatalogueError",
    "GpuKind",
    "Learned",
    "PlanInputs",
    "PlanResult",
    "load_catalogue",
    "parse_catalogue",
    "plan",
]
