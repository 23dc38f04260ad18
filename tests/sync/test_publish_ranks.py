"""Publishing from two trainer ranks whose parameters are FSDP2 DTensors (real gloo group):
each rank writes its own shard file, rank 0 marks the directory, and the result equals a
single-process reference; the collective publisher's staged bytes equal it too. With
train.fp8.publish the FP8 linears' weights + scales equal a single process's save_model(fp8=True)."""

import json
import os
import socket
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rlcli.models.config import ModelArgs
from rlcli.models.hf_io import build_model, hf_state_dict, save_model
from rlcli.models.safetensors_io import iter_tensors
from rlcli.transport.collective import as_bytes

pytestmark = pytest.mark.timeout(180)

CFG = {"model_type": "qwen3_moe", "vocab_size": 97, "hidden_size": 64, "intermediate_size": 96,
       "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
       "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True,
       "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False}


FP8 = SimpleNamespace(enabled=True, publish=True, backend="emulated", include=["*"],
                      exclude=["*embed_tokens", "lm_head", "*.mlp.gate"], ue8m0=False)


def reference(fp8: bool = False):
    model = build_model(ModelArgs.from_hf(CFG))
    model.init_weights(7)
    if fp8:
        from rlcli.ops.fp8.convert import convert_to_fp8

        convert_to_fp8(model, FP8, device="cpu")
    return model


def sharded(fp8: bool = False):
    from torch.distributed.fsdp import fully_shard

    model = reference(fp8)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def rank_main(rank: int, port: int, root: str) -> None:
    from rlcli.train.publish import FilesystemPublisher
    from rlcli.train.publish_collective import CollectivePublisher

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    model = sharded()
    assert any(isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters())
    cfg = SimpleNamespace(sync=SimpleNamespace(backend=SimpleNamespace(bucket_bytes=4096), ack_timeout_s=30.0),
                          model=SimpleNamespace(path=root, dtype="float32"),
                          train=SimpleNamespace(fp8=SimpleNamespace(enabled=False, publish=False)),
                          infer=SimpleNamespace(fp8=SimpleNamespace(enabled=False)))
    FilesystemPublisher(cfg, os.path.join(root, "weights"), lambda *a: None).publish(3, model)
    cfg8 = SimpleNamespace(model=cfg.model, train=SimpleNamespace(fp8=FP8))
    FilesystemPublisher(cfg8, os.path.join(root, "weights_fp8"), lambda *a: None).publish(3, sharded(fp8=True))
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
    index = json.loads((step_dir / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 2  # huggingface_hub's split, dealt to both ranks
    ref = reference()
    loaded = build_model(ModelArgs.from_hf(CFG))
    load_from_files(loaded, step_dir)
    expected = hf_state_dict(ref)
    assert all(torch.equal(t, expected[k]) for k, t in hf_state_dict(loaded).items())
    staged = torch.load(tmp_path / "staging.pt")
    assert torch.equal(staged, torch.cat([as_bytes(t.contiguous()) for t in expected.values()]))

    # FP8: every rank quantizes the tensors of its files as one process would.
    ref_dir = tmp_path / "fp8_reference"
    save_model(reference(fp8=True), ref_dir, fp8=True)
    ours, theirs = dict(iter_tensors(tmp_path / "weights_fp8" / "step_3")), dict(iter_tensors(ref_dir))
    assert sorted(ours) == sorted(theirs) and any(k.endswith("weight_scale_inv") for k in ours)
    for k, t in theirs.items():
        assert ours[k].dtype == t.dtype and torch.equal(ours[k].view(torch.uint8), t.view(torch.uint8)), k
    config = json.loads((tmp_path / "weights_fp8" / "step_3" / "config.json").read_text())
    assert config["quantization_config"] == json.loads((ref_dir / "config.json").read_text())["quantization_config"]


def test_a_model_too_large_to_stage_on_rank_0s_gpu_is_refused_naming_the_setting():
    """The collective transport stages each sender's share of the model on its GPU; a share that does
    not fit (a trillion-parameter MoE) gets one error naming the settings to change, not an OOM."""
    from rlcli.train.publish_collective import check_staging

    cuda = torch.device("cuda", 0)
    check_staging(80 << 30, cuda, free_bytes=100 << 30)
    check_staging(10 << 40, torch.device("cpu"))  # gloo sends from host memory: nothing to check
    with pytest.raises(ValueError, match="stages the whole model on rank 0's GPU: 2048.0 GiB, with 100.0 GiB "
                                         "free there; set sync.backend.kind = 'async_filesystem'"):
        check_staging(2 << 40, cuda, free_bytes=100 << 30)
    with pytest.raises(ValueError, match=r"stages 1/8 of the model on each sending rank's GPU: 256.0 GiB, with 100.0 "
                                         r"GiB free there; raise sync.backend.senders \(now 8, at most the trainer's "
                                         r"64 ranks\) or set sync.backend.kind = 'async_filesystem'"):
        check_staging(256 << 30, cuda, free_bytes=100 << 30, senders=8, world_size=64)
