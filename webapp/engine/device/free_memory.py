"""How much memory a GPU has free, where the machine can say: the device's own memory, which the
memory plan sizes the KV cache and `auto` context from (model/memory.py), not this machine's RAM.

Contract: `device_free_bytes(name)` for tinygrad's device name (`CUDA`, `NV:1`, `AMD`; an index
after the colon, else 0): an NVIDIA device's from `nvidia-smi` (its `memory.free`, the index mapped
through CUDA_VISIBLE_DEVICES as CUDA maps it), an AMD device's from the amdgpu driver's counters
(`/sys/class/drm/card*/device/mem_info_vram_total` less `..._used`, the cards in their order);
None where the machine does not say (another device, no tool, no driver), and the plan keeps its
fixed context. Read once at load, before the model's weights are on the device.
"""

from __future__ import annotations

import glob
import os
import re
import subprocess

NVIDIA, AMD = ("CUDA", "NV"), ("AMD", "HIP")


def device_free_bytes(name: str, sysfs: str = "/sys/class/drm") -> int | None:
    base, _, option = name.upper().partition(":")
    index = int(option) if option.isdigit() else 0
    if base in NVIDIA:
        return _nvidia_free(_visible(index))
    if base in AMD:
        return _amd_free(index, sysfs)
    return None


def _visible(index: int) -> int:
    """The physical index of CUDA's `index`-th device (CUDA_VISIBLE_DEVICES lists physical ones)."""
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    return int(visible[index]) if index < len(visible) and visible[index].isdigit() else index


def _nvidia_free(index: int) -> int | None:
    try:
        answer = subprocess.run(
            ["nvidia-smi", f"--id={index}", "--query-gpu=memory.free", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    found = re.fullmatch(r"\s*(\d+)\s*", answer.stdout) if answer.returncode == 0 else None
    return int(found.group(1)) * 2**20 if found else None  # MiB


def _amd_free(index: int, sysfs: str) -> int | None:
    found = glob.glob(os.path.join(sysfs, "card*", "device", "mem_info_vram_total"))
    cards = sorted((p for p in found if re.fullmatch(r"card\d+", p.split(os.sep)[-3])), key=_card_number)  # not card0-DP-1
    if index >= len(cards):
        return None
    folder = os.path.dirname(cards[index])
    try:
        with open(os.path.join(folder, "mem_info_vram_total")) as total, open(os.path.join(folder, "mem_info_vram_used")) as used:
            return max(0, int(total.read()) - int(used.read()))
    except (OSError, ValueError):
        return None


def _card_number(path: str) -> int:
    found = re.search(r"card(\d+)", path)
    return int(found.group(1)) if found else 0
