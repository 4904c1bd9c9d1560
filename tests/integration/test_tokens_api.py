"""/tokenize and /detokenize in llama-server's and vLLM's shapes, over a real connection."""

from support import post, running_server

from webapp import create_app


def test_tokenize_text_messages_and_pieces(fake_server, fake_engine):
    status, _, body = post(fake_server, "/tokenize", {"content": "hi"})
    assert status == 200 and body["tokens"] == [256, *b"hi"] and body["count"] == 3 and body["max_model_len"] == fake_engine.max_context
    assert post(fake_server, "/tokenize", {"prompt": "hi", "add_special_tokens": False})[2]["tokens"] == list(b"hi")
    pieces = post(fake_server, "/tokenize", {"content": "hi", "add_special": False, "with_pieces": True})[2]["tokens"]
    assert pieces == [{"id": 104, "piece": "h"}, {"id": 105, "piece": "i"}]
    chat = post(fake_server, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]})[2]
    prompt = fake_engine.chat_template.render([{"role": "user", "content": "hi"}])
    assert chat["tokens"] == [256, *fake_engine.tokenizer.encode(prompt)]


def test_detokenize_and_its_errors(fake_server):
    status, _, body = post(fake_server, "/detokenize", {"tokens": list(b"hello")})
    assert status == 200 and body == {"content": "hello", "prompt": "hello"}
    for bad in ({"tokens": "x"}, {"tokens": [10**9]}, {"tokens": [-1]}):
        status, _, error = post(fake_server, "/detokenize", bad)
        assert status == 400 and error["error"]["param"] == "tokens"
    status, _, error = post(fake_server, "/tokenize", {"text": "x"})
    assert status == 400 and error["error"]["type"] == "invalid_request_error"


def test_the_api_key_guards_them_too(fake_engine):
    with running_server(create_app({"TESTING": True, "API_KEY": "k"}, engine=fake_engine)) as srv:
        assert post(srv, "/tokenize", {"content": "hi"})[0] == 401
        assert post(srv, "/tokenize", {"content": "hi"}, {"Authorization": "Bearer k"})[0] == 200
