"""/tokenize and /detokenize in llama-server's and vLLM's shapes, over a real connection."""

from conftest import post

from webapp import create_app


def test_tokenize_text_messages_and_pieces(server, engine):
    status, _, body = post(server, "/tokenize", {"content": "hi"})
    assert status == 200 and body["tokens"] == [256, *b"hi"] and body["count"] == 3 and body["max_model_len"] == engine.max_context
    assert post(server, "/tokenize", {"prompt": "hi", "add_special_tokens": False})[2]["tokens"] == list(b"hi")
    pieces = post(server, "/tokenize", {"content": "hi", "add_special": False, "with_pieces": True})[2]["tokens"]
    assert pieces == [{"id": 104, "piece": "h"}, {"id": 105, "piece": "i"}]
    chat = post(server, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]})[2]
    prompt = engine.chat_template.render([{"role": "user", "content": "hi"}])
    assert chat["tokens"] == [256, *engine.tokenizer.encode(prompt)]


def test_detokenize_and_its_errors(server):
    status, _, body = post(server, "/detokenize", {"tokens": list(b"hello")})
    assert status == 200 and body == {"content": "hello", "prompt": "hello"}
    for bad in ({"tokens": "x"}, {"tokens": [10**9]}, {"tokens": [-1]}):
        status, _, error = post(server, "/detokenize", bad)
        assert status == 400 and error["error"]["param"] == "tokens"
    status, _, error = post(server, "/tokenize", {"text": "x"})
    assert status == 400 and error["error"]["type"] == "invalid_request_error"


def test_the_api_key_guards_them_too(engine):
    from conftest import running_server

    with running_server(create_app({"TESTING": True, "API_KEY": "k"}, engine=engine)) as srv:
        assert post(srv, "/tokenize", {"content": "hi"})[0] == 401
        assert post(srv, "/tokenize", {"content": "hi"}, {"Authorization": "Bearer k"})[0] == 200
