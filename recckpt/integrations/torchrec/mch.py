"""A managed-collision (MCH) TorchRec table as a recckpt sparse table keyed by raw id.

TorchRec's `MCHManagedCollisionModule` maps raw ids onto the slots (rows) of its table: per shard it keeps
`_mch_sorted_raw_ids` (the admitted raw ids, sorted, padded with INT64_MAX), `_mch_remapped_ids_mapping`
(the global row of each) and its eviction policy's per-id metadata (`_mch_counts` for LFU,
`_mch_last_access_iter` for LRU). A shard of z rows admits at most z - 1 ids: its last slot takes every
id it has not admitted. Sharded (row-wise only), raw ids are routed to shards by range: with B buckets
(one per shard) and input size H, id x goes to shard x // ceil(H / B).

The checkpoint holds one row per admitted raw id: its embedding, its optimizer state and its metadata
(`mch.counts`, `mch.last_access_iter`). Loading onto another plan routes every saved id as the new
plan does, gives the ids of a shard the slots of that shard in raw-id order, and writes each id's rows
there (`RoutedRows`). Rows of slots that hold no admitted id (the miss slot, free slots) are not saved.
The table is saved with "id_range" buckets over [0, input_hash_size) (`id_space`), so a loading shard
reads the rows of its raw-id range (`owned_ids`) only, and the other shards' raw ids to count them.
"""
from __future__ import annotations

from typing import Dict, Iterator, List, Sequence, Tuple

import torch
import torch.distributed as dist

from ...errors import IncompatibleCheckpointError, InvalidArgumentError
from ...state.protocol import Admission, Admitted, SlotSpec
from .table import SlotsTable, TorchRecTable

EMPTY = torch.iinfo(torch.int64).max
MCH_PREFIX = "mch."
#: eviction policy class -> the metadata slot that ranks ids for 'evict' (higher is kept first)
RANK_BY = {"LFU_EvictionPolicy": "mch.counts", "LRU_EvictionPolicy": "mch.last_access_iter"}


def metadata_names(module) -> List[str]:
    """The per-id metadata buffers (without `_mch_`) of an MCH module's eviction policy."""
    return [m[0] for m in module._eviction_policy.metadata_info if m[1]]


def persistent_buffers(module) -> List[str]:
    """The MCH module's buffers that this table saves and loads as ids and slots, or that derive from the
    sharding plan (`_output_segments_tensor`), so are never loaded from a checkpoint of another plan."""
    return (["_mch_sorted_raw_ids", "_mch_remapped_ids_mapping", "_output_segments_tensor"]
            + [f"_mch_{n}" for n in metadata_names(module)])


def _segments(module) -> List[int]:
    seg = [int(x) for x in module._output_segments_tensor.tolist()]
    return seg[:seg.index(-1)] if -1 in seg else seg


def route(ids: torch.Tensor, input_size: int, buckets: int) -> torch.Tensor:
    """The shard of each raw id, as TorchRec's row-wise input distribution computes it (FBGEMM's block
    bucketize: id // block for 0 <= id < block * buckets, else the id as unsigned 64-bit, modulo buckets)."""
    if buckets == 1:
        return torch.zeros(ids.shape[0], dtype=torch.int64)
    block = -(-input_size // buckets)
    top = block * buckets   # may pass 2**63 (the default input size 2**63 - 1): every id >= 0 is inside
    inside = (ids >= 0) if top > torch.iinfo(torch.int64).max else (ids >= 0) & (ids < top)
    # unsigned(id) mod b == (id mod b + 2**64 mod b) mod b for a negative id
    wrapped = torch.where(ids >= 0, ids % buckets, (ids % buckets + (2 ** 64) % buckets) % buckets)
    return torch.where(inside, ids // block, wrapped)


class MCHTable(SlotsTable):
    """One MCH table (its TorchRec table `inner`, keyed by row, and this process's MCH module for it),
    keyed by raw id. Implements `SparseState` and `RoutedRows`."""
    kind = "TorchRec MCH table"

    def __init__(self, inner: TorchRecTable, module, writes: bool):
        self.inner, self.module, self.writes = inner, module, writes
        self.name = inner.name
        self.meta_names = metadata_names(module)
        self.slots: Dict[str, SlotSpec] = dict(inner.slots)
        for n in self.meta_names:
            self.slots[MCH_PREFIX + n] = SlotSpec(torch.int64, (), "sparse")
        seg = _segments(module)
        self.offset, self.size = int(module._output_global_offset), int(module._zch_size)
        if self.offset not in seg:
            raise InvalidArgumentError(f"TorchRec MCH table {self.name!r}: its shard starts at row {self.offset}, "
                                       f"which is not one of its plan's segments {seg}")
        self.segments = seg
        self.shard = seg.index(self.offset)
        self._planned: torch.Tensor | None = None

    # -------------------------------------------------------------------------------- protocol
    def _admitted(self) -> torch.Tensor:
        return torch.nonzero(self.module._mch_sorted_raw_ids != EMPTY).reshape(-1)

    def local_rows(self) -> int:
        return int(self._admitted().shape[0]) if self.writes else 0

    def export_chunks(self, slots: Sequence[str], max_rows: int
                      ) -> Iterator[Tuple[torch.Tensor, Dict[str, torch.Tensor]]]:
        """The admitted raw ids of this process's shard with their rows (an unsharded module in a job of
        several processes is written by rank 0 only)."""
        self.check_slots(slots)
        if max_rows < 1:
            raise InvalidArgumentError(f"export_chunks: max_rows must be >= 1, got {max_rows}")
        if not self.writes:
            return
        pos = self._admitted()
        raw, mapping = self.module._mch_sorted_raw_ids, self.module._mch_remapped_ids_mapping
        inner_slots = [s for s in slots if s in self.inner.slots]
        for i in range(0, pos.shape[0], max_rows):
            p = pos[i:i + max_rows]
            cols = self.inner.read_rows(mapping[p].clone(), inner_slots)
            out = {}
            for s in slots:
                out[s] = cols[s] if s in cols else getattr(self.module, "_mch_" + s[len(MCH_PREFIX):])[p].clone()
            yield raw[p].clone(), out

    # ------------------------------------------------------------------------------- RoutedRows
    def plan_slots(self) -> Sequence[str]:
        slot = RANK_BY.get(type(self.module._eviction_policy).__name__)
        return [slot] if slot in self.slots else []

    def unholdable(self, ids: torch.Tensor) -> Dict[str, torch.Tensor]:
        """Masks over raw ids this module cannot hold, by reason: negative ids, the empty-slot sentinel
        (INT64_MAX: `_mch_sorted_raw_ids` pads with it, so such an id would read as a free slot) and ids
        at or past `input_hash_size` (TorchRec would route such an id by wrapping it, not as itself)."""
        size = int(self.module.input_size())
        return {"negative": ids < 0, "empty_sentinel": ids == EMPTY,
                "outside_input_size": (ids >= size) & (ids != EMPTY)}

    def plan_rows(self, chunks, loaded_slots: Sequence[str], admission: Admission) -> Admitted:
        """Route every saved raw id as this plan does; keep this shard's (at most size - 1 of them). Ids the
        module cannot hold (`unholdable`) are refused under strict, else left out and counted. Where a
        shard gets more ids than it holds: with `admission.rank_by` the highest values of that slot are
        admitted, with overflow 'evict' the module's own policy ranks them, else the load fails. Every
        process counts every shard, so a refusal anywhere fails the load on every process alike."""
        if "embedding" not in loaded_slots:
            raise IncompatibleCheckpointError(
                f"TorchRec MCH table {self.name!r}: its raw ids are loaded together with their embeddings; a "
                f"load without the 'embedding' slot (or without 'sparse') cannot place them")
        nshards = len(self.segments) - 1
        buckets = int(self.module.buckets()) if nshards > 1 else 1
        if buckets != nshards:
            raise InvalidArgumentError(f"TorchRec MCH table {self.name!r}: {nshards} shards but {buckets} input "
                                       f"buckets; recckpt routes raw ids with one bucket per shard")
        input_size = int(self.module.input_size())
        counts = torch.zeros(nshards, dtype=torch.int64)
        refused: Dict[str, int] = {}
        examples: Dict[str, List[int]] = {}
        mine_ids, mine_rank = [], []
        rank_slot = admission.rank_by or (self.plan_slots() or [None])[0]
        for ids, cols in chunks:
            bad = torch.zeros(ids.shape[0], dtype=torch.bool)
            for why, mask in self.unholdable(ids).items():
                k = int(mask.sum())
                if k:
                    refused[why] = refused.get(why, 0) + k
                    examples.setdefault(why, []).extend(ids[mask][:3].tolist())
                    bad |= mask
            if bool(bad.any()):
                ids, cols = ids[~bad], {s: c[~bad] for s, c in cols.items()}
            shard = route(ids, input_size, nshards)
            counts += torch.bincount(shard, minlength=nshards)
            sel = shard == self.shard
            if not bool(sel.any()):
                continue   # (a loader may hand other shards' ids without their slots: it counts them only)
            mine_ids.append(ids[sel].clone())
            if rank_slot in cols:
                mine_rank.append(cols[rank_slot][sel].clone())
        if refused and admission.strict:
            text = ", ".join(f"{n} {why.replace('_', ' ')} (e.g. {examples[why][:3]})" for why, n in refused.items())
            raise IncompatibleCheckpointError(
                f"TorchRec MCH table {self.name!r}: the checkpoint holds ids this table cannot hold: {text}; its "
                f"raw ids must lie in [0, input_hash_size = {input_size}). Pass load_conf {{'strict': False}} to "
                f"leave them out (counted in LoadResult.admission)")
        caps = [self.segments[i + 1] - self.segments[i] - 1 for i in range(nshards)]
        over = [(i, int(counts[i]), caps[i]) for i in range(nshards) if int(counts[i]) > caps[i]]
        ids = torch.cat(mine_ids) if mine_ids else torch.empty(0, dtype=torch.int64)
        cap = caps[self.shard]
        if over and admission.overflow == "error" and admission.rank_by is None:
            text = ", ".join(f"shard {i} (rows {self.segments[i]}..{self.segments[i + 1] - 1}) gets {n} ids "
                             f"for {c} slots" for i, n, c in over)
            raise IncompatibleCheckpointError(
                f"TorchRec MCH table {self.name!r}: the checkpoint's {int(counts.sum())} admitted ids do not fit "
                f"this plan: {text} (a shard of z rows admits z - 1 ids). Give the table more rows, or pass "
                f"load_conf {{'overflow': 'evict'}} to keep the ids its eviction policy ranks highest, or "
                f"{{'admit_by': '<slot>'}} (e.g. 'freq') to keep those with the highest values of a saved slot")
        if ids.shape[0] > cap:
            if rank_slot is None or len(mine_rank) != len(mine_ids):
                raise IncompatibleCheckpointError(
                    f"TorchRec MCH table {self.name!r}: shard {self.shard} gets {ids.shape[0]} ids for {cap} "
                    f"slots, and its eviction policy {type(self.module._eviction_policy).__name__} has no "
                    f"saved metadata slot recckpt can rank ids by (it knows {sorted(RANK_BY)}); pass load_conf "
                    f"{{'admit_by': '<slot>'}} to rank them by a saved slot")
            score = torch.cat(mine_rank)
            order = torch.argsort(ids)                       # ties: the smaller raw id is kept
            ids, score = ids[order], score[order]
            keep = torch.argsort(score, descending=True, stable=True)[:cap]
            ids = ids[keep]
        self._planned = torch.sort(ids).values
        admitted = sum(min(int(counts[i]), caps[i]) for i in range(nshards))
        return Admitted(admitted, int(counts.sum()) - admitted, refused, int(self._planned.shape[0]))

    def id_space(self) -> int:
        """TorchRec routes raw ids by range of [0, input_hash_size): the table is saved by id range."""
        return int(self.module.input_size())

    def owned_ids(self) -> Tuple[int, int] | None:
        """The raw ids `route` gives this shard: [s * block, (s + 1) * block) within [0, input_hash_size)."""
        nshards = len(self.segments) - 1
        if nshards == 1:
            return None
        size = int(self.module.input_size())
        block = -(-size // nshards)
        return min(self.shard * block, size), min((self.shard + 1) * block, size)

    def keep(self, ids: torch.Tensor) -> torch.Tensor:
        if self._planned is None:
            raise InvalidArgumentError(f"TorchRec MCH table {self.name!r}: rows loaded without a plan (plan_rows)")
        return torch.isin(ids, self._planned)

    def clear_rows(self) -> None:
        """Install the planned ids: the k kept raw ids, sorted, take this shard's first k slots in that
        order; the other slots are free (the last one takes ids not admitted); metadata starts at 0."""
        if self._planned is None:
            raise InvalidArgumentError(f"TorchRec MCH table {self.name!r} is replaced only by a planned load")
        k, m = int(self._planned.shape[0]), self.module
        with torch.no_grad():
            m._mch_sorted_raw_ids.fill_(EMPTY)
            m._mch_sorted_raw_ids[:k] = self._planned
            m._mch_remapped_ids_mapping.copy_(torch.arange(self.offset, self.offset + self.size, dtype=torch.int64))
            for n in self.meta_names:
                getattr(m, "_mch_" + n).zero_()

    def reset_slots(self, slots: Sequence[str]) -> None:
        """After `clear_rows`: slots `slots`, which the load leaves out, start over in the rows of the planned
        ids (optimizer state at its initial value; the metadata was zeroed by `clear_rows`). Without this
        each admitted id would train on with the optimizer state of whatever id its row held before."""
        self.check_slots(slots)
        if self._planned is None:
            raise InvalidArgumentError(f"TorchRec MCH table {self.name!r} is replaced only by a planned load")
        inner = [s for s in slots if s in self.inner.slots]
        if inner:
            self.inner.reset_slots(inner, (self.offset, self.offset + int(self._planned.shape[0])))

    def import_rows(self, ids: torch.Tensor, columns: Dict[str, torch.Tensor]) -> None:
        """Rows of planned ids (after `clear_rows`): each id's rows go to its slot."""
        self.check_slots(list(columns))
        if self._planned is None:
            raise InvalidArgumentError(f"TorchRec MCH table {self.name!r}: rows loaded without a plan (plan_rows)")
        if ids.shape[0] == 0:
            return
        pos = torch.searchsorted(self._planned, ids)
        pos_c = pos.clamp(max=max(self._planned.shape[0] - 1, 0))
        if self._planned.shape[0] == 0 or not bool((self._planned[pos_c] == ids).all()):
            raise InvalidArgumentError(f"TorchRec MCH table {self.name!r}: ids not planned for this shard")
        inner = {s: c for s, c in columns.items() if s in self.inner.slots}
        for s, c in columns.items():
            if s not in inner and (c.dtype != torch.int64 or tuple(c.shape) != (ids.shape[0],)):
                raise InvalidArgumentError(f"TorchRec MCH table {self.name!r}, slot {s!r}: expected int64 "
                                           f"({ids.shape[0]},), got {c.dtype} {tuple(c.shape)}")
        if inner:
            self.inner.import_rows(pos + self.offset, inner)
        with torch.no_grad():
            for s, c in columns.items():
                if s not in inner:
                    getattr(self.module, "_mch_" + s[len(MCH_PREFIX):])[pos] = c


def writes_unsharded() -> bool:
    """An unsharded MCH module is the same in every process: rank 0 writes it."""
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
