"""KV blocks as bytes: what an engine hands to, and takes from, a shared store (the native engine, and
the vLLM engine's connector in ``rlcli.infer.vllm_kv``).

A block's payload is every cache tensor's rows of that block (layer by layer, K then V,
or the MLA latent and the indexer keys), concatenated as raw bytes in each cache's dtype;
for a mixture-of-experts model served by the native engine it ends with the experts the block's
tokens were routed to (``route_bytes``: int16 ``[block_size, MoE layers, top_k]``, -1 where
they were not recorded), so R3 requests can take fetched blocks as they take local ones.
Its :class:`BlockMeta` names that layout, and a fingerprint of the model: architecture,
cache layout, block size, dtype and a sample of every parameter (the first 16 values),
so engines of other models, or of other runs whose weights differ at the same version,
never read each other's KV. The engine recomputes it after each weight load.
"""

import hashlib
import json
from dataclasses import asdict

import torch

from rlcli.models import CausalLM
from rlcli.protocol import BlockMeta


@torch.no_grad()
def weights_sample(params) -> bytes:
    """The first 16 values of every parameter, as fp32 bytes: what a block fingerprint hashes of the
    weights (one copy to the host for all of them, not one per parameter)."""
    samples = [p.detach().reshape(-1)[:16].float() for p in params]
    return torch.cat(samples).cpu().numpy().tobytes() if samples else b""


def route_bytes(model: CausalLM, block_size: int) -> int:
    """Bytes of a block's routes: int16 ``[block_size, MoE layers, top_k]`` (0 for a dense model)."""
    a = model.args
    return 2 * block_size * a.num_moe_layers * a.num_experts_per_tok if a.is_moe else 0


@torch.no_grad()
def block_meta(model: CausalLM, block_size: int, dtype: torch.dtype, with_routes: bool = False) -> BlockMeta:
    """The layout of a block's payload; ``with_routes``: it ends with the block's routes (padded to
    whole elements of ``dtype``), and only engines that carry routes share its fingerprint."""
    spec = [hd for layer in model.kv_cache_spec() for hd in layer]
    extra = route_bytes(model, block_size) if with_routes else 0
    h = hashlib.blake2b(digest_size=16)
    h.update(json.dumps([asdict(model.args), spec, block_size, str(dtype)] + ([extra] if extra else []),
                        sort_keys=True, default=str).encode())
    h.update(weights_sample(model.parameters()))
    if len(set(spec)) == 1 and not extra:
        shape = [len(spec), block_size, *spec[0]]
    else:
        itemsize = torch.empty(0, dtype=dtype).element_size()
        shape = [block_size * sum(heads * dim for heads, dim in spec) + -(-extra // itemsize)]
    return BlockMeta(fingerprint=h.hexdigest(), dtype=str(dtype).removeprefix("torch."), shape=shape)


def gather(kv_caches: list[tuple[torch.Tensor, ...]], blocks: list[int]) -> torch.Tensor:
    """``[len(blocks), bytes per block]`` uint8 on the caches' device: each cache tensor's rows of
    ``blocks`` (dimension 0 indexes blocks), as bytes, cache after cache (their dtypes may differ)."""
    n = len(blocks)
    idx = torch.tensor(blocks, dtype=torch.int64, device=kv_caches[0][0].device)
    return torch.cat([cache.index_select(0, idx).reshape(n, -1).view(torch.uint8)
                      for layer in kv_caches for cache in layer], dim=1)


def scatter(kv_caches: list[tuple[torch.Tensor, ...]], blocks: list[int], data: torch.Tensor) -> None:
    """Write payloads (``[len(blocks), bytes per block]`` uint8, as :func:`gather` makes them)
    into ``blocks``: one copy to the caches' device (asynchronous from pinned memory), then one
    indexed copy per cache tensor, all queued on the current stream."""
    first = kv_caches[0][0]
    n = len(blocks)
    flat = data.to(first.device, non_blocking=True).reshape(n, -1)
    idx = torch.tensor(blocks, dtype=torch.int64).to(first.device, non_blocking=True)
    offset = 0
    for layer in kv_caches:
        for cache in layer:
            k = cache[0].numel() * cache.element_size()
            rows, size = flat[:, offset:offset + k], cache.element_size()
            if rows.storage_offset() % size or rows.stride(0) % size:  # not viewable in place as that dtype
                rows = rows.contiguous()
            cache.index_copy_(0, idx, rows.view(cache.dtype).reshape(n, *cache.shape[1:]))
            offset += k
