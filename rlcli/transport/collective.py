"""Weight-transfer groups and the bucketed broadcast both ends of a collective update run.

Group. A standalone torch.distributed process group (NCCL on GPU, gloo on CPU), never the
trainer's default world: rank 0 is a trainer rank that sends, ranks 1.. are inference
servers. With several senders (``sync.backend.senders``) each has a group of its own with
the same servers at the same ranks (:func:`sender_group` names them). A group is built from
the TCPStore that rl-sync hosts (address in RUN/sync/store.json) with a ``PrefixStore`` per
generation: rl-sync bumps the generation whenever membership changes (a server joins,
restarts, is skipped or re-admitted, or a transfer failed), so the keys of a dead group
never meet a new one. Every op has a deadline (``timeout_s``): a
stuck peer makes the op raise instead of hanging its group forever.

Plan. Both ends derive the same bucket plan from the tensor list (name, dtype, shape) and
``bucket_bytes``, so nothing but that list travels beside the data: the transfer is the
tensors' bytes back to back in list order, cut into buckets (a tensor of at least
``bucket_bytes`` is a bucket alone; smaller consecutive ones share buckets of at most
``bucket_bytes``). Each bucket is one contiguous slice of that stream, so a receiver whose
parameters are views of one flat buffer in stream order (``rlcli.infer.receiver``) takes
every bucket straight into its parameters. Everything travels as uint8 (gloo cannot
broadcast float8; the bytes are the same). A 3-int64 header (version, number of buckets,
total bytes) goes first, so a receiver in the wrong round fails before touching a
parameter.

Senders. The buckets are dealt to the senders in contiguous runs of about equal bytes
(:func:`plan_owners`): sender k stages and broadcasts only its run, so no trainer rank
holds more than its share of the model. Every sender sends the header on its group, and a
receiver checks all of them before the first byte lands; it then takes the buckets in
order, each from its owner's group, one after another (a bucket's op is ordered after the
last on the receiver's stream, so the communicators never run at once).

Pipelining. The sender queues the header and every bucket without a host wait: on NCCL
they run on the communicator's stream back to back, and one wait at the end (bounded by
the deadline; a missing peer stalls the header and so everything behind it) covers them
all, so a transfer costs one host round trip, not one per bucket. A receiver waits for
the header alone first, then queues the buckets the same way.
"""

import datetime
import math
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist

STORE_PREFIX = "rlcli/weights"


@dataclass(frozen=True)
class Spec:
    """One tensor of a transfer, in broadcast order."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown tensor dtype {name!r} in a weight transfer")
    return dtype


def plan_buckets(specs: Sequence[Spec], bucket_bytes: int) -> list[list[int]]:
    """Indices of ``specs`` per bucket, in order (see the module docstring)."""
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i, s in enumerate(specs):
        if bucket_bytes <= 0 or s.nbytes >= bucket_bytes:
            if current:
                buckets.append(current)
                current, size = [], 0
            buckets.append([i])
            continue
        if current and size + s.nbytes > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += s.nbytes
    if current:
        buckets.append(current)
    return buckets


def plan_owners(specs: Sequence[Spec], buckets: Sequence[list[int]], senders: int) -> list[int]:
    """The sender of each bucket: bucket b goes to the sender whose equal share of the byte
    stream holds its middle byte, so each sender's buckets are one contiguous run of about
    ``total / senders`` bytes (a sender may get none when buckets are fewer than senders)."""
    assert senders >= 1
    total = max(1, sum(s.nbytes for s in specs))
    owners, start = [], 0
    for bucket in buckets:
        size = sum(specs[j].nbytes for j in bucket)
        owners.append(min(senders - 1, (2 * start + size) * senders // (2 * total)))
        start += size
    return owners


def sender_group(group: str, k: int) -> str:
    """The group name of sender ``k`` in the round whose group is ``group`` (sender 0's)."""
    return group if k == 0 else f"{group}.s{k}"


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (no copy)."""
    assert t.is_contiguous(), "as_bytes needs a contiguous tensor"
    return t.reshape(-1).view(torch.uint8) if t.dtype != torch.uint8 else t.reshape(-1)


# ------------------------------------------------------------------ stores


def host_store(host: str, port: int = 0) -> dist.TCPStore:
    """The rendezvous store rl-sync owns for the life of its process."""
    return dist.TCPStore(host, port, is_master=True, wait_for_workers=False, use_libuv=True)


def connect_store(addr: str, timeout_s: float) -> dist.TCPStore:
    """A client of the store at ``host:port``; raises ``RuntimeError`` if it cannot be reached."""
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"store address {addr!r} is not host:port")
    return dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=timeout_s),
                         use_libuv=True)


# ------------------------------------------------------------------ group


class WeightGroup:
    """One generation of the weight-transfer group, seen from one member."""

    def __init__(self, store: dist.Store, group: str, rank: int, world_size: int, device: torch.device,
                 timeout_s: float):
        self.group, self.rank, self.world_size, self.device = group, rank, world_size, torch.device(device)
        self.timeout = datetime.timedelta(seconds=timeout_s)
        prefixed = dist.PrefixStore(f"{STORE_PREFIX}/{group}/", store)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = self.timeout
            self.pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
        else:
            self.pg = dist.ProcessGroupGloo(prefixed, rank, world_size, self.timeout)
        self.key = (group, rank, world_size)

    def broadcast(self, t: torch.Tensor, block: bool = True) -> None:
        """Broadcast ``t`` in place from rank 0. ``block``: the host waits for it and raises
        when a peer misses the deadline; otherwise this thread's stream is ordered after it
        and :meth:`synchronize` bounds the wait."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.timeout = self.timeout
        work = self.pg.broadcast([t], opts)
        if self.device.type == "cuda":
            if block:
                work.wait(self.timeout)
            else:
                work.wait()  # stream-ordered: no host wait
        else:
            work.wait()  # gloo: the op's own timeout bounds it

    def synchronize(self) -> None:
        """Wait (host side) until every op issued from this thread's stream has finished;
        raises ``TimeoutError`` at the deadline (the caller then drops the group)."""
        if self.device.type != "cuda":
            return
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        deadline = time.monotonic() + self.timeout.total_seconds()
        while not done.query():
            if time.monotonic() > deadline:
                raise TimeoutError(f"weight transfer in group {self.group} missed its "
                                   f"{self.timeout.total_seconds():.0f} s deadline")
            time.sleep(0.0001)

    def close(self) -> None:
        abort = getattr(self.pg, "abort", None)
        if self.device.type == "cuda" and abort is not None:
            try:
                abort()
            except RuntimeError:
                pass
        self.pg = None


def _header(version: int, num_buckets: int, total_bytes: int, device: torch.device) -> torch.Tensor:
    return torch.tensor([version, num_buckets, total_bytes], dtype=torch.int64, device=device)


def send(group: WeightGroup, version: int, specs: Sequence[Spec], buckets: Sequence[list[int]],
         bucket_data: Iterable[torch.Tensor], mine: Sequence[int] | None = None) -> dict[str, float]:
    """A sender (rank 0 of its group): broadcast the header, then the bytes of each of its
    buckets (``mine``, indices into ``buckets``; all of them by default) as yielded by
    ``bucket_data`` (one flat uint8 tensor per bucket, on the group's device). Returns when
    each phase ended (``time.monotonic()``): ``header`` (queued), ``issued`` (the last
    bucket is queued), ``sent``."""
    total = sum(s.nbytes for s in specs)
    mine = range(len(buckets)) if mine is None else mine
    # Not waited for: the buckets queue behind it on the stream, and the one bounded wait at
    # the end covers a missing peer (a host wait here would cost NCCL's 1 ms polling step).
    group.broadcast(_header(version, len(buckets), total, group.device), block=False)
    at = {"header": time.monotonic()}
    n = 0
    for i, data in zip(mine, bucket_data):
        expected = sum(specs[j].nbytes for j in buckets[i])
        assert data.dtype == torch.uint8 and data.numel() == expected, f"bucket {i}: {data.numel()} != {expected} bytes"
        group.broadcast(data, block=False)
        n += 1
    assert n == len(mine), f"sent {n} of {len(mine)} buckets"
    at["issued"] = time.monotonic()
    group.synchronize()
    at["sent"] = time.monotonic()
    return at


def _receive_headers(groups: Sequence[WeightGroup], version: int, specs: Sequence[Spec], bucket_bytes: int
                     ) -> tuple[list[list[int]], list[WeightGroup]]:
    """Receive every sender's header and check each against this end's plan; returns the plan
    and the group each bucket comes over."""
    buckets = plan_buckets(specs, bucket_bytes)
    headers = [_header(-1, 0, 0, g.device) for g in groups]
    for g, header in zip(groups, headers):
        g.broadcast(header, block=False)
    groups[0].synchronize()  # bounded, and polls finer than a blocking NCCL wait; covers every group's
    expected = [version, len(buckets), sum(s.nbytes for s in specs)]
    for k, header in enumerate(headers):
        got = header.tolist()
        if got != expected:
            raise ValueError(f"weight transfer header {got} from sender {k} does not match the order {expected} "
                             "(version, buckets, bytes): the trainer sends another version or layout")
    return buckets, [groups[k] for k in plan_owners(specs, buckets, len(groups))]


def _groups(group: WeightGroup | Sequence[WeightGroup]) -> list[WeightGroup]:
    return [group] if isinstance(group, WeightGroup) else list(group)


def receive_tensors(group: WeightGroup | Sequence[WeightGroup], version: int, specs: Sequence[Spec],
                    bucket_bytes: int) -> Iterator[tuple[int, torch.Tensor]]:
    """Rank > 0, for a loader that takes tensors rather than destinations (vLLM's
    ``reload_weights``): yields ``(i, tensor of spec i)`` as each bucket arrives. Every bucket
    lands in a buffer of its own, so a tensor stays valid for as long as the loader keeps
    it; the allocator reuses the memory once it is dropped. ``group``: this member's group of
    each sender, in sender order (one group: one sender)."""
    groups = _groups(group)
    buckets, over = _receive_headers(groups, version, specs, bucket_bytes)
    for bucket, g in zip(buckets, over):
        buf = torch.empty(sum(specs[j].nbytes for j in bucket), dtype=torch.uint8, device=g.device)
        g.broadcast(buf, block=False)
        offset = 0
        for j in bucket:
            s = specs[j]
            raw = buf[offset:offset + s.nbytes]
            raw = raw if offset % s.dtype.itemsize == 0 else raw.clone()  # a dtype view needs alignment
            yield j, raw.view(s.dtype).view(s.shape)
            offset += s.nbytes
    groups[0].synchronize()


def byte_ranges(specs: Sequence[Spec], buckets: Sequence[list[int]]) -> list[tuple[int, int]]:
    """Each bucket's [start, end) in the transfer's byte stream (specs back to back, in order)."""
    starts = [0]
    for s in specs:
        starts.append(starts[-1] + s.nbytes)
    return [(starts[b[0]], starts[b[-1] + 1]) for b in buckets]


def receive_flat(group: WeightGroup | Sequence[WeightGroup], version: int, specs: Sequence[Spec],
                 bucket_bytes: int, flat: torch.Tensor, on_header: Callable[[], None] = lambda: None) -> None:
    """Rank > 0: receive a transfer's byte stream into ``flat`` (uint8, the total bytes),
    each bucket straight into its slice: no scratch, no copy. ``on_header`` runs once every
    header checked out, just before the first byte may land. ``group`` as for
    :func:`receive_tensors`."""
    groups = _groups(group)
    buckets, over = _receive_headers(groups, version, specs, bucket_bytes)
    assert flat.dtype == torch.uint8 and flat.numel() == sum(s.nbytes for s in specs)
    on_header()
    for (a, b), g in zip(byte_ranges(specs, buckets), over):
        g.broadcast(flat[a:b], block=False)
    groups[0].synchronize()
