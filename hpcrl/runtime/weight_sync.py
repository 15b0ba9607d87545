"""Trainer -> rollout weight sync: staged on the trainer, pushed to rollout at a round boundary.

Two halves, so that neither side waits on the other's work:
- **stage** (the trainer's call, right after a train step): every pipeline stage's leader copies
  its stage's full HF-named tensors (Megatron gathers TP shards bucket by bucket, ZeRO-3 and FSDP
  gather over DP) into a host copy laid out in fixed flat buckets. The trainer then goes on with
  the next batch.
- **push** (when rollout is between rounds): each stage leader's *weight server*, a thread of its
  own, broadcasts the staged buckets over its stage's sync group to every rank that loads weights,
  all stages at once, two buckets in flight per stage; loaders load bucket by bucket as they land
  (the native sampler receives straight into its weights). A loader that is itself a stage's
  leader (colocated) takes that stage from its own host copy.
So no collective ever waits for a generation round or a train step to end: a push is started only
when its loaders are idle, and the sync groups get their own timeout (`rollout.sync_timeout_s`).
The groups are gloo (host memory): a staged copy lives in host memory, and the server's thread
must not share the training stream's NCCL communicators. The one exception is vLLM on GPUs of its
own: the buckets then go from pinned memory over an NCCL communicator of their own straight to
vLLM's TP workers (`DeviceChannel`); only the bucket plan travels over gloo.
"""
from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from hpcrl.engines.base import NamedTensors
from hpcrl.engines.resharding import DEFAULT_BUCKET_BYTES, Meta, named_buckets
from hpcrl.runtime.messages import TAG_SYNC
from hpcrl.runtime.mpi_world import report_and_wait
from hpcrl.runtime.worker import serve

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


def push(staged: StagedWeights, group: dist.ProcessGroup, src: int, device: DeviceChannel | None = None) -> int:
    """Send the staged buckets from `src`: their plan over `group`, then the buckets over `group`
    (host memory, to `WeightReceiver.receive`) or over the `device` channel (GPU to vLLM's TP
    workers, to `VLLMEngine.receive_pushed`)."""
    dist.broadcast_object_list([[b.meta for b in staged.buckets]], src=src, group=group)
    if device is not None:
        device.send(staged)
        return sum(b.flat.nbytes for b in staged.buckets)
    works: deque = deque()
    for bucket in staged.buckets:
        works.append(dist.broadcast(bucket.flat, src=src, group=group, async_op=True))
        if len(works) > IN_FLIGHT:
            works.popleft().wait()
    for work in works:
        work.wait()
    return sum(b.flat.nbytes for b in staged.buckets)


class DeviceChannel:
    """A stage leader's NCCL communicator with vLLM's TP workers (their stateless process group:
    the leader is rank 0), and two device buffers: one bucket is copied in from pinned host memory
    on one stream while the previous one is broadcast on another."""

    def __init__(self, address: dict, device: torch.device):
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        self.device = device
        group = StatelessProcessGroup.create(host=address["host"], port=address["port"], rank=0,
                                             world_size=address["world_size"], store_timeout=address["timeout_s"])
        self.comm = PyNcclCommunicator(group, device=device)
        self.copy_stream, self.send_stream = torch.cuda.Stream(device), torch.cuda.Stream(device)
        self.buffers: list[torch.Tensor] = [torch.empty(0, dtype=torch.uint8, device=device)] * 2

    def send(self, staged: StagedWeights) -> None:
        largest = max((b.flat.nbytes for b in staged.buckets), default=0)
        if self.buffers[0].numel() < largest:   # both streams are idle between sends: safe to replace
            self.buffers = [torch.empty(largest, dtype=torch.uint8, device=self.device) for _ in range(2)]
        free = [torch.cuda.Event(), torch.cuda.Event()]
        for index, bucket in enumerate(staged.buckets):
            slot = index % 2
            target = self.buffers[slot][:bucket.flat.nbytes].view(bucket.flat.dtype)
            copied = torch.cuda.Event()
            with torch.cuda.stream(self.copy_stream):
                self.copy_stream.wait_event(free[slot])     # the broadcast two buckets back is done
                target.copy_(bucket.flat, non_blocking=True)
                copied.record(self.copy_stream)
            self.send_stream.wait_event(copied)
            self.comm.broadcast(target, src=0, stream=self.send_stream)
            free[slot].record(self.send_stream)
        self.send_stream.synchronize()


def receive_object(group: dist.ProcessGroup, src: int):
    """What `src` broadcasts over `group` as an object: a push's bucket plan (push's first
    broadcast), or where a stage leader meets vLLM's workers."""
    holder: list = [None]
    dist.broadcast_object_list(holder, src=src, group=group)
    return holder[0]


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
        streams = [_Stream(stage, source, deque(receive_object(source.group, source.src)))
                   for stage, source in enumerate(sources) if source.local is None]
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
    push runs while the trainer's main thread trains the next batch. With `vllm_address` (rollout
    is vLLM on GPUs of its own) it first connects to vLLM's TP workers and pushes over NCCL."""

    def __init__(self, staged: StagedWeights, group: dist.ProcessGroup, device: str = "cpu",
                 vllm_address: dict | None = None):
        self.staged = staged
        self.group = group
        self.device = torch.device(device)
        self.vllm_address = vllm_address
        self.thread = threading.Thread(target=self._serve, name="hpcrl-weight-server", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        channel = None
        try:
            if self.vllm_address is not None:
                torch.cuda.set_device(self.device)
                channel = DeviceChannel(self.vllm_address, self.device)
        except BaseException:
            report_and_wait("actor_train", "connect to vLLM's workers")
            return
        serve({"actor_train": _Pusher(self.staged, self.group, channel)}, tag=TAG_SYNC)


@dataclass
class _Pusher:
    """What the weight server's thread answers: push the staged version the controller names."""

    staged: StagedWeights
    group: dist.ProcessGroup
    channel: DeviceChannel | None

    def push(self, version: int) -> int:
        if self.staged.version != version:
            raise RuntimeError(f"asked to push policy version {version}, but version {self.staged.version} is staged")
        return push(self.staged, self.group, dist.get_rank(), self.channel)
