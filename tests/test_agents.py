"""Real coding agents against a real server on the default model: Claude Code (npm
`@anthropic-ai/claude-code`, headless `claude -p --bare`) completes a turn over /v1/messages, and
its second turn of the same session reads >= 90% of its prompt from the prefix cache. Skipped
where `npm` is missing; the CLI is installed once into the user's cache (the npm registry is the
only network it needs), its home is a temporary folder, and it only ever talks to 127.0.0.1."""

import json
import os
import shutil
import subprocess

import pytest
from conftest import tiny_engine_server
from tiny_models import default_model_path

CLAUDE_CODE = "@anthropic-ai/claude-code@2.1.197"

pytestmark = pytest.mark.skipif(shutil.which("npm") is None, reason="npm is not installed")


def installed(package: str, binary: str) -> str:
    root = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tinyserve", "npm", package.replace("/", "_"))
    path = os.path.join(root, "node_modules", ".bin", binary)
    if not os.path.exists(path):
        os.makedirs(root, exist_ok=True)
        done = subprocess.run(
            ["npm", "install", "--prefix", root, "--no-audit", "--no-fund", package], capture_output=True, text=True, timeout=600
        )
        if done.returncode != 0:
            pytest.skip(f"npm could not install {package}: {done.stderr[-500:]}")
    return path


def claude(binary: str, home: str, url: str, prompt: str, *extra: str) -> dict:
    env = {
        "PATH": os.environ["PATH"],
        "HOME": home,
        "ANTHROPIC_BASE_URL": url,
        "ANTHROPIC_API_KEY": "local",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_AUTOUPDATER": "1",
    }
    done = subprocess.run(
        [binary, "-p", prompt, "--bare", "--output-format", "json", *extra], cwd=home, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def test_claude_code_completes_turns_and_its_second_turn_reuses_the_cache(tmp_path):
    binary = installed(CLAUDE_CODE, "claude")
    with tiny_engine_server(default_model_path(), slots=2, queue_limit=4, context=4096) as (_, server):
        first = claude(binary, str(tmp_path), server.url, "Say hello in five words.")
        assert (first["subtype"], first["is_error"], first["stop_reason"]) == ("success", False, "end_turn"), first
        second = claude(binary, str(tmp_path), server.url, "Now say goodbye.", "--resume", first["session_id"])
    assert second["subtype"] == "success" and not second["is_error"], second
    usage = second["usage"]
    prompt = usage["input_tokens"] + usage["cache_read_input_tokens"]
    assert usage["cache_read_input_tokens"] >= 0.9 * prompt, usage  # the billing header no longer breaks the prefix
