"""The tuning stamp: which BEAM value the server's kernels were searched with, for this exact setup.

`python -m webapp.engine.serving.tuning` (`make tune`) BEAM-searches exactly the kernels the server
compiles and leaves a stamp next to tinygrad's kernel cache, keyed by everything that changes those
kernels (`tuning_key`). At load, `beam_for` compiles with the stamped BEAM value, which then only
reads the searched kernels back from tinygrad's disk cache; without a stamp it uses default kernels.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)


def _stamp(key: dict) -> Path:
    from tinygrad.helpers import cache_dir

    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return Path(cache_dir) / f"llm-server-tuned-{digest}.json"


def tuning_key(model_path: str, slots: int, context: int, prefill_piece: int, cpu_kernels: bool, kv_type: str = "f16") -> dict:
    """Everything that changes the kernels: the model file, the cache shape, the device, tinygrad."""
    import tinygrad
    from tinygrad import Device

    st = os.stat(model_path)
    return {
        "model": os.path.abspath(model_path),
        "size": st.st_size,
        "slots": slots,
        "context": context,
        "prefill_piece": prefill_piece,
        "device": Device.DEFAULT,
        "tinygrad": getattr(tinygrad, "__version__", "?"),
        "cpu_kernels": cpu_kernels,
        "kv_type": kv_type,
        "kernels": 7,  # bump when the set of kernels the server compiles changes
    }


def beam_for(key: dict, configured) -> int:
    """The BEAM value to compile with: LLM_BEAM when set (0 included), else the tuned value when a
    stamp exists, else 0."""
    if configured not in (None, "", "auto"):
        return int(configured)
    stamp = _stamp(key)
    if stamp.exists():
        return int(json.loads(stamp.read_text())["beam"])
    log.info("tinygrad's kernels are not tuned for this configuration: default kernels; `make tune` (once) BEAM-searches them")
    return 0


def mark_tuned(key: dict, beam: int, seconds: float) -> Path:
    stamp = _stamp(key)
    stamp.write_text(json.dumps({"beam": beam, "seconds": round(seconds, 1), "key": key}, indent=1))
    return stamp
