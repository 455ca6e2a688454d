"""The user's cache of machine profiles and chosen plans (the default chooser's:
commands/default_choice.py).

Where: $XDG_CACHE_HOME/slidedp, else ~/.cache/slidedp.
  machines/<machine key>/machine.json              the fingerprint the key digests (for people)
  machines/<machine key>/profile-<layer key>.toml  a profile of the machine (a hardware TOML)
  machines/<machine key>/plans/<choice key>.json   a choice (policy/chooser.py Choice.to_json)
A key is the first KEY_DIGITS hex digits of the SHA-256 of its inputs as sorted JSON (digest).
fingerprint(machine) is what a profile of this machine depends on: the GPU model, count and
memory; the CPU model and its physical and logical cores in this process's affinity; the RAM in
whole GiB; torch and its CUDA build; the NVIDIA driver (/proc/driver/nvidia/version); and the
digest of the sources that write and read a profile (slidedp/profile, slidedp/spec and the
hardware presets, sources_digest): a profile written by other code is another profile. Not the
host name: machines of one kind that share a home directory share their profiles.
An entry is written whole to a temporary file and renamed into place, so that a reader never
sees half of one. An entry that cannot be read (a corrupt or truncated file, another format) is
ignored with one warning on stderr and written anew; a cache directory that cannot be written
is warned about once and the run goes on without it.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import slidedp
from slidedp.spec.units import GIB

if TYPE_CHECKING:
    from slidedp.profile.machine import Machine  # torch: imported where a machine is probed

ENV = "XDG_CACHE_HOME"
KEY_DIGITS = 16
PROFILE_SOURCES = ("profile", "spec", "presets/hardware")  # what a profile's content depends on
DRIVER_FILE = Path("/proc/driver/nvidia/version")
T = TypeVar("T")
_warned: set[str] = set()  # one warning per file or directory and process


def root() -> Path:
    """The cache directory (module docstring)."""
    base = os.environ.get(ENV)
    return (Path(base) if base else Path.home() / ".cache") / "slidedp"


def digest(obj: object) -> str:
    """KEY_DIGITS hex digits of the SHA-256 of `obj` as sorted JSON (str() for the rest)."""
    text = json.dumps(obj, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:KEY_DIGITS]


def sources_digest(parts: tuple[str, ...]) -> str:
    """The digest of the files under these folders of the installed slidedp package (.py and
    .toml, by relative path and content)."""
    pkg = Path(slidedp.__file__).parent
    h = hashlib.sha256()
    for part in parts:
        for f in sorted((pkg / part).rglob("*")):
            if f.suffix in (".py", ".toml") and f.is_file():
                h.update(str(f.relative_to(pkg)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:KEY_DIGITS]


def driver_version() -> str:
    """The NVIDIA kernel module's version line, "" without one."""
    try:
        return DRIVER_FILE.read_text().splitlines()[0].strip()
    except (OSError, IndexError):
        return ""


def fingerprint(machine: Machine) -> dict:
    """What a profile of `machine` depends on (module docstring)."""
    import torch

    return {"gpu": machine.gpu_model, "gpus": machine.gpu_count,
            "hbm_gib": round(machine.hbm_bytes / GIB), "cpu": machine.cpu_model,
            "cores": machine.cores, "cpus": machine.cpus,
            "ram_gib": round(machine.ram_bytes / GIB), "torch": torch.__version__,
            "cuda": torch.version.cuda or "", "driver": driver_version(),
            "slidedp": slidedp.__version__, "sources": sources_digest(PROFILE_SOURCES)}


def machine_dir(print_: dict) -> Path:
    """The folder of one machine fingerprint's entries."""
    return root() / "machines" / digest(print_)


def warn(path: Path, what: str) -> None:
    """One warning on stderr per path and process."""
    if str(path) not in _warned:
        _warned.add(str(path))
        print(f"slidedp: warning: {what}", file=sys.stderr, flush=True)


def read(path: Path, parse: Callable[[str], T]) -> T | None:
    """parse(the entry's text); None where there is none, or where it cannot be read or parsed
    (then one warning: the entry is ignored and written anew)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:
        warn(path, f"ignoring the cache entry {path}: unreadable ({e}); it is written anew")
        return None
    try:
        return parse(text)
    except Exception as e:  # any parse failure of a cached file is the same: a corrupt entry
        cause = str(e).splitlines()[0] if str(e) else type(e).__name__
        warn(path, f"ignoring the corrupt cache entry {path} ({cause}); it is written anew")
        return None


def write(path: Path, text: str) -> bool:
    """Write an entry atomically (module docstring); whether it was written."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
        return True
    except OSError as e:
        warn(path.parent, f"the cache {root()} cannot be written ({e}): nothing is kept for "
             "the next run")
        return False
