"""A read-only window onto a list, made in O(1): how a sequence exposes its output tokens and how a step's snapshot
hands out tokens and logprobs without copying everything generated so far on every step."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import islice
from typing import Any, TypeVar, overload

T = TypeVar("T")


class ListView(Sequence[T]):
    """Items [start, stop) of `items` (stop None: up to the list's current end, so the view grows with it).

    A fixed `stop` is a snapshot: it stays valid as long as the owner only appends to the list or changes items at
    or beyond `stop`, which is how a sequence treats its tokens (a resolved token never changes). Indexing and
    slicing behave like a list's (a slice is a new list of just those items); a view equals any sequence with the
    same items.
    """

    __slots__ = ("_items", "_start", "_stop")

    def __init__(self, items: list[T], start: int = 0, stop: int | None = None) -> None:
        self._items = items
        self._start = start
        self._stop = stop

    def _end(self) -> int:
        return len(self._items) if self._stop is None else self._stop

    def __len__(self) -> int:
        return self._end() - self._start

    @overload
    def __getitem__(self, i: int) -> T: ...

    @overload
    def __getitem__(self, i: slice) -> list[T]: ...

    def __getitem__(self, i: int | slice) -> T | list[T]:
        n = len(self)
        if isinstance(i, slice):
            a, b, step = i.indices(n)
            if step == 1:
                return self._items[self._start + a:self._start + max(a, b)]
            return [self._items[self._start + j] for j in range(a, b, step)]
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("ListView index out of range")
        return self._items[self._start + i]

    def __iter__(self) -> Iterator[T]:
        return islice(self._items, self._start, self._end())

    def __eq__(self, other: Any) -> bool:
        if not isinstance(other, (list, tuple, ListView)):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    __hash__ = None  # type: ignore[assignment]   (like a list: equal to lists, so not hashable)

    def __repr__(self) -> str:
        return repr(list(self))
