"""Moving table chunks between a device and the host through bounded, reusable host buffers.

Device to host (saves): :class:`StagingPool` turns a table's export chunks, whose columns may live on
a device, into host chunks. Copies go through a fixed number of host buffers (two by default), pinned
when the source is CUDA (only then: pinning is a page-locking system call that costs more than it
saves for a host-to-host copy), allocated once and reused across saves; together they never exceed
``max_bytes`` whatever the table size. On CUDA the copy of the next piece runs on a side stream
while the consumer works on the current one (double buffering, an event per buffer); on the CPU the
same code does a plain synchronous copy, so CPU CI runs the path a GPU save runs.

Host to device (loads): :class:`HostToDevice` lends host buffers for the reader to fill and copies
them to a device table's storage, the copy of one batch overlapping the reading of the next.

Which tensors take these paths is decided in one place, :func:`needs_staging` (tests replace it to
send CPU tensors through them).
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

from ..errors import CheckpointSaveError, InvalidArgumentError

__all__ = ["HostChunk", "HostToDevice", "StagingPool", "needs_staging"]

_ALIGN = 64  # each column of a piece starts on a cache line (and a safe alignment for every dtype)

Chunk = tuple[torch.Tensor, dict[str, torch.Tensor]]


def needs_staging(t: torch.Tensor) -> bool:
    """Whether a tensor must be copied through host buffers to reach (or leave) host memory."""
    return t.device.type != "cpu"


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _row_bytes(t: torch.Tensor) -> int:
    return int(torch.Size(t.shape[1:]).numel()) * t.element_size()


@dataclass
class HostChunk:
    """One piece of a table on the host. ``borrowed``: the tensors are views of a staging buffer,
    valid until the next piece is requested (copy them to keep them); otherwise they are the
    source's own host tensors."""
    ids: torch.Tensor
    cols: dict[str, torch.Tensor]
    borrowed: bool


class _Buffer:
    """One reusable host buffer and the event of the copy last started into it."""

    def __init__(self) -> None:
        self.mem: torch.Tensor | None = None
        self.pinned = False
        self.event = None

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()
            self.event = None


class _Copier:
    """Starts copies on a device's side stream (CUDA) or runs them at once (anything else)."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, object] = {}

    def _side(self, device: torch.device):
        s = self._streams.get(device)
        if s is None:
            s = self._streams[device] = torch.cuda.Stream(device=device)
        return s

    def copy(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], device: torch.device, *,
             to_device: bool):
        """Copy each ``src`` into its ``dst``; returns an event to wait on (None: already done).
        ``device`` is the non-host side of the copies."""
        if device.type != "cuda":
            for dst, src in pairs:
                dst.copy_(src)
            return None
        side, main = self._side(device), torch.cuda.current_stream(device)
        side.wait_stream(main)  # the data (or the storage being written) was produced on the main stream
        with torch.cuda.stream(side):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
                (dst if to_device else src).record_stream(side)  # not reused by the allocator mid-copy
            event = torch.cuda.Event()
            event.record(side)
        if to_device:  # later work on the table (growth, training) sees the rows
            main.wait_stream(side)
        return event


class StagingPool:
    """A bounded pool of reusable host buffers for copying table chunks off a device.

    Args:
        max_bytes: host memory (pinned for CUDA sources) the pool may hold in all, split evenly
            between ``buffers`` buffers. A piece never exceeds one buffer, so the pool needs at
            least one row of a table's device columns per buffer.
        buffers: number of buffers; 2 is double buffering (one being filled, one being consumed).
    """

    def __init__(self, max_bytes: int, buffers: int = 2) -> None:
        if isinstance(buffers, bool) or not isinstance(buffers, int) or buffers < 1:
            raise InvalidArgumentError(f"StagingPool: buffers must be an int >= 1, got {buffers!r}")
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < buffers * _ALIGN:
            raise InvalidArgumentError(f"StagingPool: max_bytes must be an int >= {buffers * _ALIGN}, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self.buffer_bytes = max_bytes // buffers
        self._bufs = [_Buffer() for _ in range(buffers)]
        self._copier = _Copier()
        self.peak_bytes = 0
        self.pieces = 0  # pieces copied through the buffers (for tests and benchmarks)

    @property
    def allocated_bytes(self) -> int:
        return sum(b.mem.numel() for b in self._bufs if b.mem is not None)

    def _memory(self, buf: _Buffer, nbytes: int, pinned: bool) -> torch.Tensor:
        if buf.mem is None or buf.mem.numel() < nbytes or buf.pinned != pinned:
            buf.mem = None  # freed before the new one is made: the pool never holds more than its bound
            buf.mem = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
            buf.pinned = pinned
            self.peak_bytes = max(self.peak_bytes, self.allocated_bytes)
        return buf.mem

    def stage(self, chunks: Iterable[Chunk], what: str, row_multiple: int = 1) -> Iterator[HostChunk]:
        """Host versions of ``chunks`` (``(ids, {slot: column})`` with rows along dim 0), in order.

        Chunks whose tensors are all on the host pass through untouched (``borrowed=False``). Others
        are split into pieces that fit one buffer (a multiple of ``row_multiple`` rows where a buffer
        holds that many) and copied; a borrowed piece is valid until the next one is requested.
        ``what`` names the table in errors."""
        pending: tuple[_Buffer, HostChunk] | None = None
        turn = 0
        try:
            for ids, cols in chunks:
                tensors = {"": ids, **cols}
                staged = [k for k, t in tensors.items() if needs_staging(t)]
                if not staged:
                    if pending is not None:
                        yield self._finish(*pending)
                        pending = None
                    yield HostChunk(ids, dict(cols), False)
                    continue
                for lo, hi in self._pieces(ids.shape[0], [tensors[k] for k in staged], what, row_multiple):
                    buf = self._bufs[turn % len(self._bufs)]
                    turn += 1
                    buf.wait()  # its previous piece was handed out and given back (the consumer asked on)
                    started = self._start(buf, {k: t[lo:hi] for k, t in tensors.items()}, staged)
                    if pending is not None:
                        yield self._finish(*pending)
                    pending = (buf, started)
            if pending is not None:
                yield self._finish(*pending)
                pending = None
        finally:
            for b in self._bufs:  # an abandoned iteration must not leave copies writing into reused memory
                b.wait()

    def _pieces(self, n: int, staged: list[torch.Tensor], what: str, row_multiple: int):
        per_row = sum(_row_bytes(t) for t in staged)
        room = self.buffer_bytes - _ALIGN * len(staged)  # alignment padding of each column
        rows = room // per_row if per_row else n
        if rows < 1:
            raise CheckpointSaveError(
                f"{what}: one row of its device columns takes {per_row} bytes, more than a staging buffer "
                f"({self.buffer_bytes} bytes, a share of SaveOptions.staging_bytes={self.max_bytes}); "
                f"raise SaveOptions.staging_bytes")
        if rows >= row_multiple:
            rows -= rows % row_multiple
        for lo in range(0, n, rows):
            yield lo, min(n, lo + rows)

    def _start(self, buf: _Buffer, piece: dict[str, torch.Tensor], staged: list[str]) -> HostChunk:
        device = piece[staged[0]].device
        sizes = [_align(piece[k].numel() * piece[k].element_size()) for k in staged]
        mem = self._memory(buf, sum(sizes), pinned=device.type == "cuda")
        out, pairs, off = dict(piece), [], 0
        for k, size in zip(staged, sizes):
            src = piece[k]
            nb = src.numel() * src.element_size()
            dst = mem[off:off + nb].view(src.dtype).view(src.shape)
            pairs.append((dst, src))
            out[k] = dst
            off += size
        buf.event = self._copier.copy(pairs, device, to_device=False)
        self.pieces += 1
        ids = out.pop("")
        return HostChunk(ids, out, True)

    def _finish(self, buf: _Buffer, chunk: HostChunk) -> HostChunk:
        buf.wait()
        return chunk


class HostToDevice:
    """Host buffers a reader fills, copied to device storage, one batch's copy overlapping the next read.

    ``host_views(targets)`` gives a host tensor for each target not on the host (the others are
    returned as they are) in the next of ``buffers`` reusable buffers, waiting for that buffer's last
    copy first; ``upload(views, targets)`` starts the copies; ``finish()`` waits for all of them.
    Memory: ``buffers`` times the largest batch (the reader's batch size bounds it).
    """

    def __init__(self, buffers: int = 2) -> None:
        self._bufs = [_Buffer() for _ in range(buffers)]
        self._copier = _Copier()
        self._turn = 0
        self._current: _Buffer | None = None
        self.uploads = 0

    def host_views(self, targets: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        staged = [t for t in targets if needs_staging(t)]
        if not staged:
            return list(targets)
        buf = self._bufs[self._turn % len(self._bufs)]
        self._turn += 1
        buf.wait()
        sizes = [_align(t.numel() * t.element_size()) for t in staged]
        pinned = staged[0].device.type == "cuda"
        if buf.mem is None or buf.mem.numel() < sum(sizes) or buf.pinned != pinned:
            buf.mem = None
            buf.mem = torch.empty(sum(sizes), dtype=torch.uint8, pin_memory=pinned)
            buf.pinned = pinned
        self._current = buf
        out, off = [], 0
        it = iter(sizes)
        for t in targets:
            if not needs_staging(t):
                out.append(t)
                continue
            nb = t.numel() * t.element_size()
            out.append(buf.mem[off:off + nb].view(t.dtype).view(t.shape))
            off += next(it)
        return out

    def upload(self, views: Sequence[torch.Tensor], targets: Sequence[torch.Tensor]) -> None:
        pairs = [(t, v) for v, t in zip(views, targets) if v is not t]
        if not pairs:
            return
        self._current.event = self._copier.copy(pairs, pairs[0][0].device, to_device=True)
        self.uploads += 1

    def finish(self) -> None:
        for b in self._bufs:
            b.wait()
