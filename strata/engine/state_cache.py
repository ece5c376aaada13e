"""Slot pool for fixed-size per-request state (Mamba conv and SSM states): one slot per live request."""
from __future__ import annotations


class SlotPool:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_slots if self.num_slots else 0.0

    def take(self) -> int | None:
        return self._free.pop() if self._free else None

    def release(self, slot: int) -> None:
        assert 0 <= slot < self.num_slots and slot not in self._free, f"slot {slot} released twice"
        self._free.append(slot)
