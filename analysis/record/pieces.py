"""One step's CPU passes split over threads: each thread takes the next piece of the positions until none is
left, into state of its own, which the caller then merges (numba passes release the GIL, so the threads run
together; pieces, not equal shares, so a slow thread does not hold the step back)."""
from __future__ import annotations

import threading
from typing import Callable, TypeVar

State = TypeVar("State")


def in_pieces(n: int, piece: int, threads: int, pool, start: Callable[[int], State],
              step: Callable[[State, int, int], bool | None]) -> list[State]:
    """Run step(state, lo, hi) over [0, n) in pieces of `piece`, on `threads` threads: this one and threads − 1
    of `pool` (an executor; None: this thread alone). Thread i's state comes from start(i), this thread's
    from start(0); a step that returns True stops its thread. Returns the states in that order."""
    pieces = iter(range(0, n, piece))
    taking = threading.Lock()

    def work(i: int) -> State:
        state = start(i)
        while True:
            with taking:
                lo = next(pieces, None)
            if lo is None or step(state, lo, min(n, lo + piece)):
                return state
    done = [pool.submit(work, i) for i in range(1, threads)] if pool is not None else []
    mine = work(0)
    return [mine] + [f.result() for f in done]
