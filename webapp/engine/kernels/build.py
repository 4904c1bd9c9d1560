"""Building the C kernels (c/): the instruction-set ladder (which rungs there are, each one's compiler
flags and the CPU features it needs, which one this CPU runs) and the shared library, compiled once
per source and flags and cached on disk, so a restart reuses it.

Contract: `RUNGS` is the ladder, lowest first, the one table of each rung's flags; `rung_for(name)`
is the rung to build on this CPU: the highest one it can execute that is `automatic`, or the one
LLM_CPU_ISA names,
refused with a ValueError where the name is unknown or the CPU lacks a feature the rung needs.
`compile_library(flags)` returns the path of a library built from every file under SOURCES (c/tq.c
includes the others: one translation unit, so the compiler inlines across them) with those flags;
the cache key hashes every file in the folder and the command, so a change to any of them is a new
build. It raises subprocess.CalledProcessError (with clang's stderr) where the build fails. A
library reports the rung it was built for (tq_isa, abi.Isa), which the loader checks against the
rung it asked for.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from webapp.engine.kernels import abi
from webapp.engine.kernels.abi import Isa

# the kernels' sources: c/tq.c includes every other file of the folder (one translation unit, so the
# compiler inlines across them), and the build's hash covers every file in it
SOURCES = Path(__file__).with_name("c")
SOURCE = SOURCES / "tq.c"
ISA_VARIABLE = "LLM_CPU_ISA"  # names a rung to build instead of the highest this CPU executes
# "1": build the kernels under AddressSanitizer and UndefinedBehaviorSanitizer (a build of their own,
# cached apart), for a process started with clang's ASan runtime preloaded (tests/integration/test_sanitizers.py)
SANITIZE_VARIABLE = "LLM_CPU_SANITIZE"
SANITIZER_FLAGS = ("-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-shared-libasan", "-fno-omit-frame-pointer", "-g1")

X86 = frozenset({"x86_64", "amd64"})
ARM = frozenset({"aarch64", "arm64"})
_AVX2 = (frozenset({"avx2", "fma", "f16c"}), ("-mavx2", "-mfma", "-mf16c"))
_AVX512 = (frozenset({"avx512f", "avx512bw", "avx512vl"}), ("-mavx512f", "-mavx512bw", "-mavx512vl"))


@dataclass(frozen=True)
class Rung:
    """A rung of the ladder: its name (LLM_CPU_ISA's value), the id a build for it reports, the
    machines it is for (empty: every one), and its ways to build, each the /proc/cpuinfo flags it
    needs and the compiler flags it takes; the first way this CPU has is the one built."""

    name: str
    isa: Isa
    machines: frozenset[str]
    ways: tuple[tuple[frozenset[str], tuple[str, ...]], ...]
    # whether "auto" may choose it: a rung is chosen by default only once its kernels are at least as
    # fast as the rung below's at every step kind (bench/kernel_ab.py --before-isa measures that)
    automatic: bool = True

    def flags_on(self, machine: str, cpu: frozenset[str]) -> tuple[str, ...] | None:
        """The compiler flags of the first way a CPU of `machine` with the features `cpu` executes,
        or None where it executes none."""
        if self.machines and machine.lower() not in self.machines:
            return None
        return next((flags for needs, flags in self.ways if needs <= cpu), None)

    def missing_on(self, machine: str, cpu: frozenset[str]) -> str:
        """What keeps a CPU from this rung, in words (its machine, or the features of the way it comes closest to)."""
        if self.machines and machine.lower() not in self.machines:
            return f"it is for {', '.join(sorted(self.machines))}, this machine is {machine}"
        lacking = min((needs - cpu for needs, _ in self.ways), key=len)
        return f"this CPU lacks {', '.join(sorted(lacking))}"


def _with(*parts: tuple[frozenset[str], tuple[str, ...]]) -> tuple[frozenset[str], tuple[str, ...]]:
    return frozenset().union(*(needs for needs, _ in parts)), tuple(flag for _, flags in parts for flag in flags)


def _arm(march: str, *features: str) -> tuple[frozenset[str], tuple[str, ...]]:
    """An ARM rung's way: NEON and `features`, built for `march`. An aarch64 compiler always targets
    NEON, so the rung names itself to tq.c (TQ_NEON_RUNG), where the portable rung does not."""
    return frozenset({"asimd", *features}), (f"-march={march}", "-DTQ_NEON_RUNG")


_VNNI_256 = (frozenset({"avx_vnni"}), ("-mavxvnni",))  # Intel's client cores: AVX-VNNI's VEX dpbusd
_VNNI_512 = (frozenset({"avx512_vnni", "avx512vl"}), ("-mavx512vnni", "-mavx512vl"))  # its 256-bit form via AVX512-VL

# The ladder, lowest first: every rung runs the kernels of the rungs below where it has none of its
# own (c/fallback.h). The x86 rungs above AVX2 build x86_avx2*.c too: the VNNI ones with dpbusd in
# their integer dots (x86_avx2.c says when that is bit for bit AVX2's), the AVX-512 ones with
# AVX-512's flags and the 512-bit product tiles of x86_avx512*.c. avx512_vnni is chosen by
# default: its tiles are faster than AVX2's at every step kind, one lane included (bench/RESULTS.md).
# The others are built only when LLM_CPU_ISA names them: avx2_vnni's dots alone made a one-lane step
# slower, and avx512 without VNNI would be chosen only by CPUs (Skylake's server cores) whose clocks
# drop under 512-bit work, where it has not been measured. The ARM rungs (arm_neon*.c: the products'
# rows in NEON, with sdot where the CPU has ARMv8.2's dot product) are tested under qemu-aarch64
# against the generic build (tests/integration/test_arm_kernels.py) and built only when named until
# they are measured on ARM hardware.
RUNGS = (
    Rung("generic", Isa.GENERIC, frozenset(), ((frozenset(), ()),)),
    Rung("avx2", Isa.AVX2, X86, (_AVX2,)),
    Rung("avx2_vnni", Isa.AVX2_VNNI, X86, (_with(_AVX2, _VNNI_256), _with(_AVX2, _VNNI_512)), automatic=False),
    Rung("avx512", Isa.AVX512, X86, (_with(_AVX2, _AVX512),), automatic=False),
    Rung("avx512_vnni", Isa.AVX512_VNNI, X86, (_with(_AVX2, _AVX512, (frozenset({"avx512_vnni"}), ("-mavx512vnni",))),)),
    Rung("neon", Isa.NEON, ARM, (_arm("armv8-a"),), automatic=False),
    Rung("neon_dotprod", Isa.NEON_DOTPROD, ARM, (_arm("armv8.2-a+dotprod", "asimddp"),), automatic=False),
    Rung("neon_i8mm", Isa.NEON_I8MM, ARM, (_arm("armv8.2-a+dotprod+i8mm", "asimddp", "i8mm"),), automatic=False),
)
RUNG_NAMES = {rung.name: rung for rung in RUNGS}


@functools.cache
def cpu_features() -> frozenset[str]:
    """The flags /proc/cpuinfo lists for this CPU (none where there is no such file)."""
    try:
        with open("/proc/cpuinfo") as info:
            return frozenset(next((line.split(":", 1)[1].split() for line in info if line.startswith(("flags", "Features"))), []))
    except OSError:
        return frozenset()


def executable_rungs(machine: str | None = None, cpu: frozenset[str] | None = None) -> list[tuple[Rung, tuple[str, ...]]]:
    """Every rung this CPU (or the one given) executes, lowest first, each with its compiler flags."""
    machine, cpu = machine or platform.machine(), cpu_features() if cpu is None else cpu
    return [(rung, flags) for rung in RUNGS if (flags := rung.flags_on(machine, cpu)) is not None]


def rung_for(name: str | None = None, machine: str | None = None, cpu: frozenset[str] | None = None) -> tuple[Rung, tuple[str, ...]]:
    """The rung to build and its compiler flags: the one named (LLM_CPU_ISA's value; None, "" or
    "auto": the highest automatic rung this CPU executes). Raises ValueError for a name not on the ladder or a rung
    this CPU cannot execute: a build for it would stop the server on its first unknown instruction."""
    machine, cpu = machine or platform.machine(), cpu_features() if cpu is None else cpu
    runnable = executable_rungs(machine, cpu)
    if not name or name == "auto":
        return [(rung, flags) for rung, flags in runnable if rung.automatic][-1]
    if name not in RUNG_NAMES:
        raise ValueError(f"{ISA_VARIABLE}={name!r}: one of auto, {', '.join(RUNG_NAMES)} is expected")
    rung = RUNG_NAMES[name]
    flags = rung.flags_on(machine, cpu)
    if flags is None:
        best = runnable[-1][0].name
        raise ValueError(
            f"{ISA_VARIABLE}={name}: this CPU cannot run that rung ({rung.missing_on(machine, cpu)}); the highest it runs is {best}"
        )
    return rung, flags


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


def sanitized() -> bool:
    """Whether LLM_CPU_SANITIZE asks for the sanitizers' build."""
    return os.environ.get(SANITIZE_VARIABLE, "") == "1"


def compile_library(flags: list[str], sources: Path | None = None) -> Path:
    """Build the kernels (tq.c of `sources`, SOURCES unless another checkout's, and what it includes)
    into a shared library, once per source and flags (the sanitizers' too, with LLM_CPU_SANITIZE)."""
    sources = sources or SOURCES
    command = ["clang", "-O3", "-shared", "-fPIC", "-fno-math-errno", *flags, *(SANITIZER_FLAGS if sanitized() else ())]
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


def load_library(rung: Rung, flags: tuple[str, ...] | list[str], sources: Path | None = None) -> ctypes.CDLL:
    """The library of `sources` built for `rung` with `flags` (rung_for's), loaded and checked: a RuntimeError
    where its interface is not abi.py's (arguments would be misread) or it reports another rung (this table
    and tq.c's macros disagree). Both are bugs, not a CPU's missing feature."""
    if sanitized() and "asan" not in os.environ.get("LD_PRELOAD", ""):
        # the sanitizers' runtime must be the process's first library, or loading the build aborts it
        raise RuntimeError(
            f"{SANITIZE_VARIABLE}=1 needs clang's ASan runtime in LD_PRELOAD (tests/integration/test_sanitizers.py starts such a process)"
        )
    library = ctypes.CDLL(str(compile_library(list(flags), sources)))
    if mismatches := abi.mismatches(library):
        raise RuntimeError(f"the kernels' interface differs from kernels/abi.py: {'; '.join(mismatches)}")
    if library.tq_isa() != rung.isa:
        raise RuntimeError(f"the kernels built for {rung.name} ({' '.join(flags)}) report {abi.Isa(library.tq_isa()).name}")
    return library
