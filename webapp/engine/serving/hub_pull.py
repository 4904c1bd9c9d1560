"""A model pulled by name from the Hugging Face Hub: `LLM_MODEL=hf:org/repo:Q4_K_M`.

Contract: `is_hub_name(value)` says whether a setting names a Hub model. `pull(name)` returns the
`Pulled` local paths: the model's GGUF and, where the repository has one, its projector (an
`mmproj*.gguf`, the one named for the same quantization, else the float16 one, else the first).
Names:

  hf:org/repo              the repository's Q4_K_M file (llama-server's choice too), else its only GGUF
  hf:org/repo:Q8_0         the GGUF whose name ends with that quantization (any case)
  hf:org/repo/a/file.gguf  that file

Files come through the `huggingface_hub` library, into the Hub's own cache (`HF_HOME`, shared with
every other tool that uses it) and from `HF_ENDPOINT` with `HF_TOKEN`, as that library reads them; a
file already there is not fetched again, a broken-off download resumes, and where the Hub cannot be
asked (no network, `HF_HUB_OFFLINE=1`) the files of a former pull are served from the cache. A file
the repository stores in LFS is checked against its sha256 once, when it arrives; a mismatch
deletes it. The download's progress goes to the log every few seconds, and `progress()` says it in
words meanwhile (the dashboard shows it while the model loads). A split GGUF (`-00001-of-0000N`)
has every part fetched and is joined once into one file under the repository's cache folder
(`joined/`). Anything that fails (no such repository or file, no network, a checksum) raises
`ModelLoadError` in one line that says why.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import threading
import time
from dataclasses import dataclass

from webapp.engine.model.load_error import ModelLoadError
from webapp.engine.serving.split_gguf import PART, join_split, part_names

log = logging.getLogger(__name__)

PREFIX = "hf:"
DEFAULT_QUANT = "Q4_K_M"
PROGRESS_EVERY_S = 5.0


@dataclass(frozen=True)
class Pulled:
    model: str
    projector: str | None


def is_hub_name(value) -> bool:
    return isinstance(value, str) and value.startswith(PREFIX)


def parse_hub_name(name: str) -> tuple[str, str | None, str | None]:
    """(repository, quantization, file): one of the last two, or neither."""
    rest = name[len(PREFIX) :]
    rest, _, quant = rest.partition(":")
    parts = rest.split("/")
    names_ok = all(re.fullmatch(r"[\w.-]+", p) and p not in (".", "..") for p in parts)
    if len(parts) < 2 or not names_ok or (quant and not re.fullmatch(r"[\w.-]+", quant)):
        raise ModelLoadError(f"{name!r}: a Hub model is named hf:org/repo, hf:org/repo:QUANT or hf:org/repo/path/file.gguf")
    repo, file = "/".join(parts[:2]), "/".join(parts[2:]) or None
    if file and quant:
        raise ModelLoadError(f"{name!r}: name a file or a quantization, not both")
    if file and not file.endswith(".gguf"):
        raise ModelLoadError(f"{name!r}: {file} is not a .gguf file")
    return repo, quant or None, file


def choose_files(repo: str, names: list[str], quant: str | None, file: str | None) -> tuple[str, str | None]:
    """(the model's file, its projector's or None) among a repository's file names."""
    ggufs = sorted(n for n in names if n.endswith(".gguf"))
    projectors = [n for n in ggufs if os.path.basename(n).lower().startswith("mmproj")]
    models = [n for n in ggufs if n not in projectors]
    if file is not None:
        if file not in names:
            raise ModelLoadError(f"hf:{repo} has no file {file}; its GGUF files: {', '.join(models) or 'none'}")
        chosen = file
    else:
        wanted = (quant or DEFAULT_QUANT).lower()
        matching = [n for n in models if PART.sub(".gguf", n).lower().removesuffix(".gguf").endswith(wanted)]
        if not matching and quant is None and len({PART.sub(".gguf", n) for n in models}) == 1:
            matching = models
        if not matching:
            have = sorted({_quant_of(n) for n in models})
            raise ModelLoadError(f"hf:{repo} has no {wanted.upper()} file; it has {', '.join(have) or 'no GGUF model'}")
        chosen = matching[0]
    if (match := PART.search(chosen)) and int(match.group(1)) != 1:
        raise ModelLoadError(f"hf:{repo}: {chosen} is not the first part of its split GGUF: name the -00001-of- one")
    quant_name = _quant_of(chosen).lower()
    projector = next((p for p in projectors if quant_name in p.lower()), None)
    projector = projector or next((p for p in projectors if "f16" in p.lower()), None) or (projectors[0] if projectors else None)
    return chosen, projector


def pull(name: str) -> Pulled:
    """The named model's files, fetched into the Hub's cache where they are not there yet."""
    repo, quant, file = parse_hub_name(name)
    try:
        from huggingface_hub import HfApi, hf_hub_download, try_to_load_from_cache
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()  # a log gets the progress lines below instead of redrawn bars
        try:
            info = HfApi().model_info(repo, files_metadata=True)
        except Exception as e:
            cached = _from_cache(repo, quant, file)
            if cached is None:
                raise
            log.warning("hf:%s: %s; serving the copy in the cache", repo, _reason(e))
            return cached
        siblings = {s.rfilename: s for s in info.siblings or ()}
        model, projector = choose_files(repo, list(siblings), quant, file)

        def fetch(wanted: str) -> str:
            cached = try_to_load_from_cache(repo, wanted, revision=info.sha)
            if isinstance(cached, str):
                return cached
            with _progress(repo, wanted, siblings[wanted].size):
                path = hf_hub_download(repo, wanted, revision=info.sha)
            _check(path, wanted, siblings[wanted])
            return path

        parts = [fetch(part) for part in _parts_of(model, siblings)]
        pulled = Pulled(_joined(parts[0]) if len(parts) > 1 else parts[0], fetch(projector) if projector else None)
    except ModelLoadError:
        raise
    except Exception as e:  # the library's and the network's errors, each said in one line
        raise ModelLoadError(f"hf:{repo}: {_reason(e)}") from e
    log.info("hf:%s: %s%s", repo, pulled.model, f", projector {pulled.projector}" if pulled.projector else "")
    return pulled


def _parts_of(model: str, siblings: dict) -> list[str]:
    """A split GGUF's part names (its first part's name given), in order; else [model]."""
    if PART.search(model) is None:
        return [model]
    parts = part_names(model)
    missing = [p for p in parts if p not in siblings]
    if missing:
        raise ModelLoadError(f"{model}: the repository lacks its parts {', '.join(missing)}")
    return parts


def _joined(first: str) -> str:
    """A split GGUF joined once into one file beside the cache's snapshots (`joined/<commit>/`)."""
    root, _, inside = first.partition(f"{os.sep}snapshots{os.sep}")
    out = os.path.join(root, "joined", PART.sub(".gguf", inside))
    if not os.path.isfile(out):
        os.makedirs(os.path.dirname(out), exist_ok=True)
        log.info("joining the parts of %s into %s", os.path.basename(first), out)
        try:
            join_split(first, out)
        except ValueError as e:
            raise ModelLoadError(f"{os.path.basename(first)}: {e}") from e
    return out


def _from_cache(repo: str, quant: str | None, file: str | None) -> Pulled | None:
    """The files a former pull left in the cache (its newest snapshot), for when the Hub cannot be
    asked (no network, HF_HUB_OFFLINE); None where they are not there."""
    snapshots = os.path.join(_repo_cache(repo), "snapshots")
    newest = max((os.path.join(snapshots, s) for s in os.listdir(snapshots)), key=os.path.getmtime) if os.path.isdir(snapshots) else None
    if newest is None:
        return None
    names = [os.path.relpath(os.path.join(root, n), newest) for root, _, files in os.walk(newest) for n in files]
    try:
        model, projector = choose_files(repo, names, quant, file)
        model = os.path.join(newest, model)
        return Pulled(_joined(model) if PART.search(model) else model, os.path.join(newest, projector) if projector else None)
    except (ModelLoadError, OSError):
        return None


# the library's errors that say too little in their own first line
REASONS = {
    "RepositoryNotFoundError": "no such repository on {endpoint} (a private or gated one needs HF_TOKEN)",
    "GatedRepoError": "the repository is gated: accept its terms on the Hub and set HF_TOKEN",
    "RevisionNotFoundError": "no such revision",
    "LocalEntryNotFoundError": "cannot reach {endpoint} and the file is not in the cache",
}


def _reason(error: Exception) -> str:
    from huggingface_hub.constants import ENDPOINT

    for kind in type(error).__mro__:
        if kind.__name__ in REASONS:
            return REASONS[kind.__name__].format(endpoint=ENDPOINT)
    text = str(error).strip()
    first = text.splitlines()[0] if text else ""
    if "connect" in type(error).__name__.lower() or "connect" in first.lower():
        return f"cannot reach {ENDPOINT}: {first or type(error).__name__}"
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


def _quant_of(name: str) -> str:
    stem = PART.sub(".gguf", os.path.basename(name)).removesuffix(".gguf")
    return re.split(r"[-.]", stem)[-1] if re.search(r"[-.]", stem) else stem


def _check(path: str, name: str, sibling) -> None:
    lfs = getattr(sibling, "lfs", None)
    expected = getattr(lfs, "sha256", None) if lfs is not None else None
    if not expected:
        return
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    if digest.hexdigest() != expected:
        blob = os.path.realpath(path)
        for stale in {path, blob}:
            if os.path.lexists(stale):
                os.unlink(stale)
        raise ModelLoadError(f"{name}: its sha256 is {digest.hexdigest()}, not the {expected} the Hub lists; the file was deleted")


_downloading: dict[str, str] = {}  # what each model thread is fetching now, in words; read by `progress()`


def progress() -> str | None:
    """The download in progress, in words (the dashboard shows it while a model loads)."""
    return next(iter(_downloading.values()), None)


class _progress:
    """Follows a download's bytes so far from the size of the cache's partial file: `progress()`
    says them every second, the log every PROGRESS_EVERY_S."""

    def __init__(self, repo: str, name: str, size: int | None):
        self.repo, self.name, self.size = repo, name, size
        self.done = threading.Event()
        self.key = f"{repo}/{name}"

    def __enter__(self):
        self.started = time.monotonic()
        log.info("hf:%s: downloading %s (%s)", self.repo, self.name, _mib(self.size))
        _downloading[self.key] = f"downloading hf:{self.repo}/{self.name}: 0.0 MiB of {_mib(self.size)}"
        threading.Thread(target=self._watch, name="hub-progress", daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.done.set()
        _downloading.pop(self.key, None)
        if exc[0] is None:
            log.info("hf:%s: %s arrived in %.1f s", self.repo, self.name, time.monotonic() - self.started)

    def _watch(self) -> None:
        folder = os.path.join(_repo_cache(self.repo), "blobs")
        logged = time.monotonic()
        while not self.done.wait(1.0):
            partial = [os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".incomplete")] if os.path.isdir(folder) else []
            got = max((os.path.getsize(p) for p in partial if os.path.exists(p)), default=0)
            if self.done.is_set():
                return
            _downloading[self.key] = f"downloading hf:{self.repo}/{self.name}: {_mib(got)} of {_mib(self.size)}"
            if time.monotonic() - logged >= PROGRESS_EVERY_S:
                log.info("hf:%s: %s: %s of %s", self.repo, self.name, _mib(got), _mib(self.size))
                logged = time.monotonic()


def _repo_cache(repo: str) -> str:
    """The repository's folder in the Hub's cache (huggingface_hub's layout)."""
    from huggingface_hub.constants import HF_HUB_CACHE

    return os.path.join(HF_HUB_CACHE, "models--" + repo.replace("/", "--"))


def _mib(size: int | None) -> str:
    return "size unknown" if size is None else f"{size / 2**20:.1f} MiB"
