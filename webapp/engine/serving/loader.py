"""Loading a model for the engine: the real GGUF loader and `build_engine`.

Contract: `load_gguf_model(path, ...)` returns a `LoadedModel` (a `Runner`, the GGUF's tokenizer
and chat template, its name and context); it runs on the model thread, which from then on is the
only thread that touches tinygrad. `build_engine(config)` is the engine described by the app's
settings (`webapp.engine.serving.settings`), not yet started: with `LLM_MODELS_DIR`, a `ModelSet`
of engines, one per model loaded.

The BEAM value to compile with comes from the tuning stamp (`webapp.engine.model.tuning_stamp`).

tinygrad is imported inside the functions that need it, so importing this module loads no model code.
"""

from __future__ import annotations

import logging
import os

from webapp.engine.model.load_error import ModelLoadError
from webapp.engine.model.tinygrad_setup import free_cached_buffers, prepare_tinygrad, use_tinygrad_from_this_thread
from webapp.engine.model.tuning_stamp import beam_for, tuning_key
from webapp.engine.serving.adapters import Adapters
from webapp.engine.serving.engine import Engine
from webapp.engine.serving.hub_pull import is_hub_name, pull
from webapp.engine.serving.kv_cache import RingRows
from webapp.engine.serving.loaded_model import LoadedModel
from webapp.engine.serving.model_files import projector_beside
from webapp.engine.serving.model_set import ModelSet
from webapp.engine.serving.prefix_store import PrefixStore
from webapp.engine.serving.ranker import ranker_of
from webapp.engine.serving.settings import EngineSettings, engine_settings

log = logging.getLogger(__name__)


# GGUF's {arch}.pooling_type (llama.cpp's enum): what an embedding model was trained to pool
POOLING_TYPES = {1: "mean", 2: "first", 3: "last"}  # 0 none, 4 rank: no sentence embedding
POOLINGS = ("mean", "last", "first")


def embedding_pooling(kv: dict, setting: str = "auto") -> tuple[str, str]:
    """How /v1/embeddings pools, and why: the setting, else the file's pooling_type, else mean (a
    chat model's hidden states, averaged, as Ollama and LM Studio give for such files)."""
    if setting != "auto":
        if setting not in POOLINGS:
            raise ValueError(f"LLM_POOLING={setting!r}: one of {', '.join(POOLINGS)} or auto is expected")
        return setting, "LLM_POOLING"
    arch = kv.get("general.architecture")
    pooling = POOLING_TYPES.get(kv.get(f"{arch}.pooling_type"))
    return (pooling, "the file's pooling_type") if pooling else ("mean", "the file names none")


def load_gguf_model(
    path: str,
    slots: int,
    max_context: int | None,
    prefill_chunk: int,
    *,
    beam="auto",
    cpu_kernels: bool = True,
    cpu_isa: str = "auto",
    pooling: str = "auto",
    draft: str | None = None,
    kv_type: str = "f16",
    paging: tuple[int, tuple[str, int] | None] | None = None,
    mmproj: str | None = None,
    lora_dir: str | None = None,
    image_tokens: tuple[int | None, int | None] = (None, None),
) -> LoadedModel:
    """The real loader: tinygrad model, GGUF tokenizer and the file's chat template; `draft`, a draft
    model's GGUF for speculative decoding (serving/draft_loader.py); `mmproj`, a projector GGUF
    whose images prompts may hold (webapp/engine/vision), `image_tokens` the least and most positions
    an image becomes where its family sizes it by its pixels (None: the file's); `lora_dir`, a folder
    of LoRA adapter GGUFs requests may choose (serving/adapters.py)."""
    prepare_tinygrad()  # before tinygrad's first import: it reads HCQ2 then
    from tinygrad import Device

    from webapp.engine.kernels.cpu import QuantizedCPU
    from webapp.engine.model.memory import kv_bytes_per_position, state_bytes
    from webapp.engine.model.recurrent_config import DRAFT_STATE_ROWS, snapshot_rows
    from webapp.engine.model.steps import steps_for
    from webapp.engine.model.steps.jitted import prefill_pieces
    from webapp.engine.model.transformer import load_model
    from webapp.engine.serving.draft_loader import load_draft
    from webapp.engine.serving.runner import ModelRunner
    from webapp.engine.text.chat_template import ChatTemplate
    from webapp.engine.text.tokenizer import Tokenizer
    from webapp.engine.vision.projector import load_projector

    piece = prefill_pieces(prefill_chunk)[0]  # the largest
    # a paged cache keeps no per-slot copy for a draft model to mirror: a draft model keeps slots
    paging = None if draft else paging
    # the projector first: the memory plan (available memory) then sees its weights taken
    # its quantized matrices laid out at once for the kernels that will multiply them, if the model runs on them
    kernels = QuantizedCPU.load(cpu_isa) if mmproj and cpu_kernels else None
    projector = load_projector(mmproj, kernels.library if kernels else None) if mmproj else None
    if projector is not None and image_tokens != (None, None):
        limited = projector.limit_tokens(*image_tokens)
        log.info(
            "images: %s",
            f"{limited[0]} to {limited[1]} positions an image" if limited else f"{projector.family}'s take one number of positions",
        )
    model, kv = load_model(path, slots, max_context, piece, cpu_kernels, kv_type, paging, cpu_isa)
    try:  # the tokenizer's metadata and the template are the file's too: untrusted, refused in one line
        tokenizer = Tokenizer.from_gguf_metadata(kv)
        template = ChatTemplate(kv.get("tokenizer.chat_template"), bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token)
    except (ValueError, TypeError, KeyError, IndexError) as e:
        raise ModelLoadError(f"{os.path.basename(path)}: {type(e).__name__}: {e}".replace("\n", " ")) from e
    pooling, why = embedding_pooling(kv, pooling)
    # an embedding model's file asks for its end-of-text after each input (Qwen3-Embedding pools that token)
    suffix = (tokenizer.eos_id,) if kv.get("tokenizer.ggml.add_eos_token") and tokenizer.eos_id is not None else ()
    log.info("embeddings: %s pooling (%s)%s", pooling, why, ", end-of-text appended" if suffix else "")
    ranker = ranker_of(path, kv, model.config.dim)
    steps = steps_for(model, prefill_chunk)
    if steps.lora_table is None:
        no_adapters = f"this model's steps are {steps.how}"
    elif model.config.recurrent:  # a recurrent layer's states, unlike K/V, are not filed by the adapter that made them
        no_adapters = "this model has recurrent layers"
    else:
        no_adapters = None
    if lora_dir and no_adapters:
        raise ModelLoadError(
            f"LLM_LORA_DIR: adapters run on the CPU kernels' one-call steps and on tinygrad's, in models without recurrent layers; {no_adapters}"
        )
    adapters = None if no_adapters else adapters_for(lora_dir, path, model, steps)
    draft_model = load_draft(draft, path, kv, steps, slots, piece, cpu_kernels, cpu_isa) if draft else None
    vision = vision_for(projector, os.path.basename(mmproj), model.config, steps, tokenizer) if projector else None
    tuned = tuning_key(path, slots, model.context, piece, model.uses_cpu_kernels, model.kv_type.name) if steps.tunable else None
    if tuned is not None:
        beam = beam_for(tuned, beam)
        log.info("steps: %s", steps.how)
    else:
        beam = 0
        log.info("steps: %s (no tinygrad kernel in a step: `make tune` has nothing to search)", steps.how)
    return LoadedModel(
        runner=ModelRunner(steps, beam=beam, draft=draft_model, vision=vision),
        tokenizer=tokenizer,
        chat_template=template,
        name=os.path.basename(path).removesuffix(".gguf"),
        context=model.context,
        device=Device.DEFAULT,
        pooling=pooling,
        width=model.config.dim,
        embedding_suffix=suffix,
        ranker=ranker,
        routed_tokens=model.routed_tokens if model.config.experts else None,
        kv_type=model.kv_type.name,
        kv_bytes_per_token=kv_bytes_per_position(model.config, model.kv_type, rings=model.ring_rows is not None),
        state_bytes=state_bytes(model.config),
        state_snapshots=snapshot_rows(model.slots) if model.config.recurrent else 0,
        draft_states=DRAFT_STATE_ROWS if model.config.recurrent else 0,
        ring_rows=RingRows(*model.ring_rows) if model.ring_rows else None,
        kv_pool=model.pool,
        block_table=model.block_table,
        tuning_key=tuned,
        vision=vision,
        adapters=adapters,
    )


def adapters_for(folder: str | None, path: str, model, steps) -> Adapters:
    """The adapters of `folder` (None: none yet) fitted to the model loaded from `path`, or
    ModelLoadError saying why not; more may be loaded at run time (serving/adapters.py)."""
    from webapp.engine.model.gguf import read_gguf
    from webapp.engine.model.lora import fit, model_targets, read_adapter
    from webapp.engine.model.weights import unpermute_rope_rows

    _, table = read_gguf(path)
    targets = model_targets(model, {name: (t.rows, t.cols) for name, t in table.items()})
    rope = model.config.rope_rows()

    def regroup(name: str, rows):  # an adapter's B rows in the order the loader gives its matrix's
        heads = next((h for suffix, h in rope.items() if name.endswith(suffix)), None)
        return unpermute_rope_rows(rows, *heads) if heads else rows

    adapters = Adapters(lambda adapter: fit(adapter, targets, regroup), steps.lora_table, read_adapter)
    try:
        if folder is not None:
            adapters.from_folder(folder)
    except ValueError as e:
        raise ModelLoadError(f"LLM_LORA_DIR: {e}") from e
    return adapters


def vision_for(projector, name: str, config, steps, tokenizer):
    """The projector (file `name`) as the served model's `Vision`, or ModelLoadError where the two
    do not go together."""
    from webapp.engine.kernels.vision_encoder import VisionEncoderKernels
    from webapp.engine.vision.projector import OWN_TOWERS
    from webapp.engine.vision.vision import Vision

    if not steps.takes_inputs:
        raise ModelLoadError(f"{name}: an image's rows go where token embeddings do, which these steps do not take ({steps.how})")
    if projector.family in OWN_TOWERS and not config.rope_sections:
        raise ModelLoadError(f"{name}: its images turn by M-RoPE sections, which the model's file has none of (a Qwen2-VL model's have)")
    if config.rope_sections and not steps.turns_by_sections:
        raise ModelLoadError(f"{name}: its images turn by M-RoPE sections, which these steps ({steps.how}) do not take")
    if projector.deepstack != config.deepstack_layers:
        raise ModelLoadError(
            f"{name}: its rows carry {projector.deepstack} deepstack features; the model's first layers take {config.deepstack_layers}"
        )
    if projector.text_dim != config.dim:
        raise ModelLoadError(f"{name}: its rows have {projector.text_dim} values; the model's embeddings have {config.dim}")
    kernels = getattr(steps, "kernels", None)  # the encoder's attention and gelu on the model's cores, else NumPy's
    projector.encoder.kernels = VisionEncoderKernels(kernels.library) if kernels is not None else None
    log.info("images: %s's %s projector", name, projector.family)
    return Vision(projector, max(config.vocab_size, tokenizer.vocab_size))


def build_engine(config) -> Engine | ModelSet:
    """The engine described by the app's LLM_* settings (not started): with LLM_MODELS_DIR, the
    `ModelSet` of the folder's models (LLM_MODEL's among them, loaded at start; the draft model
    goes with LLM_MODEL's model only, the one it was chosen for); with LLM_IDLE_UNLOAD_SECONDS, a
    set too (of LLM_MODEL's alone, without the folder), whose models sleep when idle."""
    s = engine_settings(config)
    if s.models_dir is None and s.idle_unload is None:
        return _engine(s, s.path, s.draft)

    def make_engine(path: str) -> Engine:
        return _engine(s, path, s.draft if path == s.path else None, own_thread=True)

    # a model that sleeps when idle is served as a set of one: the set loads and unloads it
    return ModelSet(s.models_dir, make_engine, s.memory_budget, first=s.path, idle_s=s.idle_unload)


def _engine(s: EngineSettings, path: str, draft: str | None, own_thread: bool = False) -> Engine:
    def load() -> LoadedModel:
        if own_thread:  # one of several model threads: tinygrad's kernel cache connection is this one's now
            prepare_tinygrad()
            use_tinygrad_from_this_thread()
            free_cached_buffers()  # an unloaded model's, before this one allocates its own
        model, mmproj = path, (s.mmproj if path == s.path else None)
        if is_hub_name(path):  # fetched here, on the model thread: /health says loading meanwhile
            pulled = pull(path)
            model, mmproj = pulled.model, mmproj or pulled.projector
        return load_gguf_model(
            model,
            s.slots,
            s.context,
            s.prefill_chunk,
            beam=s.beam,
            cpu_kernels=s.cpu_kernels,
            cpu_isa=s.cpu_isa,
            pooling=s.pooling,
            draft=draft,
            kv_type=s.kv_type,
            paging=s.paging,
            mmproj=mmproj or projector_beside(model),
            lora_dir=s.lora_dir if path == s.path else None,
            image_tokens=s.image_tokens,
        )

    return Engine(
        load,
        slots=s.slots,
        queue_limit=s.queue_limit,
        prefill_chunk=s.prefill_chunk,
        stall_seconds=s.stall_seconds,
        speculate=s.speculate,
        prefix_store=None if s.prefix_cache is None else PrefixStore(*s.prefix_cache, path),
    )
