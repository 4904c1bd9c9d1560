"""`make tune`: tinygrad's BEAM kernel search for exactly the kernels the server runs, done once.

`python -m webapp.engine.serving.tuning` loads the model with the same LLM_* settings as the server,
compiles every prefill piece and decode width with BEAM search (LLM_BEAM when it is a number, else
TUNE_BEAM), and leaves the stamp that `webapp.engine.model.tuning_stamp.beam_for` looks for at start-up. With a
stamp for its exact configuration the server compiles with the same BEAM value, which then only
reads the searched kernels back from tinygrad's disk cache (seconds). Searching happens here and
at warm-up only, never inside a user's request.
"""

from __future__ import annotations

import logging
import os
import sys
import time

from webapp.engine.model.tuning_stamp import mark_tuned
from webapp.engine.serving.loader import load_gguf_model
from webapp.engine.serving.settings import engine_settings

log = logging.getLogger(__name__)

TUNE_BEAM = 2


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    settings = engine_settings({k[4:]: v for k, v in os.environ.items() if k.startswith("LLM_")})
    if settings.path is None:  # LLM_MODELS_DIR alone: which of its models is not said
        log.error("make tune tunes one model: set LLM_MODEL to it (each model of LLM_MODELS_DIR in turn)")
        return 2
    beam = TUNE_BEAM if settings.beam == "auto" else int(settings.beam)
    started = time.monotonic()
    log.info("tuning kernels with BEAM=%d for %s (this takes minutes, once per configuration)", beam, settings.path)
    loaded = load_gguf_model(
        settings.path,
        settings.slots,
        settings.context,
        settings.prefill_chunk,
        beam=beam,
        cpu_kernels=settings.cpu_kernels,
        cpu_isa=settings.cpu_isa,
        kv_type=settings.kv_type,
    )
    if loaded.tuning_key is None:
        log.info("steps run %s: no tinygrad kernel to tune", loaded.runner.steps.how)
        return 0
    loaded.runner.warm_up(log.info)
    seconds = time.monotonic() - started
    stamp = mark_tuned(loaded.tuning_key, beam, seconds)
    log.info("tuned in %.0f s; stamp %s", seconds, stamp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
