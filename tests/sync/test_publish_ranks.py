"""Publishing from two trainer ranks whose parameters are FSDP2 DTensors (real gloo group):
each rank writes its own shard file, rank 0 marks the directory, and the result equals a
single-process reference; the collective publisher's staged bytes equal it too."""

import os
import socket
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rlcli.models.config import ModelArgs
from rlcli.models.hf_io import build_model, hf_state_dict
from rlcli.transport.collective import as_bytes

pytestmark = pytest.mark.timeout(180)

CFG = {"model_type": "qwen3_moe", "vocab_size": 97, "hidden_size": 64, "intermediate_size": 96,
       "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
       "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True,
       "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False}


def reference():
    model = build_model(ModelArgs.from_hf(CFG))
    model.init_weights(7)
    return model


def rank_main(rank: int, port: int, root: str) -> None:
    from torch.distributed.fsdp import fully_shard

    from rlcli.train.publish import FilesystemPublisher
    from rlcli.train.publish_collective import CollectivePublisher

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    model = reference()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    assert any(isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters())
    cfg = SimpleNamespace(sync=SimpleNamespace(backend=SimpleNamespace(bucket_bytes=4096), ack_timeout_s=30.0),
                          model=SimpleNamespace(path=root, dtype="float32"))
    FilesystemPublisher(cfg, os.path.join(root, "weights"), lambda *a: None).publish(3, model)
    pub = CollectivePublisher(cfg, root, lambda *a: None, torch.device("cpu"))
    pub.stopping.set()  # no store here: stage only
    if rank == 0:
        pub._plan(model)
    pub._stage(model)
    if rank == 0:
        assert pub.staged == len(pub.buckets)  # every bucket marked ready
        torch.save(pub.staging.clone(), os.path.join(root, "staging.pt"))
    dist.barrier()
    dist.destroy_process_group()


def test_two_ranks_with_dtensors_publish_the_reference(tmp_path):
    from rlcli.infer.receiver import load_from_files

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(rank_main, args=(port, str(tmp_path)), nprocs=2, start_method="spawn")
    step_dir = tmp_path / "weights" / "step_3"
    shards = sorted(p.name for p in step_dir.glob("*.safetensors"))
    assert shards == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    ref = reference()
    loaded = build_model(ModelArgs.from_hf(CFG))
    load_from_files(loaded, step_dir)
    expected = hf_state_dict(ref)
    assert all(torch.equal(t, expected[k]) for k, t in hf_state_dict(loaded).items())
    staged = torch.load(tmp_path / "staging.pt")
    assert torch.equal(staged, torch.cat([as_bytes(t.contiguous()) for t in expected.values()]))
