"""The waiting queue: FCFS (a deque) or priority (a heap ordered by priority, then arrival)."""
from __future__ import annotations

import heapq
import itertools
from collections import deque

from engine.request import Request


class WaitingQueue:
    """FCFS is a deque; the priority policy orders by (priority, arrival)."""

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self._fifo: deque[Request] = deque()
        self._heap: list = []
        self._counter = itertools.count()

    def add(self, request: Request, front: bool = False) -> None:
        if self.policy == "priority":
            heapq.heappush(self._heap, (request.priority, request.arrival_time, next(self._counter), request))
        elif front:
            self._fifo.appendleft(request)
        else:
            self._fifo.append(request)

    def peek(self) -> Request:
        return self._heap[0][3] if self.policy == "priority" else self._fifo[0]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3] if self.policy == "priority" else self._fifo.popleft()

    def remove(self, request: Request) -> bool:
        if self.policy == "priority":
            for i, entry in enumerate(self._heap):
                if entry[3] is request:
                    self._heap.pop(i)
                    heapq.heapify(self._heap)
                    return True
            return False
        try:
            self._fifo.remove(request)
            return True
        except ValueError:
            return False

    def first(self, n: int) -> list[Request]:
        """The n requests `pop` would take first, in that order."""
        if self.policy == "priority":
            return [e[3] for e in heapq.nsmallest(n, self._heap)]
        return list(itertools.islice(self._fifo, n))

    def __len__(self) -> int:
        return len(self._heap) if self.policy == "priority" else len(self._fifo)

    def __iter__(self):
        return iter([e[3] for e in self._heap] if self.policy == "priority" else self._fifo)
