"""Real coding agents against a real server: Claude Code (npm `@anthropic-ai/claude-code`, headless
`claude -p --bare`) completes a turn over /v1/messages on the default model (its end-of-turn row made
likelier, so that no answer fills the context), and its second turn of the same session reads >= 90%
of its prompt from the prefix cache; Codex CLI (npm `@openai/codex`, `codex exec` with a provider on
`wire_api = "responses"`) completes a turn and its resumed second turn over /v1/responses, on a tiny
random-weight model with a 32k context (its ~10k-token prompt does not fit the default model's 8k).
Skipped where `npm` is missing; the CLI is installed once into the user's cache (the npm registry is
the only network it needs), its home is a temporary folder, and it only ever talks to 127.0.0.1."""

import json
import os
import shutil
import subprocess

import pytest
from support import tiny_engine_server
from support.tiny_models import default_model_path, write_tiny_gguf

CLAUDE_CODE = "@anthropic-ai/claude-code@2.1.197"
CODEX = "@openai/codex@0.171.0"

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
    assert done.returncode == 0, done.stderr[-2000:] + done.stdout[-2000:]
    return json.loads(done.stdout)


def test_claude_code_completes_turns_and_its_second_turn_reuses_the_cache(tmp_path):
    binary = installed(CLAUDE_CODE, "claude")
    model = ending_often(shutil.copy(default_model_path(), tmp_path / "ending_often.gguf"))
    home = tmp_path / "home"
    home.mkdir()
    with tiny_engine_server(str(model), slots=2, queue_limit=4, context=4096) as (_, server):
        first = claude(binary, str(home), server.url, "Say hello in five words.")
        assert (first["subtype"], first["is_error"], first["stop_reason"]) == ("success", False, "end_turn"), first
        second = claude(binary, str(home), server.url, "Now say goodbye.", "--resume", first["session_id"])
    assert second["subtype"] == "success" and not second["is_error"], second
    usage = second["usage"]
    prompt = usage["input_tokens"] + usage["cache_read_input_tokens"]
    assert usage["cache_read_input_tokens"] >= 0.9 * prompt, usage  # the billing header no longer breaks the prefix


def ending_often(path: str) -> str:
    """Make the end-of-turn token the likeliest one half the time, so a model's answers end within a
    few tokens instead of, now and then, filling the context (the default model at Claude Code's
    temperature 1 did so in ~1 of 6 turns, and Claude Code's continuation then no longer fits): its
    Q8_0 output row (a tied embedding's row) becomes a large random direction (34-byte blocks: a
    float16 scale, then 32 int8 values)."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(path)
    eos = int(reader.fields["tokenizer.ggml.eos_token_id"].contents())
    tensors = {t.name: t for t in reader.tensors}
    head = tensors.get("output.weight") or tensors["token_embd.weight"]
    assert head.tensor_type == gguf.GGMLQuantizationType.Q8_0
    cols = int(head.shape[0])
    row_bytes = cols // 32 * 34
    data = np.memmap(path, dtype=np.uint8, mode="r+", offset=head.data_offset, shape=(int(head.shape[1]), row_bytes))
    blocks = data[eos].reshape(-1, 34)
    blocks[:, :2] = np.frombuffer(np.float16(0.5).tobytes(), np.uint8)
    blocks[:, 2:] = np.random.default_rng(0).choice([-127, 127], size=(len(blocks), 32)).astype(np.int8).view(np.uint8)
    data.flush()
    return path


def codex(binary: str, home: str, url: str, *args: str) -> subprocess.CompletedProcess:
    provider = [
        "-c", "model_provider=local", "-c", "model=tiny",
        "-c", 'model_providers.local.name="local"', "-c", f'model_providers.local.base_url="{url}/v1"',
        "-c", 'model_providers.local.wire_api="responses"', "-c", 'model_providers.local.env_key="LOCAL_KEY"',
    ]  # fmt: skip
    env = {"PATH": os.environ["PATH"], "HOME": home, "LOCAL_KEY": "local"}
    done = subprocess.run(
        [binary, "exec", "--skip-git-repo-check", *provider, *args], cwd=home, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done


def test_codex_completes_a_turn_and_a_resumed_one_over_the_responses_api(tmp_path):
    binary = installed(CODEX, "codex")
    model = ending_often(write_tiny_gguf(str(tmp_path / "tiny32k.gguf"), "qwen3", matrix_type="Q8_0", context=32768))
    home = tmp_path / "home"
    home.mkdir()
    with tiny_engine_server(model, slots=2, queue_limit=4, context=32768) as (engine, server):
        codex(binary, str(home), server.url, "Say hello.")
        codex(binary, str(home), server.url, "resume", "--last", "Now say goodbye.")
        recent = engine.stats()["recent_requests"]
    first, second = recent[1], recent[0]  # newest first
    assert first["prompt_tokens"] > 5000  # Codex's tools and instructions: ~40 KB
    assert second["cached_tokens"] >= first["prompt_tokens"] - 1  # turn 2 starts from turn 1's cached prompt
