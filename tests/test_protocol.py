import msgspec
import numpy as np
import pytest

from rlcli.protocol import (
    PROTOCOL_VERSION, Completion, GenerateRequest, GenerateResponse, SamplingParams, WireTensor, decode, encode,
)
from rlcli.protocol.batch import Sample, build_micro_batch, pack_rows, split_rows


def test_round_trip():
    req = GenerateRequest(request_id="r1", prompt_ids=[1, 2, 3], sampling=SamplingParams(n=4, top_p=0.9),
                          cache_salt="v3")
    assert decode(encode(req)) == req
    resp = GenerateResponse(request_id="r1", num_prompt_tokens=3, completions=[
        Completion(token_ids=[5], logprobs=[-0.5], versions=[3], finish_reason="stop",
                   routed_experts=WireTensor.from_numpy(np.arange(6, dtype=np.uint8).reshape(1, 2, 3)))])
    back = decode(encode(resp))
    assert back == resp
    assert back.completions[0].routed_experts.numpy().tolist() == [[[0, 1, 2], [3, 4, 5]]]


def test_other_protocol_version_is_refused():
    data = msgspec.msgpack.encode({"type": "generate", "protocol": PROTOCOL_VERSION + 1, "request_id": "x",
                                   "prompt_ids": [1]})
    with pytest.raises(ValueError, match="protocol version"):
        decode(data)


@pytest.mark.parametrize("payload", [b"\x00garbage", msgspec.msgpack.encode({"type": "nope", "protocol": 1}),
                                     msgspec.msgpack.encode({"type": "generate", "protocol": 1})])
def test_malformed_messages_raise_valueerror(payload):
    with pytest.raises(ValueError):
        decode(payload)


def test_bfloat16_wire_tensor():
    import torch

    t = torch.randn(3, 4).to(torch.bfloat16)
    w = WireTensor(t.view(torch.uint16).numpy().tobytes(), "bfloat16", [3, 4])
    back = torch.from_numpy(w.numpy().copy()).view(torch.bfloat16)
    assert torch.equal(back, t)


def test_packing_fits_capacity_and_keeps_every_sequence():
    lengths = [7, 3, 9, 2, 5, 5, 1, 10]
    rows = pack_rows(lengths, 10)
    assert sorted(i for r in rows for i in r) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in r) <= 10 for r in rows)
    assert len(rows) == 5  # 42 tokens need at least 5 rows of 10
    ranks = split_rows(rows, lengths, 2)
    loads = [sum(lengths[i] for r in rk for i in r) for rk in ranks]
    assert sum(loads) == sum(lengths) and abs(loads[0] - loads[1]) <= 10
    with pytest.raises(ValueError, match="micro_batch_tokens"):
        pack_rows([11], 10)


def test_micro_batch_layout():
    s1 = Sample(token_ids=[1, 2, 3, 4], num_prompt_tokens=2, advantage=0.5, logprobs=[-1.0, -2.0], versions=[3, 4])
    s2 = Sample(token_ids=[7, 8, 9], num_prompt_tokens=1, advantage=-1.0, logprobs=[-0.1, -0.2], versions=[4, 4])
    mb = build_micro_batch([s1, s2], temperature=0.7)
    assert mb.input_ids.numpy().tolist() == [1, 2, 3, 4, 7, 8, 9]
    assert mb.position_ids.numpy().tolist() == [0, 1, 2, 3, 0, 1, 2]
    assert mb.loss_mask.numpy().tolist() == [False, False, True, True, False, True, True]
    assert mb.advantages.numpy().tolist() == [0, 0, 0.5, 0.5, 0, -1, -1]
    assert np.allclose(mb.inference_logprobs.numpy(), [0, 0, -1, -2, 0, -0.1, -0.2])
    assert mb.versions.numpy().tolist() == [-1, -1, 3, 4, -1, 4, 4]
    assert mb.temperature == 0.7 and mb.num_samples == 2


@pytest.mark.parametrize("bad", [{"temperature": float("nan")}, {"temperature": -1.0}, {"temperature": float("inf")},
                                 {"top_p": 0.0}, {"top_p": float("nan")}, {"top_p": 1.5}, {"n": 0},
                                 {"max_tokens": 0}, {"seed": -1}])
def test_insane_sampling_values_are_refused_on_decode(bad):
    good = encode(GenerateRequest(request_id="r", prompt_ids=[1], sampling=SamplingParams()))
    tree = msgspec.msgpack.decode(good)
    tree["sampling"].update(bad)
    with pytest.raises(ValueError, match="sampling"):
        decode(msgspec.msgpack.encode(tree))
