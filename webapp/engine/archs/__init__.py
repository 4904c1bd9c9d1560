"""The architectures this server runs, one module each, found by `general.architecture`.

Contract: `architecture(name)` returns the `Architecture` record (record.py) serving that name, or
None; `supported()` lists every name served. Each module in this package declares
`ARCHITECTURES`, a tuple of records; adding an architecture is one new module here (plus its tests),
found without editing this file. Modules are imported on the first look-up, not at import time.
"""

from __future__ import annotations

import importlib
import pkgutil
from functools import cache

from webapp.engine.archs.record import Architecture

_NOT_ARCHITECTURES = ("record",)


@cache
def _registry() -> dict[str, Architecture]:
    records: dict[str, Architecture] = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name in _NOT_ARCHITECTURES:
            continue
        for record in importlib.import_module(f"{__name__}.{info.name}").ARCHITECTURES:
            for name in record.names:
                if name in records:
                    raise RuntimeError(f"architecture {name!r} is declared twice (archs/{info.name}.py)")
                records[name] = record
    return records


def architecture(name: object) -> Architecture | None:
    """The record serving `general.architecture` = `name`; None where no module serves it."""
    return _registry().get(name) if isinstance(name, str) else None


def supported() -> tuple[str, ...]:
    return tuple(_registry())
