"""The collective ``WeightPublisher``: stage on the sending ranks, send in a thread (see ``publish``).

Senders. ``sync.backend.senders`` of the trainer's ranks send (rank ``k * world_size //
senders`` is sender k). The transfer's buckets are dealt to them in contiguous runs of
about equal bytes (``rlcli.transport.collective.plan_owners``): each stages and broadcasts
only its run, over a group of its own with the servers, so no rank holds more than its
share of the model. Sender 0 (rank 0) talks to rl-sync; the others follow the rounds it
takes in rl-sync's store.

Timeline of one update, trainer side:
1. ``publish(v)`` (every rank, main thread): each sender waits until no round of its own is
   sending (with several senders, rank 0 then withdraws the old version and every rank meets
   at a barrier, so no sender can be asked for a version another has already overwritten),
   then offers ``v``; rank 0 wakes its sender thread, which posts the tensor list to
   rl-sync's store at once. Then every rank gathers each HF tensor (``full_tensor()`` for
   DTensors) and the tensor's sender casts it to the model's dtype (``model.dtype``: FSDP2
   holds fp32 masters, servers run in the model dtype) straight into its staging buffer,
   laid out bucket by bucket: one ``_foreach_copy_`` per ~256 MiB, marking each bucket ready
   once its last byte is queued (a CUDA event on GPU); then it waits for its own stream (not
   the broadcast of a round already sending) and returns.
2. Rank 0's sender thread posts the version, then announces it (the trainer's
   ``WeightsPublished``, which only wakes rl-sync's loop to read the store: rl-sync
   otherwise looks at the store only between its 50 ms waits). rl-sync keeps a round
   ``round/<r>`` open for the next version its servers want, so the sender normally finds
   it already there: it takes it at once for the version it holds (announcing again, for
   the same reason), joins (or reuses) the round's group as rank 0 and broadcasts its
   buckets, each once it is ready: the round runs while the trainer is still staging and
   sends behind the staging copy instead of after it. Every other sender's thread sees the
   round taken and does the same over its own group. Each reports the outcome; they serve
   any number of rounds for the offered version (servers that join late), on their own
   CUDA stream so the next step's kernels run beside them.
3. The next ``publish`` waits only while a round is sending, then restages.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from rlcli.logging import setup_logging
from rlcli.train.publish import Announce, FilesystemPublisher, Transform, iter_hf_tensors, world
from rlcli.transport.collective import (Spec, WeightGroup, as_bytes, connect_store, dtype_name, plan_buckets,
                                        plan_owners, send, sender_group)
from rlcli.transport.rendezvous import Control, read_store_file

if TYPE_CHECKING:
    from rlcli.config import RecipeConfig
    from rlcli.config.model import Fp8Config

log = setup_logging("rl-train")

STAGE_FLUSH_BYTES = 256 << 20
"""Staging copies are queued in groups of about this many bytes (one ``_foreach_copy_`` each)."""
CLOSE_GRACE_S = 15.0
"""``close`` lets a round already sending finish for at most this long."""
SWITCH_INTERVAL_S = 2e-4
"""The interpreter's thread switch interval on the sending rank (see ``__init__``)."""


def sender_ranks(world_size: int, senders: int) -> list[int]:
    """The trainer ranks that send, sender k first: spread evenly (one per node when ``senders``
    is the number of nodes and ranks fill nodes in order)."""
    return [k * world_size // senders for k in range(senders)]


def check_staging(nbytes: int, device: torch.device, free_bytes: int | None = None, senders: int = 1,
                  world_size: int = 1) -> None:
    """Raise ValueError, naming the setting to change, unless a staging buffer of ``nbytes`` (this
    sender's share of the model as it travels) fits in its free GPU memory (``free_bytes``; by
    default the driver's free memory plus what torch's allocator has cached unused)."""
    if device.type != "cuda":
        return
    free = free_bytes
    if free is None:  # the driver's free memory, and what torch's allocator holds unused
        free = torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if nbytes > free:
        share = "the whole model on rank 0's GPU" if senders == 1 else \
            f"1/{senders} of the model on each sending rank's GPU"
        more = f"raise sync.backend.senders (now {senders}, at most the trainer's {world_size} ranks) or " \
            if senders < world_size else ""
        raise ValueError(f"sync.backend.kind = 'collective' stages {share}: {nbytes / 2**30:.1f} GiB, with "
                         f"{free / 2**30:.1f} GiB free there; {more}set sync.backend.kind = 'async_filesystem' "
                         "for a model this large")


def wire_dtype(t_dtype: torch.dtype, dtype: torch.dtype) -> torch.dtype:
    """What a model tensor travels as: floating masters in the model's dtype, others as they are."""
    return dtype if t_dtype.is_floating_point and t_dtype.itemsize > 1 else t_dtype


def staged_specs(model: torch.nn.Module, transform: Transform | None, dtype: torch.dtype
                 ) -> tuple[list[Spec], list[int]]:
    """The tensor list of a transfer, without touching data (``transform`` runs on meta tensors),
    and the index of each HF tensor's first spec (a transform may make several of one)."""
    from rlcli.models.hf_io import hf_entries

    specs, first = [], []
    for _, t, names in hf_entries(model):
        shape = tuple(t.shape[1:]) if len(names) > 1 else tuple(t.shape)
        t_dtype = wire_dtype(t.dtype, dtype)
        for name in names:
            first.append(len(specs))
            if transform is None:
                specs.append(Spec(name, t_dtype, shape))
            else:
                specs += [Spec(n, o.dtype, tuple(o.shape))
                          for n, o in transform(name, torch.empty(shape, dtype=t_dtype, device="meta"))]
    return specs, first


def fp8_transform(model: torch.nn.Module, fp8: Fp8Config) -> Transform | None:
    """What a server with ``infer.fp8`` on holds: the engine keeps every linear that ``fp8`` selects
    (``rlcli.ops.fp8.convert``, FP8 storage) as FP8 data + ``weight_scale_inv``, and its collective
    receive lands bytes straight in its parameters, so those weights travel quantized (128x128 blocks,
    as the filesystem publisher writes them with ``train.fp8.publish``); experts and the rest travel
    in the model's dtype. None when no linear is selected."""
    from rlcli.models.fp8_io import SCALE_SUFFIX
    from rlcli.ops.fp8.convert import _matches
    from rlcli.ops.fp8.quant import quantize_128x128

    names = {f"{n}.weight" for n, m in model.named_modules()
             if n and isinstance(m, torch.nn.Linear) and _matches(n, fp8.include, fp8.exclude)}
    if not names:
        return None

    def transform(name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        if name not in names:
            return [(name, t)]
        q, scale = quantize_128x128(t, fp8.ue8m0)
        return [(name, q), (name + SCALE_SUFFIX, scale)]

    return transform


class StoreWatch:
    """A sender thread's view of rl-sync's store: RUN/sync/store.json is read again at most every
    0.2 s while connected (off the path of a publish), at every call while not."""

    def __init__(self, run_root: Path, timeout_s: float):
        self.run_root, self.timeout_s = run_root, timeout_s
        self.ctl: Control | None = None
        self.store_id: str | None = None
        self.next_look = 0.0

    def changed(self) -> bool:
        """True once connected to a store other than the last (rl-sync (re)started)."""
        if self.ctl is not None and time.monotonic() < self.next_look:
            return False
        info, self.next_look = read_store_file(self.run_root), time.monotonic() + 0.2
        if not info or info.get("id") == self.store_id:
            return False
        self.ctl = Control(connect_store(info["addr"], max(5.0, self.timeout_s)))
        self.store_id = info["id"]
        return True

    def lost(self) -> None:
        """The store went away: the next :meth:`changed` connects to whichever store is there."""
        self.ctl = self.store_id = None


class CollectivePublisher:
    def __init__(self, cfg: RecipeConfig, run_root: Path, announce: Announce, device: torch.device):
        self.run_root, self.announce, self.device = Path(run_root), announce, device
        # Servers with infer.fp8 hold FP8 linears: those weights are quantized on the way (fp8_transform).
        self.fp8 = cfg.infer.fp8 if cfg.infer.fp8.enabled else None
        self.transform: Transform | None = None
        from rlcli.models import DTYPES

        self.bucket_bytes = cfg.sync.backend.bucket_bytes
        self.dtype = DTYPES[cfg.model.dtype]
        self.timeout_s = cfg.sync.ack_timeout_s / 2  # as the servers' (rl-sync's rounds)
        self.rank, self.world_size = world()
        self.senders = getattr(cfg.sync.backend, "senders", 1)
        if self.senders > self.world_size:
            raise ValueError(f"sync.backend.senders = {self.senders} is more than the trainer's {self.world_size} "
                             f"ranks; set it to at most {self.world_size}")
        ranks = sender_ranks(self.world_size, self.senders)
        self.index = ranks.index(self.rank) if self.rank in ranks else None  # this rank's sender number
        self.fs = FilesystemPublisher(cfg, self.run_root / "weights", announce)
        self.specs: list[Spec] = []
        self.first_spec: list[int] = []  # HF tensor i -> the index of its first spec
        self.planned_for: torch.nn.Module | None = None
        self.tensor_list: list[list] = []
        self.buckets: list[list[int]] = []
        self.mine: list[int] = []  # the buckets this sender sends, in order
        self.ranges: list[tuple[int, int]] = []  # each of them in the staging buffer (back to back)
        self.spec_at: dict[int, int] = {}  # spec index -> its offset in the staging buffer (this sender's)
        self.keep: list[bool] = []  # HF tensor i has a spec this sender stages
        self.staging: torch.Tensor | None = None
        self.version = -1  # the version this sender offers (-1: none)
        self.timing: dict[str, float] = {}
        self.cond = threading.Condition()
        self.busy = False
        self.staged = 0  # buckets of the offered version that are ready to send
        self.events: list[torch.cuda.Event] = []
        self.stopping = threading.Event()
        self.wake = threading.Event()  # set by publish: the sender posts the new version at once
        self.trace: dict[int, dict[str, float]] = {}  # version -> when each phase ended (last 16 versions)
        self.group: WeightGroup | None = None
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" and self.index is not None else None
        self.thread = None
        if self.index is not None:
            # The sender must get the GIL within a fraction of a millisecond of a publish, while the
            # main thread stages in Python; at the default 5 ms switch interval a waiting thread can
            # sit out a whole interval. Only matters while threads contend, so training is unaffected.
            sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
            self.thread = threading.Thread(target=self._serve, name=f"weight-sender-{self.index}", daemon=True)
            self.thread.start()

    # ------------------------------------------------------------------ main thread
    def publish(self, step: int, model: torch.nn.Module) -> None:
        if step == 0:
            self.fs.publish(0, model)  # servers boot from disk
        t0 = time.monotonic()
        if self.senders > 1:
            # Rank 0 takes rounds for what it offers and every sender must send its share of them:
            # it withdraws the old version once its rounds are over, and no sender restages before
            # that (every sender's share of those rounds is sent by then: a round needs them all).
            if self.index == 0:
                with self.cond:
                    self.cond.wait_for(lambda: not self.busy)
                    self.version = -1
            dist.barrier()
        if self.index is not None:
            with self.cond:
                self.cond.wait_for(lambda: not self.busy)
                self._plan(model)
                self.staged, self.version, self.timing = 0, step, {}
                self.trace = {v: t for v, t in self.trace.items() if v > step - 16}
                self.trace[step] = {"ready": t0}
                self.cond.notify_all()
            self.wake.set()
        try:
            self._stage(model)
        except BaseException:
            with self.cond:  # nothing half-staged is ever offered
                self.version = -1
            raise
        if self.index != 0:
            return
        with self.cond:
            self.timing = {"gather_s": time.monotonic() - t0}
            self.trace[step]["staged"] = time.monotonic()
        if step != 0:
            self.announce(step, "", self.timing)

    def _plan(self, model: torch.nn.Module) -> None:
        """A sender: the tensor list, its buckets, this sender's share and its staging buffer, made
        once per model (a model's tensor list is its architecture; walking it costs a publish
        ~1 ms before the version can be posted)."""
        if model is self.planned_for:
            return
        self.transform = fp8_transform(model, self.fp8) if self.fp8 is not None else None
        specs, self.first_spec = staged_specs(model, self.transform, self.dtype)
        self.planned_for = model
        if specs == self.specs:
            return
        self.specs, self.buckets = specs, plan_buckets(specs, self.bucket_bytes)
        self.tensor_list = [[s.name, dtype_name(s.dtype), list(s.shape)] for s in specs]  # as posted
        owners = plan_owners(specs, self.buckets, self.senders)
        self.mine = [b for b, owner in enumerate(owners) if owner == self.index]
        self.ranges, self.spec_at, offset = [], {}, 0
        for b in self.mine:
            start = offset
            for j in self.buckets[b]:
                self.spec_at[j] = offset
                offset += specs[j].nbytes
            self.ranges.append((start, offset))
        ends = self.first_spec[1:] + [len(specs)]
        self.keep = [any(j in self.spec_at for j in range(a, e)) for a, e in zip(self.first_spec, ends)]
        self.staging = None  # the last model's buffer is not counted against the new one
        check_staging(offset, self.device, senders=self.senders, world_size=self.world_size)
        self.staging = torch.empty(offset, dtype=torch.uint8, device=self.device)
        self.events = [torch.cuda.Event() for _ in self.mine] if self.device.type == "cuda" else []

    def _mark_staged(self, offset: int) -> None:
        """Every bucket of this sender that ends at or before ``offset`` is ready to send."""
        k = self.staged
        while k < len(self.ranges) and self.ranges[k][1] <= offset:
            if self.events:
                self.events[k].record()
            k += 1
        if k != self.staged:
            with self.cond:
                self.staged = k
                self.cond.notify_all()

    def _stage(self, model: torch.nn.Module) -> None:
        """Every rank gathers every HF tensor; a sender copies (and casts) each spec of its share
        into its place in the staging buffer: one ``_foreach_copy_`` per ``STAGE_FLUSH_BYTES``,
        each marking the buckets it completed. Returns once the copies are done (this stream
        only: a round in flight is not waited for)."""
        offset, dsts, srcs, pending = 0, [], [], 0  # offset: the end of the last spec queued

        def flush() -> None:
            nonlocal pending
            if dsts:
                torch._foreach_copy_(dsts, srcs)
                dsts.clear()
                srcs.clear()
            pending = 0
            self._mark_staged(offset)

        sender = self.index is not None
        for i, name, t in iter_hf_tensors(model, keep=lambda i: sender and self.keep[i]):
            if t is None:
                continue
            t = t.to(wire_dtype(t.dtype, self.dtype)) if self.transform else t
            outs = self.transform(name, t) if self.transform else [(name, t)]
            for j, (_, out) in enumerate(outs, start=self.first_spec[i]):
                if j not in self.spec_at:  # another sender's
                    continue
                dtype = wire_dtype(out.dtype, self.dtype) if self.transform is None else out.dtype
                n, at = out.numel() * dtype.itemsize, self.spec_at[j]
                dst = self.staging[at:at + n]
                if at % dtype.itemsize == 0:  # cast and copy in one kernel
                    dsts.append(dst.view(dtype).view(out.shape))
                    srcs.append(out)
                else:
                    dst.copy_(as_bytes(out.to(dtype).contiguous()))
                offset = at + n
                pending += n
            if pending >= STAGE_FLUSH_BYTES:
                flush()
        flush()
        assert not sender or offset == self.staging.numel(), "the model's tensors changed since it was planned"
        if sender and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def wait(self) -> None:
        with self.cond:
            self.cond.wait_for(lambda: not self.busy)

    def close(self) -> None:
        """Take no new round; one already sending finishes (its servers get the version) unless it
        takes longer than ``CLOSE_GRACE_S``, when its group is aborted. With several senders, rank 0
        marks in the store the first round it did not take; the others serve every round before
        it, so none of its rounds misses a sender."""
        self.stopping.set()
        self.wake.set()
        if self.thread is not None:
            self.thread.join(timeout=CLOSE_GRACE_S)
            if self.thread.is_alive():
                self._drop_group()  # the round's ops fail and the thread ends
                self.thread.join(timeout=self.timeout_s + 5)
        self._drop_group()
        self.fs.close()

    # ------------------------------------------------------------------ sender thread
    def _serve(self) -> None:
        serve = self._serve_rounds if self.index == 0 else self._follow_rounds
        if self.stream is not None:
            torch.cuda.set_device(self.device)
            with torch.cuda.stream(self.stream):
                return serve()
        return serve()

    def _serve_rounds(self) -> None:
        # posted: (version, whether its gather time was in) as last posted: the version is
        # posted as soon as it is offered, and again once staging has timed it.
        watch, r, posted = StoreWatch(self.run_root, self.timeout_s), 0, (-1, False)
        ctl = None
        while not self.stopping.is_set():
            try:
                if watch.changed():  # rl-sync (re)started: a new store
                    ctl, r, posted = watch.ctl, watch.ctl.open_round(), (-1, False)
                    self._drop_group()
                if ctl is None:
                    time.sleep(0.2)
                    continue
                with self.cond:
                    version, timing = self.version, dict(self.timing)
                if version >= 0 and (version, bool(timing)) != posted:
                    ctl.post_published(version, self.tensor_list, self.bucket_bytes, timing, self.senders)
                    posted = (version, bool(timing))
                    self._at(version, "posted")
                    self.announce(version, "", timing)  # wakes rl-sync to read the store now
                # rl-sync keeps a round open: normally it is there before the version it will carry.
                order = ctl.wait(f"round/{r}", 0.2, poll_s=0.002, sleep=self._nap,
                                 stop=lambda: (self.version, bool(self.timing)) != posted)
                if order is None:
                    continue
                if self.stopping.is_set():
                    break
                with self.cond:
                    version = self.version
                    # Taken only for a version already posted: rl-sync reads its tensor list next.
                    self.busy = version == posted[0] and version >= max(order["min_version"], 0)
                if not self.busy:  # nothing new enough: wait for a publish, or for rl-sync to withdraw it
                    if version >= 0 and version != posted[0]:
                        continue  # post it first
                    if ctl.withdrawn(r):
                        r += 1
                    else:
                        self._nap(0.05)
                    continue
                if not ctl.claim(r, version):  # withdrawn first (its membership changed)
                    with self.cond:
                        self.busy = False
                        self.cond.notify_all()
                    r += 1
                    continue
                self._at(version, "accepted")
                self.announce(version, "", {})  # likewise: rl-sync sends the loads at once
                try:
                    error, timing = self._send({**order, "version": version})
                finally:
                    with self.cond:
                        self.busy = False
                        self.cond.notify_all()
                ctl.sent(r, error, timing)
                r += 1
            except (RuntimeError, ValueError, OSError) as e:  # the store went away: rl-sync restarts
                log.warning("weight sender lost rl-sync's store (%s); waiting for it", e)
                ctl = watch.lost()
                time.sleep(0.5)
        if ctl is not None and self.senders > 1:
            try:
                ctl.stop_senders(self.fs.token, r)  # the followers serve every round before r, then stop
            except (RuntimeError, ValueError, OSError):
                pass

    def _follow_rounds(self) -> None:
        """Sender k >= 1: send this rank's share of every round rank 0 takes for the version this
        rank offers. A round taken for a newer version waits for this rank's publish of it; one
        for an older version, or one rank 0 already reported failed, is passed over (rank 0 has
        given up on it: ``publish`` lets no sender restage while rank 0 still sends it)."""
        watch, ctl, r, deadline = StoreWatch(self.run_root, self.timeout_s), None, 0, None
        while True:
            if self.stopping.is_set():  # closing: serve what rank 0 took before it stopped, then stop
                deadline = deadline or time.monotonic() + CLOSE_GRACE_S
                try:
                    last = ctl.senders_stopped(self.fs.token) if ctl is not None else r
                except (RuntimeError, ValueError, OSError):
                    last = r
                if (last is not None and r >= last) or time.monotonic() > deadline:
                    return
            try:
                if watch.changed():  # rl-sync (re)started: a new store
                    ctl, r = watch.ctl, self._resume_round(watch.ctl)
                    self._drop_group()
                if ctl is None:
                    time.sleep(0.2)
                    continue
                answer = ctl.wait(f"accept/{r}", 0.2, poll_s=0.002, sleep=self._nap, stop=self.stopping.is_set)
                if answer is None:
                    if self.stopping.is_set():
                        time.sleep(0.005)
                    continue
                if answer == "withdrawn" or (ctl.outcome(r) or {}).get("error"):
                    r += 1
                    continue
                version = answer["version"]
                with self.cond:
                    self.busy = version == self.version
                    mine = self.version
                if not self.busy:
                    if version < mine:
                        r += 1
                    else:  # this rank's publish of it has not begun
                        self._nap(0.002)
                    continue
                try:
                    error, timing = self._send({**ctl.round_of(r), "version": version})
                finally:
                    with self.cond:
                        self.busy = False
                        self.cond.notify_all()
                ctl.sent(r, error, timing, sender=self.index)
                r += 1
            except (RuntimeError, ValueError, OSError) as e:  # the store went away: rl-sync restarts
                log.warning("weight sender %d lost rl-sync's store (%s); waiting for it", self.index, e)
                ctl = watch.lost()
                time.sleep(0.5)

    @staticmethod
    def _resume_round(ctl: Control) -> int:
        """The round a (re)started follower looks at first: the last ordered one while it is open,
        or taken and not yet reported (rank 0 may be sending it and needs this rank), else the next."""
        n = ctl.rounds()
        answer = ctl.accepted(n - 1) if n else "withdrawn"
        return n - 1 if answer is None or (isinstance(answer, dict) and ctl.outcome(n - 1) is None) else n

    def _send(self, order: dict) -> tuple[str, dict[str, float]]:
        t0 = time.monotonic()
        name = sender_group(order["group"], self.index)
        try:
            key = (name, 0, order["world_size"])
            if self.group is None or self.group.key != key:
                self._drop_group()
                info = read_store_file(self.run_root)
                store = connect_store(info["addr"], self.timeout_s)
                self.group = WeightGroup(store, name, 0, order["world_size"], self.device, self.timeout_s)
            t1 = time.monotonic()
            at = send(self.group, order["version"], self.specs, self.buckets, self._ready_buckets(), self.mine)
        except Exception as e:  # a peer died or missed the deadline: the group is unusable
            self._drop_group()
            log.warning("sending v%d to %s failed: %s", order["version"], name, e)
            return f"{type(e).__name__}: {e}", {}
        with self.cond:
            self.trace.get(order["version"], {}).update(joined=t1, **at)
        return "", {"group_s": t1 - t0, "send_s": at["sent"] - t1}

    def _at(self, version: int, phase: str) -> None:
        """Stamp the first time ``phase`` ended for ``version`` (a round for a late joiner keeps the first)."""
        with self.cond:
            if version in self.trace:
                self.trace[version].setdefault(phase, time.monotonic())

    def _nap(self, seconds: float) -> None:
        """The sender's wait between polls of the store; a new publish ends it at once."""
        if self.wake.wait(seconds):
            self.wake.clear()

    def _ready_buckets(self):
        """The bytes of each of this sender's buckets once staged (sender thread; on GPU its stream
        waits for the copy)."""
        for k, (a, b) in enumerate(self.ranges):
            with self.cond:
                if not self.cond.wait_for(lambda: self.staged > k or self.stopping.is_set(), self.timeout_s):
                    raise TimeoutError(f"bucket {k} of v{self.version} was not staged within {self.timeout_s:.0f} s")
            if self.staged <= k:  # closing, and the main thread will never stage it
                raise RuntimeError("the publisher is closing")
            if self.events:
                torch.cuda.current_stream(self.device).wait_event(self.events[k])
            yield self.staging[a:b]

    def _drop_group(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None
