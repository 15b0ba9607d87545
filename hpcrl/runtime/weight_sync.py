"""Trainer -> rollout weight sync: staged on the trainer, pushed to rollout at a round boundary.

Two halves, so that neither side waits on the other's work:
- **stage** (the trainer's call, right after a train step): every pipeline stage's leader copies
  its stage's full HF-named tensors (Megatron gathers TP shards bucket by bucket, ZeRO-3 and FSDP
  gather over DP) into a host copy laid out in fixed flat buckets. The trainer then goes on with
  the next batch.
- **push** (when rollout is between rounds): each stage leader's *weight server*, a thread of its
  own, broadcasts the staged buckets over its stage's sync group to every rank that loads weights,
  all stages at once, two buckets in flight per stage; loaders load bucket by bucket as they land.
  A loader that is itself a stage's leader (colocated) takes that stage from its own host copy.
So no collective ever waits for a generation round or a train step to end: a push is started only
when its loaders are idle, and the sync groups get their own timeout (`rollout.sync_timeout_s`).
The groups are gloo (host memory): a staged copy lives in host memory, and a thread may not share
the training stream's NCCL communicators.
"""
from __future__ import annotations

import hashlib
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from hpcrl.engines.base import NamedTensors
from hpcrl.engines.resharding import DEFAULT_BUCKET_BYTES, Meta, named_buckets
from hpcrl.runtime.faults import maybe_fail
from hpcrl.runtime.messages import SHUTDOWN, TAG_REPLY, TAG_SYNC, Call, Reply
from hpcrl.runtime.mpi_world import COMM, CONTROLLER, poll_recv, report_and_wait, send

IN_FLIGHT = 2   # buckets per stage on the wire at once: one lands while the next is sent


@dataclass
class _Bucket:
    meta: Meta
    flat: torch.Tensor

    def tensors(self) -> NamedTensors:
        out, start = [], 0
        for name, shape, _ in self.meta:
            count = torch.Size(shape).numel()
            out.append((name, self.flat[start:start + count].view(shape)))
            start += count
        return out


class StagedWeights:
    """One stage leader's host copy of its stage's HF tensors, in flat buckets allocated once."""

    def __init__(self, pin_memory: bool = False, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        self.pin_memory = pin_memory
        self.bucket_bytes = bucket_bytes
        self.buckets: list[_Bucket] = []
        self.version = -1

    @torch.no_grad()
    def stage(self, named: Iterable[tuple[str, torch.Tensor]], version: int) -> int:
        """Copy the weights in (one pass, one copy; D2H into pinned memory on GPUs); returns bytes."""
        staged = []
        for index, bucket in enumerate(named_buckets(named, self.bucket_bytes)):
            meta = [(n, tuple(t.shape), t.dtype) for n, t in bucket]
            if index < len(self.buckets) and self.buckets[index].meta == meta:
                target = self.buckets[index]
            else:
                count = sum(t.numel() for _, t in bucket)
                target = _Bucket(meta, torch.empty(count, dtype=meta[0][2], pin_memory=self.pin_memory))
            for (_, view), (_, tensor) in zip(target.tensors(), bucket):
                view.copy_(tensor, non_blocking=self.pin_memory)
            staged.append(target)
        if self.pin_memory:
            torch.cuda.current_stream().synchronize()
        self.buckets = staged
        self.version = version
        return sum(b.flat.nbytes for b in staged)

    def named(self) -> Iterator[NamedTensors]:
        for bucket in self.buckets:
            yield bucket.tensors()


def push(staged: StagedWeights, group: dist.ProcessGroup, src: int) -> int:
    """Broadcast the staged buckets from `src` over `group` (the other side is `receive`)."""
    dist.broadcast_object_list([[b.meta for b in staged.buckets]], src=src, group=group)
    works: deque = deque()
    for bucket in staged.buckets:
        works.append(dist.broadcast(bucket.flat, src=src, group=group, async_op=True))
        if len(works) > IN_FLIGHT:
            works.popleft().wait()
    for work in works:
        work.wait()
    return sum(b.flat.nbytes for b in staged.buckets)


@dataclass
class Source:
    """Where a loader gets one pipeline stage from: a sync group and its sending rank, or (when
    the loader is that stage's leader) the staged copy in its own memory."""

    group: dist.ProcessGroup | None = None
    src: int = -1
    local: StagedWeights | None = None


Landing = Callable[[Meta], "torch.Tensor | None"]


class WeightReceiver:
    """A loader's side of the push. A bucket lands straight in the engine's weights where the
    engine offers a flat tensor for it (`landing`: the native sampler on the CPU), else in receive
    buffers kept from one sync to the next (a ring of IN_FLIGHT + 1 per stage): fresh memory would
    cost a page fault per 4 KiB, which on this machine halved the sync's throughput."""

    def __init__(self, landing: Landing | None = None) -> None:
        self.landing = landing
        self.rings: dict[int, list[torch.Tensor]] = {}   # stage -> byte buffers

    def _buffer(self, stage: int, slot: int, meta: Meta) -> torch.Tensor:
        count = sum(torch.Size(s).numel() for _, s, _ in meta)
        nbytes = count * meta[0][2].itemsize
        ring = self.rings.setdefault(stage, [torch.empty(0, dtype=torch.uint8)] * (IN_FLIGHT + 1))
        if ring[slot].numel() < nbytes:
            ring[slot] = torch.empty(nbytes, dtype=torch.uint8)
        return ring[slot][:nbytes].view(meta[0][2])

    def receive(self, sources: list[Source]) -> Iterator[tuple[NamedTensors, bool]]:
        """Every stage's buckets as they arrive, each with whether it has landed in the engine
        already (else: host tensors, valid until the next bucket is taken, for the engine to load).
        All remote stages stream at once; their buckets are yielded round-robin."""
        for source in sources:
            if source.local is not None:
                for bucket in source.local.named():
                    yield bucket, False
        streams = []
        for stage, source in enumerate(sources):
            if source.local is None:
                holder: list = [None]
                dist.broadcast_object_list(holder, src=source.src, group=source.group)
                streams.append(_Stream(stage, source, deque(holder[0])))
        for stream in streams:
            for _ in range(min(IN_FLIGHT, len(stream.plan))):
                self._post(stream)
        while any(stream.posted for stream in streams):
            for stream in streams:
                if not stream.posted:
                    continue
                bucket, landed, work = stream.posted.popleft()
                work.wait()
                if stream.plan:
                    self._post(stream)
                yield bucket.tensors(), landed

    def _post(self, stream: _Stream) -> None:
        meta = stream.plan.popleft()
        flat = self.landing(meta) if self.landing is not None else None
        landed = flat is not None
        if not landed:
            flat = self._buffer(stream.stage, stream.count % (IN_FLIGHT + 1), meta)
            stream.count += 1
        work = dist.broadcast(flat, src=stream.source.src, group=stream.source.group, async_op=True)
        stream.posted.append((_Bucket(meta, flat), landed, work))


@dataclass
class _Stream:
    """One remote stage being received: the buckets still to post, and those on the wire."""

    stage: int
    source: Source
    plan: deque
    posted: deque = field(default_factory=deque)
    count: int = 0


class WeightServer:
    """The thread on a stage leader that answers the controller's pushes (MPI tag TAG_SYNC), so a
    push runs while the trainer's main thread trains the next batch."""

    def __init__(self, staged: StagedWeights, group: dist.ProcessGroup):
        self.staged = staged
        self.group = group
        self.thread = threading.Thread(target=self._serve, name="hpcrl-weight-server", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        rank = COMM.Get_rank()
        while True:
            call, _, _ = poll_recv(source=CONTROLLER, tag=TAG_SYNC)
            assert isinstance(call, Call)
            if call.method == SHUTDOWN:
                send(Reply(call.call_id, None), CONTROLLER, TAG_REPLY)
                return
            try:
                maybe_fail(rank, "push")
                version, = call.args
                if self.staged.version != version:
                    raise RuntimeError(f"asked to push policy version {version}, but version "
                                       f"{self.staged.version} is staged")
                moved = push(self.staged, self.group, rank)
            except BaseException:
                report_and_wait("actor_train", "push")
                return
            send(Reply(call.call_id, moved), CONTROLLER, TAG_REPLY)


# ---- digests -------------------------------------------------------------------------------------------------------

@torch.no_grad()
def tensor_digests(named: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, str]]:
    """(name, SHA-256 of the bytes) of every tensor: collect them bucket by bucket, then combine."""
    return [(name, hashlib.sha256(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest())
            for name, t in named]


def combine_digests(per_tensor: list[tuple[str, str]]) -> str | None:
    """One digest over (name, digest) pairs in name order (None for no tensors): equal digests mean
    bit-identical weights, whatever order or sharding the engine holding them iterates in."""
    if not per_tensor:
        return None
    return hashlib.sha256("".join(f"{n}={d};" for n, d in sorted(per_tensor)).encode()).hexdigest()


def weights_digest(named: Iterable[tuple[str, torch.Tensor]]) -> str | None:
    return combine_digests(tensor_digests(named))
