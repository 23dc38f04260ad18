"""The trainer's side of a weight update: ``WeightPublisher`` and its three backends.

The trainer's ranks hold the weights, so they publish them; rl-sync only coordinates.
``publish(step, model)`` returns as soon as the trainer may modify the model again:

- ``filesystem``: the HF tensors are split into files by huggingface_hub's plan
  (``rlcli.models.safetensors_io.plan_shards``, files of at most ``min(5 GiB, model bytes /
  ranks)``), and the files are dealt to the ranks, byte-balanced. DTensors are gathered
  with ``full_tensor()`` by all ranks and kept only by the rank writing their file. Each
  rank writes its files into a shared temporary directory, then a per-rank done file
  holding its part of the weight map. Rank 0 waits for all of them (a filesystem barrier,
  so the same code runs in a background thread), writes the index, config and tokenizer
  files, renames the directory into place and marks it STABLE with every file's size and
  checksum (each rank hashes its own files); servers check both before touching a parameter.
  With ``train.fp8.publish`` the FP8 linears' weights are written as FP8 + ``weight_scale_inv`` (DeepSeek-V3 layout), on
  any backend, and config.json declares the ``quantization_config``.
- ``async_filesystem``: the same files, written by a background thread from a host
  snapshot taken during ``publish``. STABLE is written only after every byte is fsynced;
  the next ``publish`` first waits for the previous one, and a failed write raises there
  (or in ``wait``/``close``).
- ``collective``: each sending rank (``sync.backend.senders``; rank 0 alone by default) copies
  the HF tensors of its share of the buckets (gathered per tensor, in broadcast order) into
  a flat staging buffer laid out bucket by bucket; rank 0 posts the tensor list to rl-sync's
  store, and a sender thread on each then serves the rounds rl-sync orders, broadcasting
  the staged buckets to the servers while the next step trains. They keep the snapshot,
  so a server that (re)joins later is brought up to date from it. The next ``publish``
  waits only for a round in progress, never for a version nobody asked for.

FP8: when the servers run ``infer.fp8`` (FP8 linears held as FP8 data + ``weight_scale_inv``), the
collective backend applies ``transform(name, tensor) -> [(name, tensor), ...]`` to every HF tensor
before it is staged (``publish_collective.fp8_transform``: each such weight into its FP8 data and
scales); the tensor list sent to the servers is derived from its output.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Protocol

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from rlcli.logging import setup_logging
from rlcli.models.hf_io import copy_tokenizer_files, hf_entries
from rlcli.models.safetensors_io import plan_shards, write_index
from rlcli.transport.atomic import commit_dir, storage_full, temp_tag
from rlcli.transport.checksum import file_checksum

if TYPE_CHECKING:
    from rlcli.config import RecipeConfig

log = setup_logging("rl-train")

Announce = Callable[[int, str, dict], None]
"""announce(step, path, timing): tell rl-sync that policy ``step`` is published."""
Transform = Callable[[str, torch.Tensor], list[tuple[str, torch.Tensor]]]


class WeightPublisher(Protocol):
    def publish(self, step: int, model: torch.nn.Module) -> None:
        """Hand policy ``step`` over; returns once the trainer may change the model again."""
        ...

    def wait(self) -> None:
        """Block until nothing is in flight; raise the error of a failed publish."""
        ...

    def close(self) -> None: ...


def world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def iter_hf_tensors(model: torch.nn.Module, keep: Callable[[int], bool] = lambda i: True
                    ) -> Iterator[tuple[int, str, torch.Tensor | None]]:
    """(index, HF name, full tensor) of every HF tensor, in order. DTensors are gathered
    (every rank must run this loop); a tensor ``keep`` rejects is yielded as None and, if
    it was gathered, dropped at once."""
    i = 0
    for _, t, names in hf_entries(model):
        if isinstance(t, DTensor):
            t = t.full_tensor()  # a collective: every rank gathers, the owners keep it
        t = t.detach()
        for e, name in enumerate(names):
            yield i, name, ((t if len(names) == 1 else t[e]) if keep(i) else None)
            i += 1


def hf_sizes(model: torch.nn.Module) -> list[int]:
    """Bytes of every HF tensor, in order."""
    out = []
    for _, t, names in hf_entries(model):
        out += [t.numel() * t.element_size() // len(names)] * len(names)
    return out


def plan_files(names: list[str], sizes: list[int], num_ranks: int) -> tuple[dict[str, str], dict[str, int]]:
    """(HF name -> file, file -> writing rank): huggingface_hub's split into files of at most
    min(5 GiB, total / num_ranks) bytes, each file dealt to the rank with the fewest bytes so far."""
    plan = plan_shards(dict(zip(names, sizes)), min(5 << 30, max(sum(sizes) // num_ranks, 1)))
    file_bytes: dict[str, int] = {}
    for name, size in zip(names, sizes):
        file_bytes[plan[name]] = file_bytes.get(plan[name], 0) + size
    load, writer = [0] * num_ranks, {}
    for fname in sorted(file_bytes):
        writer[fname] = load.index(min(load))
        load[writer[fname]] += file_bytes[fname]
    return plan, writer


# ------------------------------------------------------------------ filesystem


class FilesystemPublisher:
    """Write RUN/weights/step_N from every rank; rank 0 marks it STABLE (see module docstring)."""

    background = False

    def __init__(self, cfg: RecipeConfig, weights_root: Path, announce: Announce, barrier_timeout_s: float = 600.0):
        from rlcli.models import DTYPES

        self.cfg, self.root, self.announce = cfg, Path(weights_root), announce
        self.dtype = DTYPES[cfg.model.dtype]
        self.fp8 = cfg.train.fp8.enabled and cfg.train.fp8.publish
        self.rank, self.world_size = world()
        self.barrier_timeout_s = barrier_timeout_s
        token = [temp_tag()]  # rank 0's <host>-r0-<pid>: clean_temporaries knows whose it is, on any host
        if self.world_size > 1:
            dist.broadcast_object_list(token, src=0)  # one temporary name for all ranks
        self.token = token[0]
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def publish(self, step: int, model: torch.nn.Module) -> None:
        from rlcli.models.fp8_io import SCALE_SUFFIX
        from rlcli.ops.fp8.quant import quantize_128x128

        self.wait()
        t0 = time.monotonic()
        names = [n for _, _, hf_names in hf_entries(model) for n in hf_names]
        plan, writer = plan_files(names, hf_sizes(model), self.world_size)
        fp8_names = {f"{n}.weight" for n, m in model.named_modules() if hasattr(m, "to_fp8_storage")} \
            if self.fp8 else set()
        mine: dict[str, dict[str, torch.Tensor]] = {}  # file -> its tensors, on the rank writing it
        for i, name, t in iter_hf_tensors(model, keep=lambda i: writer[plan[names[i]]] == self.rank):
            if t is None:
                continue
            if name in fp8_names:
                out = dict(zip((name, name + SCALE_SUFFIX), quantize_128x128(t.to(self.dtype))))
            else:  # in the model's dtype (FSDP2 holds fp32 master weights); the routing bias stays fp32
                out = {name: t if name.endswith("e_score_correction_bias") else t.to(self.dtype)}
            for k, v in out.items():
                mine.setdefault(plan[name], {})[k] = v.to("cpu", copy=True) if self.background else v.contiguous()
        gather_s = time.monotonic() - t0
        job = lambda: self._write(step, model, sorted(writer), mine, gather_s)  # noqa: E731
        if not self.background:
            return job()
        self._thread = threading.Thread(target=self._run, args=(job,), name=f"publish-{step}", daemon=True)
        self._thread.start()

    def _run(self, job: Callable[[], None]) -> None:
        try:
            job()
        except BaseException as e:  # surfaces on the next publish / wait / close
            self._error = e

    def _write(self, step: int, model, files: list[str], mine: dict, gather_s: float) -> None:
        try:
            self._write_files(step, model, files, mine, gather_s)
        except BaseException as e:  # a full disk: one line; the temporary is cleaned at the next start
            full = storage_full(e, self.root / f"step_{step}")
            if full is not None:
                raise full from None
            raise

    def _write_files(self, step: int, model, files: list[str], mine: dict, gather_s: float) -> None:
        from safetensors.torch import save_file

        from rlcli.models.fp8_io import QUANTIZATION_CONFIG

        t0 = time.monotonic()
        final = self.root / f"step_{step}"
        tmp = self.root / f".step_{step}.tmp-{self.token}"
        tmp.mkdir(parents=True, exist_ok=True)
        sums = {}  # each rank hashes its own files (from its page cache): rank 0 reads no other rank's shard
        for fname, tensors in mine.items():
            save_file(tensors, str(tmp / fname), metadata={"format": "pt"})
            with open(tmp / fname, "rb") as f:
                os.fsync(f.fileno())
            sums[fname] = file_checksum(tmp / fname)
        done = tmp / f".done-{self.rank}"  # this rank's part of the weight map (FP8 adds scale tensors)
        done.with_suffix(".tmp").write_text(json.dumps(
            {"weight_map": {k: f for f, ts in mine.items() for k in ts}, "checksums": sums}))
        os.replace(done.with_suffix(".tmp"), done)
        if self.rank != 0:
            return
        deadline = time.monotonic() + self.barrier_timeout_s
        while not all((tmp / f".done-{r}").exists() for r in range(self.world_size)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"trainer ranks did not all write {tmp} within {self.barrier_timeout_s:.0f}s")
            time.sleep(0.01)
        weight_map: dict[str, str] = {}
        for r in range(self.world_size):
            done = json.loads((tmp / f".done-{r}").read_text())
            weight_map.update(done["weight_map"])
            sums.update(done["checksums"])
            (tmp / f".done-{r}").unlink()
        write_index(tmp, weight_map)
        hf = {k: v for k, v in model.args.hf.items() if k != "quantization_config"}
        if self.fp8:
            hf["quantization_config"] = dict(QUANTIZATION_CONFIG)
        (tmp / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
        copy_tokenizer_files(self.cfg.model.path, tmp)
        sizes = {f: (tmp / f).stat().st_size for f in files}
        # fsync, move into place and mark; a re-published step (trainer restart) is swapped in atomically
        commit_dir(tmp, final, {"step": step, "files": sizes}, sums)
        write_s = time.monotonic() - t0
        self.announce(step, str(final), {"gather_s": gather_s, "write_s": write_s})

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError(f"publishing weights failed: {err}") from err

    def close(self) -> None:
        self.wait()


class AsyncFilesystemPublisher(FilesystemPublisher):
    """Filesystem publishing off the critical path (see module docstring)."""

    background = True


def make_publisher(cfg: RecipeConfig, run_root: Path, announce: Announce, device: torch.device) -> WeightPublisher:
    """The publisher ``sync.backend.kind`` names; FP8 weights + scales (``train.fp8.publish``)
    travel as files whatever the backend."""
    kind = type(cfg.sync.backend).__struct_config__.tag
    if kind == "async_filesystem":
        return AsyncFilesystemPublisher(cfg, Path(run_root) / "weights", announce)
    if kind == "filesystem" or (cfg.train.fp8.enabled and cfg.train.fp8.publish):
        return FilesystemPublisher(cfg, Path(run_root) / "weights", announce)
    if kind == "collective":
        from rlcli.train.publish_collective import CollectivePublisher

        return CollectivePublisher(cfg, Path(run_root), announce, device)
    raise ValueError(f"unknown sync.backend.kind {kind!r}")
