"""Replica integrity: per-layer checksums compared across the replicas that hold a layer alike.

Replicas receive the same reduced gradients and the same clip coefficient bit for bit (docs/engine.md),
so every holder of a layer (or of the same shard of it, on stages sharded alike) holds the same bits
after every step. A checksum of those bits therefore agrees across holders unless something corrupted
one of them (a bit flip in memory, a faulty device's arithmetic): docs/detection.md, "Replica integrity".

Checksum: every tensor of the holding (parameters, buffers, optimizer state) is viewed as integers of
its element size, and all the words are summed into an int64 with wraparound. Integer addition is
associative, so the value does not depend on the reduction order (any device, any kernel, any
batching), and a single flipped bit changes one word by +-2^k, non-zero modulo 2^64: a single bit flip
is always seen. Errors that cancel exactly are not (the sum is blind to positions: two words swapped);
that is not what silent corruption looks like.

Pure logic here (`attribute`) decides who is the odd one out, from the checksums alone; the worker
(engine/worker.py) computes and exchanges them, and the supervisor evicts (supervisor/agent_nodes.py).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from oobleck_slurm.errors import InternalError

# A layer's holding, as a comparison key: (layer, stage width, index in the stage). Holders compare
# only when they hold the same elements: a whole layer (width 1) or the same shard of a stage of the
# same width.
GroupKey = tuple[int, int, int]

_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MASK32 = (1 << 32) - 1
BATCH_BYTES = 16 << 20  # smaller tensors are summed together, this many bytes at most at a time
CORRUPT_BIT = 20  # a drill's flip (faults.py "corrupt"): a mantissa bit of a float32 or float64, the value finite


class ReplicaMismatchError(InternalError, RuntimeError):
    """Replicas of a layer disagree (engine/integrity.py). Raised by `Worker.train_step` at a check
    whose step it withholds (no rank applies it: it is replayed after the eviction), carrying the
    verdict; also when the generation is not failed in time after the report."""

    def __init__(self, verdict: Verdict, step: int) -> None:
        self.verdict, self.step = verdict, step
        super().__init__(f"step {step}: {verdict.detail}")


class TransferCorruptError(InternalError, RuntimeError):
    """A layer received in a recovery copy disagrees with its sender's checksum, and no other holder
    is left to fetch it from."""


def tensor_sum(t: torch.Tensor) -> torch.Tensor:
    """The wraparound int64 sum of `t`'s raw words (a 0-d tensor on `t`'s device)."""
    flat = t.detach().reshape(-1)
    if flat.numel() == 0:
        return torch.zeros((), dtype=torch.int64, device=t.device)
    words = flat.contiguous().view(_INT_OF_SIZE[flat.element_size()])
    return words.sum(dtype=torch.int64)


def flip_bit(t: torch.Tensor, element: int, bit: int) -> None:
    """Flip bit `bit` of element `element` (flat index) of `t`, in place: a drill's silent corruption
    (engine/faults.py "corrupt"). `t` must be contiguous (a parameter, a state tensor, a flat shard)."""
    words = t.detach().view(-1).view(_INT_OF_SIZE[t.element_size()])
    bits = 8 * t.element_size()
    if not 0 <= bit < bits:
        raise ValueError(f"bit {bit} of a {bits}-bit element")
    mask = -(1 << bit) if bit == bits - 1 else 1 << bit  # the sign bit, in two's complement
    words[element % words.numel()] ^= mask


def checksum(tensors: Iterable[torch.Tensor], device: torch.device) -> torch.Tensor:
    """One holding's checksum (module doc): the sum of all its tensors' raw words modulo 2^64, as a 0-d
    int64 tensor on `device`. The cost is per tensor as much as per byte (a layer's optimizer state is
    dozens of small tensors), so tensors under BATCH_BYTES are concatenated, per device and word size,
    up to BATCH_BYTES at a time, and summed by one kernel (the measured figures: docs/benchmarks.md).
    No host sync on a GPU: host tensors (AdamW's step counters) are summed on the host and added as a
    number, not copied to the device one by one."""
    parts: list[torch.Tensor] = []
    pending: dict[tuple[torch.device, int], list[torch.Tensor]] = {}
    pending_bytes: dict[tuple[torch.device, int], int] = {}

    def flush(key: tuple[torch.device, int]) -> None:
        words = pending.pop(key, [])
        pending_bytes.pop(key, None)
        if words:
            parts.append(torch.cat(words).sum(dtype=torch.int64) if len(words) > 1 else words[0].sum(dtype=torch.int64))

    for t in tensors:
        flat = t.detach().reshape(-1)
        if flat.numel() == 0:
            continue
        words = flat.contiguous().view(_INT_OF_SIZE[flat.element_size()])
        nbytes = words.numel() * words.element_size()
        if nbytes >= BATCH_BYTES:
            parts.append(words.sum(dtype=torch.int64))
            continue
        key = (words.device, words.element_size())
        if pending_bytes.get(key, 0) + nbytes > BATCH_BYTES:
            flush(key)
        pending.setdefault(key, []).append(words)
        pending_bytes[key] = pending_bytes.get(key, 0) + nbytes
    for key in list(pending):
        flush(key)
    host = 0
    on_device: list[torch.Tensor] = []
    for part in parts:
        if part.device.type == "cpu" and device.type != "cpu":
            host += int(part)
        else:
            on_device.append(part.to(device))
    host %= 1 << 64
    host -= (1 << 64) if host >= 1 << 63 else 0  # as a signed int64: it wraps with the device's part
    if not on_device:
        return torch.tensor(host, dtype=torch.int64, device=device)
    return torch.stack(on_device).sum() + host


def pack(values: torch.Tensor) -> torch.Tensor:
    """int64 checksums as float64 pairs (low 32 bits, high 32 bits signed): both exact in a float64,
    so a SUM all-reduce where every other rank adds zeros carries them unchanged."""
    return torch.stack([(values & _MASK32).double(), (values >> 32).double()], dim=-1).reshape(-1)


def unpack(packed: Sequence[float]) -> list[int]:
    """The int64 checksums (as Python ints modulo 2^64) of `pack`'s output."""
    return [(int(packed[k + 1]) << 32 | int(packed[k])) & ((1 << 64) - 1) for k in range(0, len(packed), 2)]


@dataclass(frozen=True)
class Verdict:
    """What a check decided. `attributed`: ranks whose holding disagrees with its replicas' majority,
    or whose checksum changed on a second read; `unresolved`: groups of two holders (or without a
    majority) that disagree and where neither could be singled out: all their holders are suspects.
    `groups`: the groups that disagreed. Empty everywhere: the replicas agree."""

    attributed: tuple[int, ...] = ()
    unresolved: tuple[int, ...] = ()
    groups: tuple[GroupKey, ...] = ()
    detail: str = ""

    @property
    def ok(self) -> bool:
        return not self.groups

    @property
    def suspects(self) -> tuple[int, ...]:
        """Every rank to evict: the attributed ones, else (nothing could be attributed) the unresolved."""
        return tuple(sorted(set(self.attributed) | set(self.unresolved)))


def mismatched(sums: Mapping[GroupKey, Mapping[int, int]]) -> list[GroupKey]:
    """The groups whose holders' checksums are not all equal."""
    return sorted(k for k, by_rank in sums.items() if len(set(by_rank.values())) > 1)


def attribute(sums: Mapping[GroupKey, Mapping[int, int]],
              again: Mapping[GroupKey, Mapping[int, int]] | None = None) -> Verdict:
    """Who is the odd one out. `sums`: group -> holder rank -> checksum. `again`: the same holders'
    checksums read a second time (only needed where a group of two disagrees: `needs_second_read`).

    A group of three or more holders with a strict majority attributes every holder outside it. A
    group without one (two holders, or a tie) is settled by the second read: a holder whose checksum
    changed between the two reads cannot hold its state steady (faulty memory or arithmetic) and is
    attributed; if no holder of the group changed, the corrupted one cannot be told from two copies,
    and every holder of the group is unresolved (the caller evicts them all: the layer then comes
    from another holder if any, else the checkpoint)."""
    attributed: set[int] = set()
    unresolved: set[int] = set()
    notes: list[str] = []
    bad = mismatched(sums)
    for key in bad:
        by_rank = sums[key]
        counts = Counter(by_rank.values())
        value, top = counts.most_common(1)[0]
        layer = f"layer {key[0]}" + (f" (shard {key[2]} of {key[1]})" if key[1] > 1 else "")
        if 2 * top > len(by_rank):
            odd = sorted(r for r, v in by_rank.items() if v != value)
            attributed.update(odd)
            notes.append(f"{layer}: rank(s) {odd} disagree with {top} of {len(by_rank)} holders")
            continue
        second = (again or {}).get(key, {})
        unsteady = sorted(r for r, v in by_rank.items() if r in second and second[r] != v)
        if unsteady:
            attributed.update(unsteady)
            notes.append(f"{layer}: rank(s) {unsteady} read a different checksum twice")
        else:
            unresolved.update(by_rank)
            notes.append(f"{layer}: holders {sorted(by_rank)} disagree and none is in a majority")
    return Verdict(tuple(sorted(attributed)), tuple(sorted(unresolved - attributed)), tuple(bad), "; ".join(notes))


def needs_second_read(sums: Mapping[GroupKey, Mapping[int, int]]) -> bool:
    """Whether some disagreeing group has no strict majority (its holders read their checksums again)."""
    for key in mismatched(sums):
        counts = Counter(sums[key].values())
        if 2 * counts.most_common(1)[0][1] <= len(sums[key]):
            return True
    return False


def check_due(step: int, interval: int, first: int = 0) -> bool:
    """Whether step `step` carries a check (of the state it starts from): from step `first` on (the
    next check `next_check` chose), not step 0 (the seed's state); interval 0: never."""
    return interval > 0 and step > 0 and step >= first


def next_check(step: int, interval: int, max_cost: float, check_s: float, step_s: float) -> int:
    """The step of the next check after one at `step` that took `check_s` (the slowest rank's) in a
    step of `step_s`: `interval` steps on, or more so that the checks cost at most `max_cost` of the
    training time on average (0: no bound). Every rank passes the same all-reduced figures."""
    spacing = interval
    if max_cost > 0 and step_s > 0:
        spacing = max(spacing, math.ceil(check_s / (max_cost * step_s)))
    return step + spacing
