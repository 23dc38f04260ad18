"""The OpenAI formats apart from the server: detokenizing deltas, stop strings, validation."""

import pytest

from rlcli.infer.base import Delta
from rlcli.infer.openai import ApiError, Choice, CompletionRequest, decode_request, sampling_params
from rlcli.models.tokenizer import ByteTokenizer

tok = ByteTokenizer()


def feed(choice, ids, finish=None):
    choice.feed(Delta("r", 0, list(ids), [-1.0] * len(ids), [3] * len(ids), finish))
    return choice.take()


def test_a_character_split_over_tokens_is_sent_once_whole():
    c = Choice(0, tok, [])
    euro = list("€".encode())
    assert feed(c, [ord("a"), euro[0]])[0] == "a"
    assert feed(c, [euro[1]])[:2] == ("", [euro[1]])  # still inside the character; the token goes out
    text, ids, _, versions = feed(c, [euro[2], ord("b")])
    assert text == "€b" and ids == [euro[2], ord("b")] and versions == [3, 3]
    assert feed(c, [0xFF], finish="length")[0] == "\ufffd" and c.finish_reason == "length"  # flushed at the end
    assert c.text == tok.decode(c.token_ids)


def test_stop_strings_across_tokens_and_held_back_text():
    c = Choice(0, tok, ["END", "zz"])
    assert feed(c, list(b"abc"))[0] == "a"  # "bc" could still begin "END"
    assert feed(c, list(b"E"))[0] == "b"
    text, ids, _, _ = feed(c, list(b"NDxyz"))
    assert c.finish_reason == "stop" and c.text == "abc" and text == "c"
    assert c.token_ids == list(b"abcEND")  # the tokens up to the one that completed the stop string
    assert feed(c, list(b"more"), finish="length") == ("", [], [], []) and c.finish_reason == "stop"


def test_requests_decode_with_named_errors():
    req = decode_request(b'{"prompt": [1, 2], "n": 2, "user": "ignored"}', CompletionRequest)
    assert req.prompt == [1, 2] and req.n == 2 and req.max_tokens == 16
    for body, match in [(b"{", "malformed JSON"), (b'{"prompt": "a", "n": "two"}', r"\$\.n"),
                        (b'{"n": 2}', "prompt"), (b"[]", "object")]:
        with pytest.raises(ApiError, match=match) as e:
            decode_request(body, CompletionRequest)
        assert e.value.status == 400


@pytest.mark.parametrize("fields, num_prompt, param", [
    ({"temperature": float("nan")}, 4, "temperature"), ({"top_p": 1.5}, 4, "top_p"), ({"n": 1000}, 4, "n"),
    ({"max_tokens": 13}, 4, "max_tokens"), ({}, 16, "prompt"), ({}, 0, "prompt"),
    ({"stop_token_ids": [300]}, 4, "stop_token_ids"), ({"stop": ["a"] * 20}, 4, "stop"),
])
def test_bad_sampling_values_name_the_field(fields, num_prompt, param):
    req = CompletionRequest(prompt="x", **{"max_tokens": 4, **fields})
    with pytest.raises(ApiError) as e:
        sampling_params(req, num_prompt, 16, req.max_tokens, 259)
    assert e.value.status == 400 and e.value.param == param


def test_sampling_defaults_and_mapping():
    req = CompletionRequest(prompt="x", max_tokens=None, stop="\n", seed=7, stop_token_ids=[5], ignore_eos=True)
    sp, stops = sampling_params(req, 4, 16, None, 259)
    assert (sp.max_tokens, sp.temperature, sp.top_p, sp.n, sp.seed) == (12, 1.0, 1.0, 1, 7)
    assert sp.stop_token_ids == [5] and sp.ignore_eos and stops == ["\n"]
