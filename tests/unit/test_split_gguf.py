"""A split GGUF joined into one file (webapp/engine/serving/split_gguf.py): the same metadata, less
the `split.*` keys, and every tensor byte for byte; a part missing, or a later part given first,
refused."""

import numpy as np
import pytest
from support.split_files import write_split
from support.tiny_models import write_tiny_gguf

from webapp.engine.model.gguf import read_gguf
from webapp.engine.serving.split_gguf import join_split, split_parts


def test_three_parts_join_into_the_file_they_were_cut_from(tmp_path):
    original = write_tiny_gguf(str(tmp_path / "m.gguf"), "qwen3", matrix_type="Q8_0", context=256)
    parts = write_split(original, str(tmp_path / "m-Q8_0"), 3)
    assert split_parts(parts[0]) == parts
    joined = join_split(parts[0], str(tmp_path / "joined.gguf"))
    (want_kv, want), (got_kv, got) = read_gguf(original), read_gguf(joined)
    assert got_kv == want_kv and not any(k.startswith("split.") for k in got_kv)
    assert list(got) == list(want)
    for name, tensor in want.items():
        assert got[name].ggml_type == tensor.ggml_type and got[name].shape == tensor.shape
        raw = np.memmap(original, dtype=np.uint8, mode="r")[tensor.start : tensor.start + tensor.nbytes]
        assert np.array_equal(np.memmap(joined, dtype=np.uint8, mode="r")[got[name].start : got[name].start + got[name].nbytes], raw)
    assert not (tmp_path / "joined.gguf.partial").exists()


def test_a_missing_part_or_a_later_part_is_refused(tmp_path):
    original = write_tiny_gguf(str(tmp_path / "m.gguf"), "llama", context=256)
    parts = write_split(original, str(tmp_path / "m"), 2)
    with pytest.raises(ValueError, match="not the first part"):
        split_parts(parts[1])
    (tmp_path / "m-00002-of-00002.gguf").unlink()
    with pytest.raises(ValueError, match="lacks m-00002-of-00002.gguf"):
        join_split(parts[0], str(tmp_path / "j.gguf"))
