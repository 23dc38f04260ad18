"""Full weights for rl-sync, written by every rank: sharded HF safetensors + index.

No rank ever holds the whole model. Tensors are assigned to ranks up front (greedy by
bytes, in state-dict order, identical on every rank); then for each tensor every rank
takes part in its all-gather (``full_tensor()``, a collective), and only the owner keeps
it, on CPU, in the publish dtype. Each rank writes its share as
``model-r<rank>-<part>.safetensors`` files of at most ``max_shard_bytes`` (so a rank's
CPU memory holds one part at a time). Rank 0 collects the weight maps and writes the
index, config.json and the tokenizer files. The caller wraps this in
``shared_atomic_dir`` (barrier, then rank 0 marks STABLE).
"""

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from rlcli.models.hf_io import _UNSTACKED, copy_tokenizer_files, save_model
from rlcli.models.safetensors_io import INDEX_NAME
from rlcli.parallel import dist as pdist


def _owners(sizes: list[int], world: int) -> list[int]:
    load = [0] * world
    out = []
    for n in sizes:
        r = load.index(min(load))
        out.append(r)
        load[r] += n
    return out


def _hf_tensors(name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    prefix, _, leaf = name.rpartition(".")
    if leaf in _UNSTACKED and prefix.endswith("mlp.experts"):
        return [(f"{prefix}.{e}.{_UNSTACKED[leaf]}.weight", t[e]) for e in range(t.shape[0])]
    return [(name, t)]


def publish_hf_sharded(model: torch.nn.Module, out_dir: str | Path, source_dir: str | Path | None = None,
                       dtype: torch.dtype | None = None, max_shard_bytes: int = 5 << 30, fp8: bool = False) -> None:
    """Write ``model`` (FSDP2/EP-sharded or plain) to ``out_dir`` in the HF layout; every rank
    calls this with the same arguments. Without a process group it is :func:`save_model`
    (which can also write FP8 weights: ``fp8``); sharded FP8 publishing is not written yet."""
    if not pdist.enabled():
        return save_model(model, out_dir, source_dir=source_dir, dtype=dtype, max_shard_bytes=max_shard_bytes,
                          fp8=fp8)
    if fp8:
        from rlcli.errors import ConfigError

        raise ConfigError("train.fp8.publish is not supported with more than one rl-train rank yet; "
                          "set train.fp8.publish = false")
    import torch.distributed as dist

    out_dir = Path(out_dir)
    rank, world = dist.get_rank(), dist.get_world_size()
    args = model.args
    entries = [(k, v) for k, v in model.state_dict().items()
               if not (args.tie_word_embeddings and k == "lm_head.weight")]
    out_dtype = lambda k, t: t.dtype if (dtype is None or k.endswith("e_score_correction_bias")) else dtype  # noqa: E731
    sizes = [t.numel() * torch.empty(0, dtype=out_dtype(k, t)).element_size() for k, t in entries]
    owners = _owners(sizes, world)
    weight_map: dict[str, str] = {}
    part: dict[str, torch.Tensor] = {}
    part_bytes, num_parts = 0, 0

    def flush() -> None:
        nonlocal part, part_bytes, num_parts
        if part:
            fname = f"model-r{rank:05d}-{num_parts:05d}.safetensors"
            save_file(part, str(out_dir / fname), metadata={"format": "pt"})
            weight_map.update({k: fname for k in part})
            num_parts += 1
        part, part_bytes = {}, 0

    for (name, t), owner, nbytes in zip(entries, owners, sizes):
        full = t.full_tensor() if hasattr(t, "full_tensor") else t
        if owner != rank:
            continue
        if part and part_bytes + nbytes > max_shard_bytes:
            flush()
        for hf_name, piece in _hf_tensors(name, full.detach().to(out_dtype(name, t))):
            part[hf_name] = piece.contiguous().cpu()
        part_bytes += nbytes
    flush()
    maps = pdist.all_gather_objects(weight_map)
    if rank == 0:
        merged = {k: v for m in maps for k, v in m.items()}
        total = sum(sizes)
        (out_dir / INDEX_NAME).write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": dict(sorted(merged.items()))}, indent=2))
        hf = dict(args.hf)
        if dtype is not None:
            hf["torch_dtype" if "torch_dtype" in hf else "dtype"] = str(dtype).removeprefix("torch.")
        (out_dir / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
        if source_dir is not None:
            copy_tokenizer_files(source_dir, out_dir)
