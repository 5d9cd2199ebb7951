"""Compiled hot paths: modules built with mypyc, used only while they match their source.

The policy core is plain, strictly typed Python. `hpd native build` compiles the modules in
`MODULES` with mypyc (the compiler that ships with mypy: C extensions generated from the
type annotations; a decision takes about a third of the time) into `_native/<ABI>/` inside
this package. A package whose modules are in `MODULES` puts that directory first on its
`__path__` (`search_path`, at the top of its ``__init__.py``), so its submodules import
from the compiled build, but only when the whole build is *current*:

- a stamp written last by the build names every compiled module with the SHA-256 of the
  source it was compiled from, and each must equal the source on disk now (edit a file and
  that process imports the pure modules until the next build; the modules of one build call
  each other natively, so it is all of them or none);
- the build is for this interpreter (its extension suffix);
- ``HPD_NATIVE`` is not ``0`` (``HPD_NATIVE=0`` forces the pure modules: profilers,
  debuggers, comparisons).

Anything else imports the pure-Python modules, which stay the reference: both behave the
same (tests/unit/common/test_native.py compares their decisions), and every service runs either
way. `status()` says which is active and why; the scheduler logs it at start and the
benchmarks report it.

Building needs mypy (a dev dependency), setuptools and a C compiler; `scripts/bootstrap.sh`
runs ``build --if-stale`` and carries on with the pure modules if it cannot.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.machinery
import importlib.util
import json
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ENV = "HPD_NATIVE"
GROUP = "hpd_native"
"""Name of the build's shared library (``hpd_native__mypyc``)."""

MODULES: tuple[str, ...] = (
    "hpd_scheduler.policy.capacity",
    "hpd_scheduler.policy.decision",
    "hpd_scheduler.policy.domain",
    "hpd_scheduler.policy.factors",
    "hpd_scheduler.policy.filters",
    "hpd_scheduler.policy.fleet",
    "hpd_scheduler.policy.framework",
    "hpd_scheduler.policy.links",
    "hpd_scheduler.policy.mechanisms",
    "hpd_scheduler.policy.pairing",
    "hpd_scheduler.policy.admission",
    "hpd_scheduler.policy.planner",
    "hpd_scheduler.policy.plugins",
    "hpd_scheduler.policy.prefix",
    "hpd_scheduler.policy.preselect",
    "hpd_scheduler.policy.results",
    "hpd_scheduler.policy.serving",
    "hpd_scheduler.policy.worker_state",
)
"""What is compiled: the policy core's decision path, where the time goes (the policy
package's config parsing, balance planning and synthetic fleets stay interpreted). A
module listed here must compile under mypyc (no decorated classes, no class attribute read
as an instance attribute, no subclass of an interpreted class) and its package's
``__init__.py`` must call `search_path`. Compiled classes check their attributes' types
when constructed, so a module whose objects are built from unvalidated input stays
interpreted: `hpd_common.kvformat`, for one (a format with an unknown dtype must reach
`validate` and be refused by name, not fail in a constructor).

Measured and left out: the scheduler's record and store modules and the KV broker's
domain and store modules compiled as well showed no gain beyond run-to-run noise in
bench/schedule_rpc.py and bench/kv_sessions.py (their time is in gRPC, redis-py and Redis)."""

STAMP = "stamp.json"


def ext_suffix() -> str:
    return str(sysconfig.get_config_var("EXT_SUFFIX") or ".so")


def default_root() -> Path:
    """Where this interpreter's build lives: one directory per extension ABI."""
    tag = ext_suffix().strip(".").removesuffix(".so").replace(".", "-") or "default"
    return Path(__file__).resolve().parent / "_native" / tag


def package_dir(top: str) -> Path:
    """A top-level package's directory, found without importing it."""
    spec = importlib.util.find_spec(top)
    if spec is None or spec.origin is None:
        raise LookupError(f"package {top!r} not found")
    return Path(spec.origin).resolve().parent


def source_of(module: str) -> Path:
    """A module's source file (``a.b.c`` -> ``<a>/b/c.py``), found without importing it."""
    top, *rest = module.split(".")
    if not rest:
        raise LookupError(f"{module!r} is a top-level package, not a module in one")
    return package_dir(top).joinpath(*rest).with_suffix(".py")


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@dataclass(frozen=True)
class Status:
    active: bool
    reason: str
    root: str
    modules: tuple[str, ...]


def check(root: Path, modules: Sequence[str] = MODULES, honour_env: bool = True) -> Status:
    """Whether the build in ``root`` is current for ``modules`` (module docstring) and, with
    ``honour_env``, not switched off by ``HPD_NATIVE=0``."""
    names = tuple(modules)
    if honour_env and os.environ.get(ENV, "").strip().lower() in ("0", "off", "false", "no"):
        return Status(False, f"{ENV}=0: pure-Python modules forced", str(root), names)
    try:
        stamp = json.loads((root / STAMP).read_text())
    except FileNotFoundError:
        return Status(False, "not built (hpd native build)", str(root), names)
    except (OSError, ValueError) as exc:
        return Status(False, f"unreadable stamp: {exc}", str(root), names)
    if not isinstance(stamp, dict) or stamp.get("ext_suffix") != ext_suffix():
        return Status(False, "built for another interpreter", str(root), names)
    built = stamp.get("sources")
    if not isinstance(built, dict) or sorted(built) != sorted(names):
        return Status(False, "built from another module list", str(root), names)
    for name in names:
        try:
            now = digest(source_of(name))
        except (OSError, LookupError) as exc:
            return Status(False, f"{name}: source unreadable ({exc})", str(root), names)
        if built[name] != now:
            return Status(False, f"{name} changed since the build", str(root), names)
    return Status(True, "current", str(root), names)


_active: Status | None = None


def status() -> Status:
    """This process's verdict, decided once (at the first compiled package's import)."""
    global _active
    if _active is None:
        st = check(default_root())
        if st.active:
            try:
                _load_shared_library(Path(st.root))
            except (ImportError, OSError) as exc:
                st = Status(False, f"unloadable build: {exc}", st.root, st.modules)
        _active = st
    return _active


def _load_shared_library(root: Path) -> None:
    """The build's modules import their shared library by its top-level name: load it from
    the build directory into `sys.modules` (the directory itself never goes on `sys.path`,
    where its package folders would shadow the real packages as namespace packages)."""
    name = f"{GROUP}__mypyc"
    if name in sys.modules:
        return
    loader = importlib.machinery.ExtensionFileLoader(name, str(root / (name + ext_suffix())))
    spec = importlib.util.spec_from_loader(name, loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    sys.modules[name] = module


def search_path(package: str, path: Sequence[str]) -> list[str]:
    """``path`` (a package's ``__path__``) with the package's compiled directory first when
    the build is current; ``path`` unchanged otherwise."""
    st = status()
    if st.active:
        compiled = Path(st.root).joinpath(*package.split("."))
        if compiled.is_dir():
            return [str(compiled), *path]
    return list(path)


# -- building -------------------------------------------------------------------------------


def needs_build(root: Path) -> Status:
    """`check` (whatever ``HPD_NATIVE`` says: it chooses what runs, not what is built), plus
    a rebuild when the installed mypyc differs from the one that built."""
    st = check(root, honour_env=False)
    if not st.active:
        return st
    try:
        stamp = json.loads((root / STAMP).read_text())
        from mypy.version import __version__ as mypy_version
    except (OSError, ValueError, ImportError):
        return st
    if stamp.get("mypy") != mypy_version:
        return Status(False, "built by another mypyc", st.root, st.modules)
    return st


def build(root: Path, modules: Sequence[str] = MODULES, verbose: bool = False) -> float:
    """Compiles ``modules`` into ``root`` (replacing what is there); returns seconds taken.

    Runs mypyc in a scratch directory, then swaps the result in and writes the stamp last,
    so a failed or interrupted build leaves the previous state (or none) in place."""
    from mypy.version import __version__ as mypy_version
    from mypyc.build import mypycify
    from setuptools import Distribution

    t0 = time.monotonic()
    sources = {name: source_of(name) for name in modules}
    bases = {str(package_dir(name.split(".")[0]).parent) for name in modules}
    root.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".build-", dir=root.parent))
    old_cwd, old_path = Path.cwd(), os.environ.get("MYPYPATH")
    try:
        os.chdir(scratch)  # mypy's cache and mypyc's C files stay in the scratch directory
        os.environ["MYPYPATH"] = os.pathsep.join(sorted(bases))
        hashes = {name: digest(path) for name, path in sources.items()}
        flags = ["--follow-imports=silent", "--ignore-missing-imports"]
        exts = mypycify(
            [*flags, *(str(p) for p in sources.values())],
            opt_level="3",
            group_name=GROUP,
            target_dir=str(scratch / "c"),
            verbose=verbose,
        )
        dist = Distribution({"name": GROUP, "ext_modules": exts})
        dist.script_args = ["build_ext"] if verbose else ["-q", "build_ext"]
        dist.parse_command_line()
        cmd = dist.get_command_obj("build_ext")
        out = scratch / "out"
        cmd.build_lib = str(out)
        cmd.build_temp = str(scratch / "obj")
        dist.run_commands()
        if any(digest(p) != hashes[n] for n, p in sources.items()):
            raise RuntimeError("a source changed during the build; run it again")
        stamp = {
            "ext_suffix": ext_suffix(),
            "python": sys.version.split()[0],
            "mypy": mypy_version,
            "built_at_unix": int(time.time()),
            "sources": hashes,
        }
        (out / STAMP).write_text(json.dumps(stamp, indent=1, sort_keys=True) + "\n")
        if root.exists():
            retired = scratch / "retired"
            root.rename(retired)
        out.rename(root)
    finally:
        os.chdir(old_cwd)
        if old_path is None:
            os.environ.pop("MYPYPATH", None)
        else:
            os.environ["MYPYPATH"] = old_path
        shutil.rmtree(scratch, ignore_errors=True)
    return time.monotonic() - t0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="hpd native",
        description="Compile the policy core with mypyc (about 3x faster decisions), or say "
        "whether the compiled modules are in use. They are used only while every compiled "
        "source is unchanged since the build; HPD_NATIVE=0 forces the pure-Python modules.",
        epilog="examples:\n  hpd native status\n  hpd native build --if-stale\n"
        "  HPD_NATIVE=0 hpd up          # run on the pure-Python modules",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("action", choices=["status", "build", "clean"], help="what to do")
    p.add_argument("--if-stale", action="store_true", help="build only when not current")
    p.add_argument("--json", action="store_true", help="status as one JSON object")
    p.add_argument("--verbose", action="store_true", help="show the compilers' output")
    args = p.parse_args(argv)
    root = default_root()
    if args.action == "clean":
        shutil.rmtree(root, ignore_errors=True)
        print(f"removed {root}")
        return 0
    if args.action == "status":
        st = check(root)
        if args.json:
            print(json.dumps(dataclasses.asdict(st)))
        else:
            print(f"compiled modules: {'in use' if st.active else 'not in use'} ({st.reason})")
            print(f"build directory:  {root}")
        return 0
    if args.if_stale:
        st = needs_build(root)
        if st.active:
            print(f"compiled modules are current ({len(st.modules)} modules)")
            return 0
        why = "" if st.reason.startswith("not built") else f" ({st.reason})"
        print(
            f"compiling the policy core to C with mypyc{why}: {len(MODULES)} modules,"
            " about a minute, once ...",
            flush=True,
        )
    else:
        print(f"compiling {len(MODULES)} modules with mypyc ...", flush=True)
    try:
        seconds = build(root, verbose=args.verbose)
    except ImportError as exc:
        print(f"cannot build: {exc} (install the dev extras: pip install -e '.[dev]')")
        return 1
    except Exception as exc:  # the compiler's own errors: report them, keep the old state
        print(f"build failed: {type(exc).__name__}: {exc} (rerun with --verbose)")
        return 1
    print(f"built in {seconds:.0f} s into {root}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
