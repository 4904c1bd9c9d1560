"""A reranker file's head (webapp/engine/serving/ranker.py): read from the file in its block format,
scored as llama-server scores (softmax's first label over two or more, the raw logit of one), and a
rank file whose head is missing or malformed refused in one line naming the tensor."""

import gguf
import numpy as np
import pytest

from webapp.engine.model.gguf import read_gguf
from webapp.engine.model.load_error import ModelLoadError
from webapp.engine.serving.ranker import ranker_of

DIM = 64


def write_head(path, weight=None, bias=None, pooling=4, labels=("yes", "no"), prompt="Q: {query} D: {document}", quantized=False):
    w = gguf.GGUFWriter(str(path), "qwen3")
    w.add_uint32("qwen3.pooling_type", pooling)
    if labels:
        w.add_array("qwen3.classifier.output_labels", list(labels))
    if prompt is not None:
        w.add_string("tokenizer.chat_template.rerank", prompt)
    if weight is not None:
        if quantized:
            w.add_tensor(
                "cls.output.weight", gguf.quants.quantize(weight, gguf.GGMLQuantizationType.Q8_0), raw_dtype=gguf.GGMLQuantizationType.Q8_0
            )
        else:
            w.add_tensor("cls.output.weight", weight)
    if bias is not None:
        w.add_tensor("cls.output.bias", bias)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def head_of(path):
    return ranker_of(path, read_gguf(path)[0], DIM)


def test_two_labels_score_the_first_ones_probability_from_a_quantized_head(tmp_path):
    rng = np.random.default_rng(0)
    weight, row = rng.standard_normal((2, DIM)).astype(np.float32), rng.standard_normal(DIM).astype(np.float32)
    ranker = head_of(write_head(tmp_path / "r.gguf", weight, quantized=True))
    assert ranker.labels == ("yes", "no") and ranker.prompt == "Q: {query} D: {document}"
    dequantized = gguf.quants.dequantize(gguf.quants.quantize(weight, gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0)
    logits = dequantized.astype(np.float64) @ row
    assert ranker.score(row) == pytest.approx(1 / (1 + np.exp(logits[1] - logits[0])), rel=1e-9)


def test_one_label_with_a_bias_is_the_raw_logit_and_a_prompt_without_its_places_is_not_used(tmp_path):
    rng = np.random.default_rng(1)
    weight, bias, row = rng.standard_normal((1, DIM)).astype(np.float32), np.float32([0.5]), rng.standard_normal(DIM)
    ranker = head_of(write_head(tmp_path / "r.gguf", weight, bias, labels=(), prompt="no places here"))
    assert ranker.prompt is None
    assert ranker.score(row) == pytest.approx(float(weight[0].astype(np.float64) @ row + 0.5), rel=1e-9)


def test_a_file_that_is_not_a_reranker_has_no_head(tmp_path):
    assert head_of(write_head(tmp_path / "r.gguf", np.ones((2, DIM), np.float32), pooling=1)) is None


@pytest.mark.parametrize(
    "weight, bias, message",
    [
        (None, None, "cls.output.weight is missing"),
        (np.ones((2, DIM + 1), np.float32), None, "has shape (2, 65)"),
        (np.ones((65, DIM), np.float32), None, "has shape (65, 64)"),
        (np.ones((2, DIM), np.float32), np.ones(3, np.float32), "cls.output.bias has shape (3,)"),
        (np.full((2, DIM), np.inf, np.float32), None, "not finite"),
    ],
)
def test_a_rank_file_with_a_broken_head_is_refused_in_one_line(tmp_path, weight, bias, message):
    with pytest.raises(ModelLoadError, match=message.replace("(", r"\(").replace(")", r"\)")):
        head_of(write_head(tmp_path / "r.gguf", weight, bias))
