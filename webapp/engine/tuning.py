"""Kernel search (tinygrad's BEAM) for exactly the kernels the server runs, done once and reused.

`python -m webapp.engine.tuning` (what `make tune` runs) loads the model with the same LLM_*
settings as the server, compiles every prefill chunk and decode width with BEAM search, and leaves
a stamp next to tinygrad's kernel cache. At start-up the server asks `beam_for()`: with a stamp
for its exact configuration it compiles with the same BEAM value, which then only reads the
searched kernels back from tinygrad's disk cache (seconds); without one it uses default kernels.
Searching happens at warm-up only, never inside a user's request.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import time
from pathlib import Path

log = logging.getLogger(__name__)

TUNE_BEAM = 2


def _stamp(key: dict) -> Path:
    from tinygrad.helpers import cache_dir

    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return Path(cache_dir) / f"llm-server-tuned-{digest}.json"


def tuning_key(model_path: str, slots: int, context: int, prefill_piece: int) -> dict:
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
        "kernels": 7,  # bump when the set of kernels the server compiles changes
    }


def beam_for(key: dict, configured) -> int:
    """The BEAM value to compile with: LLM_BEAM when set, else the tuned value when a stamp exists."""
    if configured not in (None, "", "auto"):
        return int(configured)
    stamp = _stamp(key)
    if stamp.exists():
        return int(json.loads(stamp.read_text())["beam"])
    log.info("kernels are not tuned for this configuration: default kernels; `make tune` (once) makes them ~2x faster")
    return 0


def mark_tuned(key: dict, beam: int, seconds: float) -> Path:
    stamp = _stamp(key)
    stamp.write_text(json.dumps({"beam": beam, "seconds": round(seconds, 1), "key": key}, indent=1))
    return stamp


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    from .engine import engine_settings, load_gguf_model

    settings = engine_settings({k[4:]: v for k, v in os.environ.items() if k.startswith("LLM_")})
    beam = int(os.environ.get("LLM_BEAM") or TUNE_BEAM)
    started = time.monotonic()
    log.info("tuning kernels with BEAM=%d for %s (this takes minutes, once per configuration)", beam, settings["path"])
    loaded = load_gguf_model(settings["path"], settings["slots"], settings["context"], settings["prefill_chunk"], beam=beam)
    loaded.runner.warm_up(log.info)
    seconds = time.monotonic() - started
    stamp = mark_tuned(tuning_key(settings["path"], settings["slots"], loaded.context, loaded.runner.piece), beam, seconds)
    log.info("tuned in %.0f s; stamp %s", seconds, stamp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
