"""Where a chat's messages end in its prompt's tokens (generation.message_ends), with the default
model's template and tokenizer: the positions a recurrent model snapshots its state at."""

from types import SimpleNamespace

from webapp.engine.text.chat_template import ChatTemplate
from webapp.http.generation import encode, message_ends, render_chat

SYSTEM = {"role": "system", "content": "You are a museum guide. Answer in one sentence."}
CHAT = [
    SYSTEM,
    {"role": "user", "content": "Where are the fossils?"},
    {"role": "assistant", "content": "In the east hall."},
    {"role": "user", "content": "And the telescopes?"},
]


def _engine(smollm2_kv, smollm2_tokenizer):
    template = ChatTemplate(smollm2_kv["tokenizer.chat_template"], bos_token="<|im_start|>", eos_token="<|im_end|>")
    return SimpleNamespace(chat_template=template, tokenizer=smollm2_tokenizer)


def _ends(engine, messages):
    prompt = render_chat(engine.chat_template, messages, None)
    ids = encode(engine.tokenizer, prompt)
    return ids, message_ends(engine, messages, None, prompt, ids)


def test_the_system_prompt_the_last_user_message_and_the_generation_prompt(smollm2_kv, smollm2_tokenizer):
    engine = _engine(smollm2_kv, smollm2_tokenizer)
    ids, ends = _ends(engine, CHAT)
    assert len(ends) == 3
    for end, count in zip(ends, (1, 3, 4), strict=True):  # each a prefix of the prompt's own tokens
        assert ids[:end] == encode(engine.tokenizer, render_chat(engine.chat_template, CHAT[:count], None, generation=False))
    assert engine.tokenizer.decode(ids[ends[-1] :]).strip() == "<|im_start|>assistant"
    # the next turn's prompt starts with everything before this one's generation prompt
    next_turn, _ = _ends(engine, [*CHAT, {"role": "assistant", "content": "Upstairs."}, {"role": "user", "content": "Thanks."}])
    assert next_turn[: ends[-1]] == ids[: ends[-1]]


def test_one_question_without_a_system_message(smollm2_kv, smollm2_tokenizer):
    engine = _engine(smollm2_kv, smollm2_tokenizer)
    ids, ends = _ends(engine, [CHAT[1]])  # the template writes its default system prompt
    assert len(ends) == 1 and 0 < ends[0] < len(ids)
