"""Scheduling policy with a fake model: admission, chunked prefill interleaving, slot choice, retire, abort."""

import numpy as np
import pytest
from support import drain_outputs, engine_over, wait_until
from support.fakes import FakeRunner

from webapp.engine.decoding.sampling_params import SamplingParams
from webapp.engine.serving.engine import QueueFull
from webapp.engine.serving.errors import PromptTooLong
from webapp.engine.serving.kv_cache import RingRows, SlotTable
from webapp.engine.serving.request import Request, Status
from webapp.engine.serving.scheduler import Scheduler, whole_images
from webapp.engine.vision.vision import ImageSpan, PreparedImage

VOCAB = 50


def request(prompt, max_tokens=3):
    return Request(list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0.0))


@pytest.fixture
def two_slot_engine():
    """The real engine over a FakeRunner: two slots, a queue of 3, prefill chunks of 4, 64 positions."""
    with engine_over(FakeRunner(vocab=VOCAB, step_s=0.005), context=64, slots=2, queue_limit=3, prefill_chunk=4) as eng:
        yield eng


def test_slot_choice_prefers_the_longest_cached_prefix_then_lru():
    table = SlotTable(3)
    a, _ = table.acquire("a", [1, 2, 3, 4])
    a.tokens[:] = [1, 2, 3, 4]
    b, _ = table.acquire("b", [9, 9])
    b.tokens[:] = [9, 9]
    table.release(a)
    table.release(b)
    slot, reused = table.acquire("c", [1, 2, 3, 7, 8])
    assert (slot.index, reused) == (a.index, 3)
    assert slot.tokens == [1, 2, 3]  # the diverging tail is dropped
    table.release(slot)
    # no prefix anywhere: the least recently used slot (never used: index 2, then b) is evicted
    slot, reused = table.acquire("d", [5, 5])
    assert (slot.index, reused) == (2, 0)
    slot2, _ = table.acquire("e", [6, 6])
    assert slot2.index == b.index


def test_the_last_prompt_token_is_always_prefilled():
    table = SlotTable(1)
    s, _ = table.acquire("a", [1, 2, 3])
    s.tokens[:] = [1, 2, 3, 4]
    table.release(s)
    _, reused = table.acquire("b", [1, 2, 3])
    assert reused == 2


def test_a_ring_serves_a_prefix_only_near_the_furthest_its_slot_went():
    """Sliding-window rings (keep 3, whole 10): a prefix is cached while it ends at most 3 positions
    before the slot's reach, or anywhere in a slot that never passed 10 positions; a slot restarted
    from position 0 forgets how far it went before."""
    table = SlotTable(1, RingRows(keep=3, whole=10))
    prompt = list(range(20))
    s, _ = table.acquire("a", prompt)
    s.tokens[:] = prompt
    table.release(s)
    assert table.reusable(s, prompt[:17] + [99]) == 17  # 20 - 17 <= 3
    assert table.reusable(s, prompt[:16] + [99]) == 0  # the ring no longer holds what position 16 needs
    s, reused = table.acquire("b", prompt[:17] + [99, 98])
    assert reused == 17 and s.reach == 20  # cut back to 17, but its rings went to 20
    table.release(s)
    s, reused = table.acquire("c", [5, 6, 7])
    assert reused == 0 and s.reach == 0
    s.tokens[:] = [5, 6, 7, 8]
    table.release(s)
    assert table.reusable(s, [5, 6, 7, 9]) == 3 and table.reusable(s, [5, 9]) == 1  # within `whole`: all kept


def test_a_prefix_copied_from_a_ring_takes_how_far_its_source_went():
    sched = Scheduler(SlotTable(2, RingRows(keep=3, whole=10)), prefill_chunk=64)
    source, _ = sched.slots.acquire("a", list(range(30)))
    source.tokens[:] = list(range(30))
    target = request(list(range(28)) + [99])
    sched.add(target)
    sched.admit()
    assert sched.prefix_elsewhere(target) == (source, 28)
    sched.copied(target, 28, source)
    assert sched.slot_of(target).reach == 30


def test_a_request_not_ready_lets_those_behind_it_pass():
    """An image still encoding (Runner.ready) holds its own admission, not the queue's."""
    sched = Scheduler(SlotTable(2), prefill_chunk=4)
    encoding, text = request([1, 2]), request([3, 4])
    sched.add(encoding)
    sched.add(text)
    sched.ready = lambda r: r is not encoding
    assert sched.admit() == [text] and list(sched.waiting) == [encoding]
    sched.ready = lambda r: True
    assert sched.admit() == [encoding]


def test_admission_is_fcfs_and_bounded_by_slots():
    sched = Scheduler(SlotTable(2), prefill_chunk=4)
    reqs = [request([i, i]) for i in range(3)]
    for r in reqs:
        sched.add(r)
    assert sched.admit() == reqs[:2]
    assert list(sched.waiting) == reqs[2:]
    assert reqs[0].status is Status.PREFILL


def test_prefill_is_chunked_and_interleaved_with_decode(two_slot_engine):
    runner = two_slot_engine.loaded.runner
    short = request([1, 2], max_tokens=40)
    two_slot_engine.submit(short)
    assert isinstance(short.outputs.get(timeout=5), int)  # short is decoding now
    long = request(list(range(20, 33)), max_tokens=2)  # 13 tokens: chunks of 4, 4, 4, 1
    two_slot_engine.submit(long)
    drain_outputs(long)
    drain_outputs(short)
    prefills = [c for c in runner.calls if c[0] == "prefill" and c[1] == long.id]
    assert [(c[2], c[3]) for c in prefills] == [(0, 4), (4, 4), (8, 4), (12, 1)]
    # between the long prompt's chunks, the short request kept decoding
    first, last = runner.calls.index(prefills[0]), runner.calls.index(prefills[-1])
    between = [c for c in runner.calls[first:last] if c[0] == "decode" and short.id in c[1]]
    assert len(between) >= 3


def test_a_mixing_runner_gets_each_chunk_with_the_decode_step():
    """Where the runner mixes steps, a prompt chunk and the running requests' tokens are one call,
    and every token is the one separate calls give."""
    with engine_over(FakeRunner(vocab=VOCAB, step_s=0.005, mixes=True), context=64, slots=2, queue_limit=3, prefill_chunk=4) as engine:
        short = request([1, 2], max_tokens=40)
        engine.submit(short)
        assert isinstance(short.outputs.get(timeout=5), int)  # short is decoding now
        long = request(list(range(20, 33)), max_tokens=3)
        engine.submit(long)
        assert drain_outputs(long) == ([33, 34, 35], "length")
        assert drain_outputs(short)[0][-1] == (2 + 40) % VOCAB
        chunks = [c for c in engine.loaded.runner.calls if c[0] in ("prefill", "mixed") and long.id in str(c[1])]
        assert chunks == [("mixed", ((long.id, start, n),), (short.id,)) for start, n in [(0, 4), (4, 4), (8, 4), (12, 1)]]


def test_an_image_attended_both_ways_is_never_cut_across_chunks():
    """Gemma 3's image (PreparedImage.both_ways) runs in one chunk: the chunk before it stops at its
    first position, its own chunk takes all of it over the budget; a causal family's image is cut
    like text. And a chunk starting inside such an image (a cached prefix ending there) takes the rest."""
    pixels = np.zeros((3, 2, 2), np.float32)
    for both_ways, want in ((True, [(0, 3), (3, 6), (9, 4), (13, 1)]), (False, [(0, 4), (4, 4), (8, 4), (12, 2)])):
        with engine_over(FakeRunner(vocab=VOCAB), context=64, slots=2, queue_limit=3, prefill_chunk=4) as engine:
            prompt = request([1, 2, 3] + [VOCAB + 1] * 6 + list(range(4, 9)), max_tokens=1)
            prompt.images = (ImageSpan(3, PreparedImage(pixels, b"d", 6, both_ways=both_ways)),)
            engine.submit(prompt)
            drain_outputs(prompt)
            assert [c[2:] for c in engine.loaded.runner.calls if c[0] == "prefill"] == want
    image = (ImageSpan(3, PreparedImage(pixels, b"d", 6, both_ways=True)),)
    inside = request([0] * 14)
    inside.images = image
    assert [whole_images(inside, 5, end) for end in (6, 9, 12)] == [9, 9, 12]
    assert [whole_images(inside, 2, end, grow=False) for end in (5, 3)] == [3, 3]
    assert whole_images(inside, 5, 7, grow=False) == 5  # no room for the image's rest: nothing this step


def test_a_mixing_runner_gets_several_prompts_in_one_step_within_the_budget():
    runner = FakeRunner(vocab=VOCAB, mixes=True)
    with engine_over(runner, context=64, slots=4, queue_limit=4, prefill_chunk=8) as engine:
        runner.gate.clear()  # admit all three before any step runs
        prompts = [request([1, 10 + i, 20 + i], max_tokens=2) for i in range(2)] + [request(list(range(30, 36)), max_tokens=2)]
        for r in prompts:
            engine.submit(r)
        assert wait_until(lambda: len(engine.scheduler.running) == 3)
        runner.gate.set()
        assert [drain_outputs(r)[0] for r in prompts] == [[21, 22], [22, 23], [36, 37]]
        first = [c for c in runner.calls if c[0] == "mixed"][0]
        a, b, c = (r.id for r in prompts)
        assert first == ("mixed", ((a, 0, 3), (b, 0, 3), (c, 0, 2)), ())  # 8 tokens: the third one's first 2


def test_a_failing_mixed_step_runs_again_apart():
    runner = FakeRunner(vocab=VOCAB, step_s=0.005, mixes=True)

    def broken(*args):
        raise RuntimeError("injected mixed-step fault")

    runner.prefill_and_decode = broken
    with engine_over(runner, context=64, slots=2, queue_limit=3, prefill_chunk=4) as engine:
        short = request([1, 2], max_tokens=20)
        engine.submit(short)
        assert isinstance(short.outputs.get(timeout=5), int)
        long = request(list(range(20, 27)), max_tokens=3)
        engine.submit(long)
        assert drain_outputs(long) == ([27, 28, 29], "length")
        assert drain_outputs(short)[1] == "length"
        assert [c for c in runner.calls if c[0] == "prefill" and c[1] == long.id] == [
            ("prefill", long.id, 0, 4),
            ("prefill", long.id, 4, 3),
        ]


def test_retire_on_length_and_tokens_follow_the_model(two_slot_engine):
    r = request([5], max_tokens=4)
    two_slot_engine.submit(r)
    assert drain_outputs(r) == ([6, 7, 8, 9], "length")
    assert r.status is Status.FINISHED and all(s.owner is None for s in two_slot_engine.scheduler.slots.slots)


def test_abort_of_a_waiting_request_and_queue_limit(two_slot_engine):
    two_slot_engine.loaded.runner.gate.clear()  # freeze the model thread inside its next call
    running = [request([1, i], max_tokens=50) for i in range(2)]
    for r in running:
        two_slot_engine.submit(r)
    waiting = [request([2, i]) for i in range(3)]
    assert wait_until(lambda: all(r.admitted_at for r in running))
    for r in waiting:
        two_slot_engine.submit(r)
    with pytest.raises(QueueFull):
        two_slot_engine.submit(request([3, 3]))
    two_slot_engine.abort(waiting[0])
    for r in running:
        two_slot_engine.abort(r)
    two_slot_engine.loaded.runner.gate.set()
    assert drain_outputs(waiting[0])[1] == "cancelled"
    assert [drain_outputs(r)[1] for r in running] == ["cancelled", "cancelled"]
    assert [drain_outputs(r)[1] for r in waiting[1:]] == ["length", "length"]
    assert two_slot_engine.stats()["requests_total"]["rejected"] == 1
    assert two_slot_engine._waiting == 0


def test_a_prompt_that_leaves_no_room_is_refused_at_submit(two_slot_engine):
    with pytest.raises(PromptTooLong, match="maximum context length is 64"):
        two_slot_engine.submit(request(range(1, 65)))  # 64 tokens in a 64-token context
    assert two_slot_engine.stats()["queue_depth"] == 0
    last = request(range(1, 64), max_tokens=5)
    two_slot_engine.submit(last)
    tokens, reason = drain_outputs(last)
    assert reason == "length" and len(tokens) == 1  # 63 + 1 fills the context


def test_an_embedding_computes_every_position_alone_and_pools_them():
    """An embedding request reuses no cached prefix, never mixes into a decode step, pools every
    position's hidden state (the fake's rows are (token, position, 1, 0)) and frees its slot."""
    runner = FakeRunner(vocab=VOCAB, step_s=0.002, mixes=True)
    with engine_over(runner, context=64, slots=2, queue_limit=4, prefill_chunk=4) as engine:
        chat = request([1, 2, 3, 4, 5], max_tokens=30)
        engine.submit(chat)
        assert isinstance(chat.outputs.get(timeout=5), int)  # decoding now, its prompt cached in its slot
        mean = Request([1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=0), pooling="mean")
        last = Request([1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=0), pooling="last")
        for r in (mean, last):
            engine.submit(r)
            assert drain_outputs(r) == ([], "stop")
        assert mean.embedding.tolist() == [3.5, 2.5, 1.0, 0.0] and last.embedding.tolist() == [6, 5, 1, 0]
        assert (mean.cached_tokens, last.cached_tokens) == (0, 0)
        hidden = [c for c in runner.calls if c[0] == "hidden"]
        assert hidden == [("hidden", r.id, start, n) for r in (mean, last) for start, n in [(0, 4), (4, 2)]]
        assert not [c for c in runner.calls if c[0] == "mixed" and mean.id in str(c[1])]
        drain_outputs(chat)
        assert wait_until(lambda: not engine.scheduler.running)
