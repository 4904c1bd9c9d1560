"""Naming a Hub model (webapp/engine/serving/hub_pull.py): the three forms parsed, malformed names
refused at start, and the file and projector chosen among a repository's files as llama-server's
`-hf` chooses them (Q4_K_M when no quantization is named), each failure said in one line."""

import pytest

from webapp.engine.model.load_error import ModelLoadError
from webapp.engine.serving.hub_pull import choose_files, is_hub_name, parse_hub_name
from webapp.engine.serving.settings import engine_settings

FILES = [
    "README.md",
    "Qwen3-1.7B-Q4_K_M.gguf",
    "Qwen3-1.7B-Q8_0.gguf",
    "Qwen3-1.7B-BF16.gguf",
    "mmproj-Qwen3-1.7B-f16.gguf",
    "mmproj-Qwen3-1.7B-Q8_0.gguf",
    "big/Qwen3-1.7B-Q6_K-00001-of-00002.gguf",
    "big/Qwen3-1.7B-Q6_K-00002-of-00002.gguf",
]


def test_the_three_forms_of_a_name():
    assert is_hub_name("hf:a/b") and not is_hub_name("/models/a.gguf") and not is_hub_name(None)
    assert parse_hub_name("hf:org/repo") == ("org/repo", None, None)
    assert parse_hub_name("hf:org/repo:q8_0") == ("org/repo", "q8_0", None)
    assert parse_hub_name("hf:org/repo/sub/m.gguf") == ("org/repo", None, "sub/m.gguf")


@pytest.mark.parametrize(
    "name", ["hf:", "hf:repo", "hf:org/re po", "hf:org/repo/m.bin", "hf:org/repo/m.gguf:Q8_0", "hf:org/../x", "hf:org/repo/../../x.gguf"]
)
def test_a_malformed_name_is_refused_at_start_in_one_line(name):
    with pytest.raises(ModelLoadError):
        parse_hub_name(name)
    with pytest.raises(ValueError):
        engine_settings({"MODEL": name})


def test_a_hub_name_is_served_alone():
    assert engine_settings({"MODEL": "hf:org/repo:Q8_0"}).path == "hf:org/repo:Q8_0"
    with pytest.raises(ValueError, match="served alone"):
        engine_settings({"MODEL": "hf:org/repo", "IDLE_UNLOAD_SECONDS": 60})


def test_the_named_quantization_and_its_projector_else_q4_k_m_and_the_f16_projector():
    assert choose_files("o/r", FILES, "q8_0", None) == ("Qwen3-1.7B-Q8_0.gguf", "mmproj-Qwen3-1.7B-Q8_0.gguf")
    assert choose_files("o/r", FILES, None, None) == ("Qwen3-1.7B-Q4_K_M.gguf", "mmproj-Qwen3-1.7B-f16.gguf")
    assert choose_files("o/r", FILES, None, "Qwen3-1.7B-BF16.gguf") == ("Qwen3-1.7B-BF16.gguf", "mmproj-Qwen3-1.7B-f16.gguf")
    assert choose_files("o/r", ["only.gguf", "README.md"], None, None) == ("only.gguf", None)
    assert choose_files("o/r", FILES, "Q6_K", None) == ("big/Qwen3-1.7B-Q6_K-00001-of-00002.gguf", "mmproj-Qwen3-1.7B-f16.gguf")


@pytest.mark.parametrize(
    "names, quant, file, message",
    [
        (FILES, "Q2_K", None, "has no Q2_K file; it has BF16, Q4_K_M, Q6_K, Q8_0"),
        (FILES, None, "nope.gguf", "has no file nope.gguf"),
        (FILES, None, "big/Qwen3-1.7B-Q6_K-00002-of-00002.gguf", "not the first part of its split GGUF"),
        (["a-Q8_0.gguf", "b-Q4_0.gguf"], None, None, "has no Q4_K_M file; it has Q4_0, Q8_0"),
        (["README.md"], None, None, "no GGUF model"),
    ],
)
def test_what_cannot_be_chosen_says_why(names, quant, file, message):
    with pytest.raises(ModelLoadError, match=message):
        choose_files("o/r", names, quant, file)
