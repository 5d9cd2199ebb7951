"""`hpd`: one command for the control plane and its tools.

hpd up          run the control plane on this machine (embedded Redis unless --redis-url)
hpd registry    run the registry service alone
hpd workers     list workers of a running registry (like `kubectl get`)
hpd pools       list pools of a running registry
hpd native      compile the policy core (mypyc) or say whether the compiled one is in use
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Sequence

COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("hpd_fleet.demo", "control plane + emulated heterogeneous fleet + trace replay"),
    "up": ("hpd_common.up", "run the whole control plane on this machine"),
    "registry": ("hpd_registry.__main__", "run the registry service"),
    "scheduler": ("hpd_scheduler.__main__", "run the scheduler service"),
    "kvbroker": ("hpd_kvbroker.__main__", "run the KV broker service"),
    "sim": ("hpd_scheduler.sim.cli", "simulate a cluster under scheduling policies"),
    "workers": ("hpd_common.tables", "print the workers of a running registry"),
    "pools": ("hpd_common.tables", "print the pools of a running registry"),
    "sessions": ("hpd_kvbroker.tables", "print the KV transfer sessions of a running broker"),
    "compat": ("hpd_kvbroker.tables", "print the prefill x decode KV compatibility of a model"),
    "routes": ("hpd_scheduler.tables", "print recent route records of a running scheduler"),
    "native": ("hpd_common.native", "compile the policy core with mypyc, or show its status"),
}

# Table commands receive their own name first (one module serves several tables).
TABLE_MODULES = {"hpd_common.tables", "hpd_kvbroker.tables"}


def usage() -> str:
    lines = ["usage: hpd COMMAND [options]   (hpd COMMAND --help for its options)", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += [
        "",
        "examples:",
        "  hpd demo --duration 20 --no-serve        # a 20 s replay with its report, then exit",
        "  hpd up                                  # registry on :50051, embedded Redis in ./.hpd",
        "  hpd up --redis-url redis://host:6379/0  # against your own Redis",
        "  hpd workers --registry 127.0.0.1:50051 --pool h100-prefill",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"hpd: unknown command {name!r}\n", file=sys.stderr)
        print(usage(), file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    entry: Callable[..., int] = module.main
    if module.__name__ in TABLE_MODULES:
        return entry([name, *rest])
    return entry(rest)


if __name__ == "__main__":
    raise SystemExit(main())
