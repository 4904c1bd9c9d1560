"""The draft model (LLM_DRAFT_MODEL) on tiny random models: the same model as its own draft has every
greedy draft confirmed, alone, several at once, with slots reused and prompt prefixes copied between
slots (so its lazily filled cache holds what the served model's does), and gives plain decoding's
tokens; a file of another vocabulary, a target whose steps do not verify drafts, a draft whose
steps cannot be one call each are refused at load in one line naming the files. A recurrent draft
(qwen35) drafts what a fresh prefill of its sequence would, however often it is asked, and as its own
draft has every greedy draft confirmed too."""

import numpy as np
import pytest
from support import drain_outputs, wait_until
from support.tiny_models import write_tiny_gguf
from support.tiny_qwen35 import write_tiny_qwen35

from webapp.engine.decoding.drafts import StepCosts
from webapp.engine.decoding.sampling_params import SamplingParams
from webapp.engine.model.load_error import ModelLoadError
from webapp.engine.model.tinygrad_setup import use_tinygrad_from_this_thread
from webapp.engine.serving.engine import Engine
from webapp.engine.serving.loader import load_gguf_model
from webapp.engine.serving.request import Request
from webapp.engine.serving.settings import engine_settings


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    return write_tiny_gguf(str(tmp_path_factory.mktemp("draft") / "target.gguf"), "llama", matrix_type="Q4_1")


def self_drafting_engine(path: str) -> Engine:
    """An engine serving `path` with the same file as its draft model."""
    use_tinygrad_from_this_thread()
    eng = Engine(lambda: load_gguf_model(path, 4, 256, 8, draft=path), slots=4, queue_limit=16, prefill_chunk=8).start()
    assert wait_until(lambda: eng.state != "loading", timeout=300)
    assert eng.state == "ok", eng.error
    eng.loaded.runner.draft.step_cost = 0.0  # the draft costs what the served model does: asked whenever acceptance allows
    # drafted lanes priced as free: every draft the acceptance allows is asked for, six sequences at
    # once too (how much is drafted is then neither this machine's timings of a tiny model nor the
    # margin a step of many sequences asks of a draft)
    eng.speculation.costs = lambda runner: StepCosts([1.0] * 9)
    return eng


@pytest.fixture(scope="module")
def engine(target):
    eng = self_drafting_engine(target)
    yield eng
    eng.stop(5)


def prompts(n: int, shared: int = 0) -> list[list[int]]:
    """Random prompts of distinct tokens (prompt lookup finds no repeat in them), sharing a prefix of `shared`."""
    rng = np.random.default_rng(n + shared)
    common = rng.choice(np.arange(300, 40000), size=shared, replace=False).tolist()
    return [common + rng.choice(np.arange(300, 40000), size=12 + i, replace=False).tolist() for i in range(n)]


def generate(engine, speculate: bool, batch: list[list[int]], **sampling) -> list[tuple[list[int], Request]]:
    engine.speculation.enabled = speculate
    engine.speculation.recent = type(engine.speculation.recent)()  # earlier answers drafted nothing
    requests = [Request(p, SamplingParams(max_tokens=30, **sampling)) for p in batch]
    for request in requests:
        engine.submit(request)
    return [(drain_outputs(r, timeout=120, reraise=True)[0], r) for r in requests]


def check_every_greedy_draft_is_confirmed(engine, batch: list[list[int]]) -> None:
    plain = [tokens for tokens, _ in generate(engine, False, batch, temperature=0.0)]
    drafted = generate(engine, True, batch, temperature=0.0)
    assert [tokens for tokens, _ in drafted] == plain
    counts = [(r.drafted_tokens, r.accepted_tokens) for _, r in drafted]
    assert all(d > 0 and a == d for d, a in counts) and sum(d for d, _ in counts) > 10 * len(batch), counts


def check_sampled_tokens_are_plain_decodings(engine, batch: list[list[int]]) -> None:
    plain = [tokens for tokens, _ in generate(engine, False, batch, temperature=0.8, seed=4, top_p=0.9)]
    assert [tokens for tokens, _ in generate(engine, True, batch, temperature=0.8, seed=4, top_p=0.9)] == plain


@pytest.mark.parametrize(("n", "shared"), [(1, 0), (6, 0), (6, 40)])  # alone; beside others, slots reused; a long shared prefix
def test_the_same_model_as_draft_has_every_greedy_draft_confirmed(engine, n, shared):
    check_every_greedy_draft_is_confirmed(engine, prompts(n, shared))


def test_sampled_requests_get_plain_decodings_tokens_with_the_draft(engine):
    check_sampled_tokens_are_plain_decodings(engine, prompts(5))


def test_a_draft_of_another_vocabulary_is_refused_naming_both_files(target, tmp_path):
    use_tinygrad_from_this_thread()
    other = write_tiny_gguf(str(tmp_path / "other-vocab.gguf"), "llama", matrix_type="Q4_1", renamed_tokens={4000: "zebra!"})
    with pytest.raises(ModelLoadError, match=r"other-vocab\.gguf and target\.gguf have different vocabularies \(token 4000 is 'zebra!'"):
        load_gguf_model(target, 2, 256, 8, draft=other)


def test_a_draft_is_refused_where_drafts_cannot_be_verified_or_run_in_one_call(target, tmp_path):
    use_tinygrad_from_this_thread()  # loads on this thread, after the engine's model thread
    with pytest.raises(ModelLoadError, match=r"LLM_DRAFT_MODEL=target\.gguf: drafts are verified only where a step is one call"):
        load_gguf_model(target, 2, 256, 8, cpu_kernels=False, draft=target)
    jitted = write_tiny_gguf(str(tmp_path / "jitted.gguf"), "llama", matrix_type="Q4_1", float_matrices=("ffn_down.weight",))
    with pytest.raises(ModelLoadError, match=r"jitted\.gguf has matrices the CPU kernels do not read"):
        load_gguf_model(target, 2, 256, 8, draft=jitted)


def test_the_setting_names_a_file_and_is_ignored_without_speculation(target, tmp_path):
    assert engine_settings({"MODEL": target, "DRAFT_MODEL": target}).draft == target
    assert engine_settings({"MODEL": target, "DRAFT_MODEL": target, "SPECULATIVE": "false"}).draft is None
    with pytest.raises(FileNotFoundError, match="LLM_DRAFT_MODEL="):
        engine_settings({"MODEL": target, "DRAFT_MODEL": str(tmp_path / "missing.gguf")})


@pytest.fixture(scope="module")
def recurrent_file(tmp_path_factory) -> str:
    return write_tiny_qwen35(str(tmp_path_factory.mktemp("draft") / "q35.gguf"), matrix_type="Q8_0")


def greedy_continuation(steps, sequence: list[int], k: int, slot: int) -> list[int]:
    """k argmax tokens after `sequence`, each from a prefill of everything before it in `slot`."""
    out = []
    for _ in range(k):
        out.append(int(np.argmax(steps.prefill(sequence + out, slot, 0))))
    return out


def test_a_recurrent_draft_drafts_what_a_fresh_prefill_would_call_after_call(recurrent_file):
    """Ten sequences ask at once, more lanes than the draft's rows of state (the last two then draft
    one token); then each goes on by kept drafts and a sample, by a sample alone, or parts from its
    slot's tokens: every draft is the draft model's own greedy continuation of its sequence, so a
    slot's state holds exactly what was fed to it, whatever the one-token steps took in."""
    use_tinygrad_from_this_thread()
    draft = load_gguf_model(recurrent_file, 10, 256, 8, draft=recurrent_file).runner.draft
    assert draft.draft_rows is not None and len(draft.draft_rows) == 8
    scratch = draft.steps.model.slots
    rng = np.random.default_rng(5)
    # short enough that all ten are fed in one call (CATCH_UP tokens)
    sequences = [rng.choice(np.arange(300, 40000), size=3, replace=False).tolist() for _ in range(11)]

    def drafts(asks):
        got = draft.continue_greedy(asks)
        for (_, sequence, _), tokens in zip(asks, got, strict=True):
            assert tokens == greedy_continuation(draft.steps, sequence, len(tokens), scratch)
        return got

    first = drafts([(slot, sequences[slot], 4) for slot in range(10)])
    assert [len(t) for t in first] == [4] * 8 + [1, 1]
    # slots 0-3 keep two drafts and a sample, 4-7 none but the sample, 8 starts another sequence, 9 its own prefix
    nexts = [sequences[s] + first[s][:2] + [77] for s in range(4)] + [sequences[s] + [5] for s in range(4, 8)]
    nexts += [sequences[10], sequences[9][:2]]
    assert [len(t) for t in drafts([(slot, sequence, 3) for slot, sequence in enumerate(nexts)])] == [3] * 8 + [1, 1]


def test_a_recurrent_draft_takes_a_repeated_prompts_state_from_its_snapshot(recurrent_file):
    """A 40-token sequence is caught up in two calls, the second stopping a token short, where the
    slot's state is kept; the same prompt again with another last token, in its slot or another,
    drafts at once (its 39 tokens restored, not fed again), each draft a fresh prefill's greedy one."""
    use_tinygrad_from_this_thread()
    draft = load_gguf_model(recurrent_file, 3, 256, 8, draft=recurrent_file).runner.draft
    scratch = draft.steps.model.slots
    prompt = np.random.default_rng(6).choice(np.arange(300, 40000), size=39, replace=False).tolist()
    first = prompt + [11]
    assert draft.continue_greedy([(0, first, 3)]) == [[]]  # CATCH_UP tokens
    assert draft.continue_greedy([(0, first, 3)]) == [[]]  # up to the snapshot, a token short
    assert draft.snapshots == {0: prompt}
    assert draft.continue_greedy([(0, first, 3)]) == [greedy_continuation(draft.steps, first, 3, scratch)]
    for slot, last in ((0, 12), (1, 13)):  # in place, then copied to another slot
        again = prompt + [last]
        assert draft.continue_greedy([(slot, again, 3)]) == [greedy_continuation(draft.steps, again, 3, scratch)]
    # a sequence that parts inside the prompt starts over
    other = prompt[:20] + [5] * 20
    assert draft.continue_greedy([(2, other, 2)]) == [[]]


@pytest.fixture(scope="module")
def recurrent_engine(recurrent_file):
    eng = self_drafting_engine(recurrent_file)
    yield eng
    eng.stop(5)


@pytest.mark.parametrize(("n", "shared"), [(1, 0), (4, 0), (3, 40)])  # the last twice: snapshots of the long prompts serve
def test_a_recurrent_model_as_its_own_draft_has_every_greedy_draft_confirmed(recurrent_engine, n, shared):
    for _ in range(2 if shared else 1):
        check_every_greedy_draft_is_confirmed(recurrent_engine, prompts(n, shared))
    assert bool(recurrent_engine.loaded.runner.draft.snapshots) == bool(shared)


def test_sampled_requests_get_plain_decodings_tokens_with_a_recurrent_draft(recurrent_engine):
    check_sampled_tokens_are_plain_decodings(recurrent_engine, prompts(4))
