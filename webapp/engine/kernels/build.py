"""Building the C kernels (c/): the compiler flags this CPU allows, and the shared library, compiled
once per source and flags and cached on disk, so a restart reuses it.

Contract: `compile_library(flags)` returns the path of a library built from every file under SOURCES
(c/tq.c includes the others: one translation unit, so the compiler inlines across them) with those
flags; the cache key hashes every file in the folder and the command, so a change to any of them
is a new build. It raises subprocess.CalledProcessError (with clang's stderr) where the build fails.
"""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
import tempfile
from pathlib import Path

# the kernels' sources: c/tq.c includes every other file of the folder (one translation unit, so the
# compiler inlines across them), and the build's hash covers every file in it
SOURCES = Path(__file__).with_name("c")
SOURCE = SOURCES / "tq.c"


def simd_flags() -> list[str]:
    """Compiler flags for the widest SIMD this CPU reports that the kernels use (AVX2 with FMA and F16C)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return []
    try:
        flags = next((line.split(":", 1)[1].split() for line in open("/proc/cpuinfo") if line.startswith("flags")), [])
    except OSError:
        return []
    return ["-mavx2", "-mfma", "-mf16c"] if {"avx2", "fma", "f16c"} <= set(flags) else []


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "tinyserve"


def source_hash(sources: Path | None = None) -> bytes:
    """A hash of every file under `sources` (SOURCES), names and bytes: a change to any of them is a
    new build."""
    sources = sources or SOURCES
    digest = hashlib.sha256()
    for path in sorted(p for p in sources.rglob("*") if p.is_file()):
        name, data = path.relative_to(sources).as_posix().encode(), path.read_bytes()
        digest.update(len(name).to_bytes(4, "little") + name + len(data).to_bytes(8, "little") + data)
    return digest.digest()


def compile_library(flags: list[str], sources: Path | None = None) -> Path:
    """Build the kernels (tq.c of `sources`, SOURCES unless another checkout's, and what it includes)
    into a shared library, once per source and flags."""
    sources = sources or SOURCES
    command = ["clang", "-O3", "-shared", "-fPIC", "-fno-math-errno", *flags]
    key = hashlib.sha256(source_hash(sources) + " ".join(command).encode()).hexdigest()[:16]
    target = _cache_dir() / f"tq-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=target.parent, suffix=".so", delete=False) as tmp:
        pass
    try:
        subprocess.run(
            [*command, "-o", tmp.name, str(sources / SOURCE.name), "-lm", "-lpthread"], check=True, capture_output=True, text=True
        )
        os.replace(tmp.name, target)  # atomic: a concurrent start-up sees the old file or the whole new one
    finally:
        if os.path.exists(tmp.name):
            os.unlink(tmp.name)
    return target
