"""`hpd`: one command for the control plane and its tools.

hpd up          run the control plane on this machine (embedded Redis unless --redis-url)
hpd registry    run the registry service alone
hpd workers     list workers of a running registry (like `kubectl get`)
hpd pools       list pools of a running registry
hpd watch       follow the registry's change feed, filtered by event kind
hpd agent       attach one running engine (vLLM, SGLang) to the registry
hpd gateway     the OpenAI-compatible front door that runs plans on the engines
hpd native      compile the policy core (mypyc) or say whether the compiled one is in use
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Sequence

from hpd_common.errors import HpdError, InvalidArgument

COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("hpd_fleet.demo", "control plane + emulated heterogeneous fleet + trace replay"),
    "fleet": ("hpd_fleet.serve", "an emulated fleet on vLLM's HTTP, attached to a running plane"),
    "up": ("hpd_tools.up", "run the whole control plane on this machine"),
    "registry": ("hpd_registry.__main__", "run the registry service"),
    "scheduler": ("hpd_scheduler.__main__", "run the scheduler service"),
    "kvbroker": ("hpd_kvbroker.__main__", "run the KV broker service"),
    "agent": ("hpd_agent.__main__", "attach one running engine (vLLM, SGLang) to the fleet"),
    "gateway": ("hpd_gateway.__main__", "the OpenAI-compatible front door over the engines"),
    "gateway-key": ("hpd_gateway.keytool", "make a client's API key for the gateway's keys file"),
    "sim": ("hpd_sim.cli", "simulate a cluster under scheduling policies"),
    "plan": ("hpd_plan.cli", "the cheapest fleet of GPU kinds and roles for a traffic's SLOs"),
    "workers": ("hpd_tools.tables.registry", "print the workers of a running registry"),
    "pools": ("hpd_tools.tables.registry", "print the pools of a running registry"),
    "watch": (
        "hpd_tools.tables.registry",
        "follow the registry's change feed (--kind put,delete,...)",
    ),
    "sessions": ("hpd_tools.tables.kvbroker", "print the KV transfer sessions of a running broker"),
    "compat": (
        "hpd_tools.tables.kvbroker",
        "print the prefill x decode KV compatibility of a model",
    ),
    "routes": ("hpd_tools.tables.scheduler", "print recent route records of a running scheduler"),
    "drain": ("hpd_tools.admin", "drain a worker: no new work, then it leaves (operator)"),
    "cordon": ("hpd_tools.admin", "cordon a worker: no new work, stays registered (operator)"),
    "uncordon": ("hpd_tools.admin", "clear a worker's cordon and drain (operator)"),
    "deregister": ("hpd_tools.admin", "take a worker out of the fleet now (operator)"),
    "token": ("hpd_tools.admin", "print a role's token from `hpd up --auth`"),
    "certs": ("hpd_tools.tlsgen", "make a throwaway CA, certificates and an mTLS tokens file"),
    "native": ("hpd_common.native", "compile the policy core with mypyc, or show its status"),
    "fuzz": ("hpd_fleet.fuzz", "mutation-fuzz every RPC of a running control plane"),
}

# Table commands receive their own name first (one module serves several tables).
TABLE_MODULES = {"hpd_tools.tables.registry", "hpd_tools.tables.kvbroker", "hpd_tools.admin"}


def usage() -> str:
    lines = ["usage: hpd COMMAND [options]   (hpd COMMAND --help for its options)", "", "commands:"]
    lines += [f"  {name:<11} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += [
        "",
        "examples:",
        "  hpd demo --duration 20 --no-serve        # a 20 s replay with its report, then exit",
        "  hpd up                                  # registry on :50051, embedded Redis in ./.hpd",
        "  hpd up --redis-url redis://host:6379/0  # against your own Redis",
        "  hpd workers --registry 127.0.0.1:50051 --pool h100-prefill-a",
        "  hpd watch --kind put,delete               # the demo's fleet changing, without loads",
        "  hpd up --auth && export HPD_TOKEN=$(hpd token operator)  # callers need tokens",
        "  hpd drain d0 --reason 'kernel upgrade'   # the agent deregisters it once idle",
        "  hpd agent --engine-url http://127.0.0.1:8000 --model-dir ./model --gpu-type L40S",
        "",
        "hpd --version prints the version and whether the compiled policy core is in use.",
    ]
    return "\n".join(lines)


def version() -> str:
    """The installed distribution's version (its metadata), or the source tree's when run
    from a checkout that was never installed."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("hetero-pd")
    except PackageNotFoundError:
        return "0+unknown"


def _core() -> str:
    """Whether the compiled policy core is in use (`hpd native status` says more)."""
    from hpd_common import native

    st = native.status()
    return "compiled" if st.active else f"pure Python, {st.reason}"


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    if args[0] in ("--version", "-V", "version"):
        print(f"hpd {version()} (hetero-pd; policy core: {_core()})")
        return 0
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"hpd: unknown command {name!r}\n", file=sys.stderr)
        print(usage(), file=sys.stderr)
        return 2
    # gRPC core's own log lines (absl's "before InitializeLog", "Got goaway") are noise for
    # an operator; errors still come through. Set GRPC_VERBOSITY yourself to see more.
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    module = importlib.import_module(COMMANDS[name][0])
    entry: Callable[..., int] = module.main
    try:
        if module.__name__ in TABLE_MODULES:
            return entry([name, *rest])
        return entry(rest)
    except InvalidArgument as exc:  # a bad flag or environment setting, named
        print(f"hpd {name}: {exc.field}: {exc.message}", file=sys.stderr)
        return 2
    except HpdError as exc:  # e.g. a state directory another `hpd up` owns
        print(f"hpd {name}: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        # `hpd workers -o json | head -1`: the reader left; that is not an error. Point
        # stdout at /dev/null so the interpreter's final flush does not raise again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
