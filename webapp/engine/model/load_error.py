"""The one error a GGUF file that cannot be served ends in.

Stdlib only and imported by every module that reads a file's metadata or tensors (config.py and the
architecture files it reads through), so none of them needs another's import to raise it.
"""


class ModelLoadError(ValueError):
    """The GGUF file cannot be served: unsupported architecture, missing or malformed key or tensor."""
