"""The arguments of Mooncake's ``get_into_ranges`` (per buffer, per key, per
range: destination offset, offset in the value, length) checked and flattened
into what the extension reads: per key its ranges as (destination pointer,
offset in the value, length), with the result shape to fill."""

from __future__ import annotations

from typing import Any, List, Sequence, Tuple

from .mooncake_types import ErrorCode

INVALID = ErrorCode.INVALID_PARAMS


def _refused(dst: Any) -> List[int]:
    """-600 for every range a key's destination list names (one at least)."""
    return [INVALID] * max(len(dst), 1) if isinstance(dst, (list, tuple)) else [INVALID]


class RangePlan:
    """A checked ``get_into_ranges`` request: the keys to read (``keys``), their
    ranges (``ranges``) and the result (``out``), where refused entries are
    filled already and the others by :meth:`place`."""

    def __init__(self) -> None:
        self.keys: List[str] = []
        self.ranges: List[List[Tuple[int, int, int]]] = []
        self.out: List[List[List[int]]] = []
        self._where: List[Tuple[int, int]] = []
        self._all_dst: Sequence[Any] = []

    @classmethod
    def of(
        cls,
        buffer_ptrs: Sequence[Any],
        all_keys: Sequence[Any],
        all_dst: Sequence[Any],
        all_src: Sequence[Any],
        all_sizes: Sequence[Any],
    ) -> "RangePlan":
        plan = cls()
        plan._all_dst = all_dst
        if not len(buffer_ptrs) == len(all_keys) == len(all_dst) == len(all_src) == len(all_sizes):
            plan.out = plan.refused_all()
            return plan
        for i, base in enumerate(buffer_ptrs):
            per = (all_keys[i], all_dst[i], all_src[i], all_sizes[i])
            if not len(per[0]) == len(per[1]) == len(per[2]) == len(per[3]):
                plan.out.append([_refused(d) for d in per[1]])
                continue
            rows: List[List[int]] = []
            for j, (key, dst, src, size) in enumerate(zip(*per)):
                try:
                    if not len(dst) == len(src) == len(size):
                        raise ValueError("ranges of unequal lengths")
                    numbers = [(int(d), int(o), int(n)) for d, o, n in zip(dst, src, size)]
                    if int(base) < 0 or any(v < 0 for triple in numbers for v in triple):
                        raise ValueError("negative pointer, offset or size")
                except (TypeError, ValueError, OverflowError):
                    rows.append(_refused(dst))
                    continue
                rows.append([])
                plan.keys.append(str(key))
                plan.ranges.append([(int(base) + d, o, n) for d, o, n in numbers])
                plan._where.append((i, j))
            plan.out.append(rows)
        return plan

    def refused_all(self) -> List[List[List[int]]]:
        """Every range refused (-600), shaped as the destination lists."""
        return [[_refused(d) for d in dsts] for dsts in self._all_dst]

    def place(self, copied: Sequence[List[int]]) -> None:
        """Puts the extension's per-key results (in ``keys`` order) into ``out``."""
        for (i, j), result in zip(self._where, copied):
            self.out[i][j] = result
