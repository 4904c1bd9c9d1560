"""Loading a model for the engine: what loading yields, the real GGUF loader, the tuning stamp and
`build_engine`.

Contract: `load_gguf_model(path, ...)` returns a `LoadedModel` (a `Runner`, the GGUF's tokenizer
and chat template, its name and context); it runs on the model thread, which from then on is the
only thread that touches tinygrad. `build_engine(config)` is the engine described by the app's
settings (`webapp.engine.serving.settings`), not yet started.

The tuning stamp: `python -m webapp.engine.model.tuning` (`make tune`) BEAM-searches exactly the kernels
the server compiles and leaves a stamp next to tinygrad's kernel cache, keyed by everything that
changes those kernels (`tuning_key`). At load, `beam_for` compiles with the stamped BEAM value, which
then only reads the searched kernels back from tinygrad's disk cache; without a stamp it uses
default kernels.

tinygrad is imported inside the functions that need it, so importing this module loads no model code.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from webapp.engine.model.config import ModelLoadError
from webapp.engine.model.tinygrad_setup import prepare_tinygrad
from webapp.engine.serving.engine import Engine
from webapp.engine.serving.settings import engine_settings

if TYPE_CHECKING:
    from webapp.engine.model.runner import Runner

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    """What loading a model yields; the runner is the only part that runs the model."""

    runner: Runner
    tokenizer: object
    chat_template: object
    name: str
    context: int
    device: str


def load_gguf_model(path: str, slots: int, max_context: int, prefill_chunk: int, beam="auto", cpu_kernels: bool = True) -> LoadedModel:
    """The real loader: tinygrad model, GGUF tokenizer and the file's chat template."""
    prepare_tinygrad()  # before tinygrad's first import: it reads HCQ2 then
    from tinygrad import Device

    from webapp.engine.model.runner import ModelRunner, prefill_pieces
    from webapp.engine.model.transformer import load_model
    from webapp.engine.text.chat_template import ChatTemplate
    from webapp.engine.text.tokenizer import Tokenizer

    piece = prefill_pieces(prefill_chunk)[0]  # the largest
    model, kv = load_model(path, slots=slots, context=max_context, max_chunk=piece, cpu_kernels=cpu_kernels)
    try:  # the tokenizer's metadata and the template are the file's too: untrusted, refused in one line
        tokenizer = Tokenizer.from_gguf_metadata(kv)
        template = ChatTemplate(kv.get("tokenizer.chat_template"), bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token)
    except (ValueError, TypeError, KeyError, IndexError) as e:
        raise ModelLoadError(f"{os.path.basename(path)}: {type(e).__name__}: {e}".replace("\n", " ")) from e
    beam = beam_for(tuning_key(path, slots, model.context, piece, model.uses_cpu_kernels), beam)
    return LoadedModel(
        runner=ModelRunner(model, prefill_chunk, beam=beam),
        tokenizer=tokenizer,
        chat_template=template,
        name=os.path.basename(path).removesuffix(".gguf"),
        context=model.context,
        device=Device.DEFAULT,
    )


def build_engine(config) -> Engine:
    """The engine described by the app's LLM_* settings (not started)."""
    s = engine_settings(config)
    return Engine(
        lambda: load_gguf_model(s["path"], s["slots"], s["context"], s["prefill_chunk"], s["beam"], s["cpu_kernels"]),
        slots=s["slots"],
        queue_limit=s["queue_limit"],
        prefill_chunk=s["prefill_chunk"],
        stall_seconds=s["stall_seconds"],
    )


# --- the tuning stamp -------------------------------------------------------------------------------


def _stamp(key: dict) -> Path:
    from tinygrad.helpers import cache_dir

    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return Path(cache_dir) / f"llm-server-tuned-{digest}.json"


def tuning_key(model_path: str, slots: int, context: int, prefill_piece: int, cpu_kernels: bool) -> dict:
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
    log.info("kernels are not tuned for this configuration: default kernels; `make tune` (once) makes them about 4x faster")
    return 0


def mark_tuned(key: dict, beam: int, seconds: float) -> Path:
    stamp = _stamp(key)
    stamp.write_text(json.dumps({"beam": beam, "seconds": round(seconds, 1), "key": key}, indent=1))
    return stamp
