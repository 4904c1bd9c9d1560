"""The C kernels' interface (c/tq.h) against its Python mirror (kernels/abi.py), and the build's hash.

Every build (each rung of the ISA ladder this CPU runs) describes itself through tq_abi; the mirror must describe them
alike, and a field added to one side only, or a value changed on one, must show up as a mismatch.
"""

import ctypes
import shutil
import subprocess

import pytest

from webapp.engine.kernels import abi, build
from webapp.engine.kernels.build import RUNG_NAMES, RUNGS, SOURCES, compile_library, executable_rungs


@pytest.fixture(scope="module", params=[rung.name for rung in RUNGS])
def library(request):
    """Every rung of the ISA ladder this CPU runs (each build describes itself alike), as built unchecked."""
    runnable = {rung.name: flags for rung, flags in executable_rungs()}
    if request.param not in runnable:
        pytest.skip(f"this CPU cannot run the {request.param} rung")
    library = ctypes.CDLL(str(compile_library(list(runnable[request.param]))))
    assert library.tq_isa() == RUNG_NAMES[request.param].isa
    return library


def test_the_mirror_describes_the_library_as_it_describes_itself(library):
    described = abi.described(library)
    assert abi.mismatches(library) == []
    # every struct the mirror names, and every enum's values, are in the library's own list
    assert set(abi.STRUCTS) <= described.keys() and {"Q4_0", "ATTEND_QK_NORM", "MODEL_LAYERS", "LAYER_EXTRAS"} <= described.keys()
    assert described["tq_attention.eps"][2] == "f" and described["tq_layer_shape.attention"][2] == "s"


def test_a_value_or_a_field_changed_in_python_alone_is_a_mismatch(library, monkeypatch):
    monkeypatch.setitem(abi.CONSTANTS, "MAX_HEAD_DIM", 256)
    assert abi.mismatches(library) == ["MAX_HEAD_DIM: C (576, 0, ''), Python (256, 0, '')"]

    class EpsAsBits(ctypes.Structure):  # the old positional spelling: eps's bits in an int32
        _fields_ = [(name, ctypes.c_int32 if name == "eps" else kind) for name, kind in abi.Attention._fields_]

    monkeypatch.undo()
    monkeypatch.setitem(abi.STRUCTS, "tq_attention", EpsAsBits)
    assert abi.mismatches(library) == ["tq_attention.eps: C (28, 4, 'f'), Python (28, 4, 'i')"]


def test_a_field_added_to_the_header_alone_is_a_mismatch(tmp_path):
    """tq.h gains a field that abi.c and abi.py do not list: the struct's size still tells."""
    copy = tmp_path / "c"
    shutil.copytree(SOURCES, copy)
    header = (copy / "tq.h").read_text()
    (copy / "tq.h").write_text(header.replace("} tq_step;", "  int32_t extra;\n} tq_step;"))
    subprocess.run(["clang", "-O0", "-shared", "-fPIC", "-o", str(tmp_path / "tq.so"), str(copy / "tq.c"), "-lm", "-lpthread"], check=True)
    mismatches = abi.mismatches(ctypes.CDLL(str(tmp_path / "tq.so")))
    assert mismatches == [f"tq_step: C ({ctypes.sizeof(abi.Step) + 4}, 0, ''), Python ({ctypes.sizeof(abi.Step)}, 0, '')"]


def test_the_build_hash_covers_every_file_of_the_sources(tmp_path, monkeypatch):
    copy = tmp_path / "c"
    shutil.copytree(SOURCES, copy)
    monkeypatch.setattr(build, "SOURCES", copy)
    hashes = {build.source_hash()}
    files = sorted(p for p in copy.iterdir() if p.is_file())
    assert {p.name for p in files} >= {"tq.c", "tq.h", "isa.h", "fallback.h", "generic.c", "x86_avx2.c"}
    for path in files:
        before = path.read_bytes()
        path.write_bytes(before + b"\n")
        hashes.add(build.source_hash())
        path.write_bytes(before)
    (copy / "new.h").write_text("")
    hashes.add(build.source_hash())
    assert len(hashes) == len(files) + 2
