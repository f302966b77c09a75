"""A few daemon threads that run a function over items: the object tier's concurrent transfers.

Not :class:`concurrent.futures.ThreadPoolExecutor`: the interpreter joins its threads at exit, however long
their transfer takes (a throttled copy, a server that does not answer), and refuses new work once its exit
hooks began. Background work left at exit is finished within a bound (:mod:`tierfs.util.exitwork`); these daemon
threads never hold the exit past it.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Sequence, TypeVar

T = TypeVar("T")


class DaemonPool:
    """Up to ``workers`` daemon threads, started as work needs them, that run :meth:`map`'s calls.

    Parameters
    ----------
    workers : int
        Most calls running at once.
    name : str
        Prefix of the threads' names.
    """

    def __init__(self, workers: int, name: str) -> None:
        self.workers, self.name = max(1, workers), name
        self._queue: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def _grow(self, n: int) -> None:
        with self._lock:
            while len(self._threads) < min(self.workers, n):
                t = threading.Thread(target=self._run, name=f"{self.name}_{len(self._threads)}", daemon=True)
                t.start()
                self._threads.append(t)

    def _run(self) -> None:
        while True:
            task = self._queue.get()
            if task is None:
                return
            task()

    def map(self, fn: Callable[[Any], T], items: Sequence[Any]) -> list[T]:
        """``fn`` over ``items``, results in order. On the first failure the calls not yet started are
        skipped and those running are waited for; then the failure of the first item that failed is
        raised."""
        n = len(items)
        results: list[Any] = [None] * n
        errors: list[BaseException | None] = [None] * n
        cond = threading.Condition()
        state = {"left": n, "failed": False}

        def task(i: int) -> None:
            try:
                if not state["failed"]:
                    results[i] = fn(items[i])
            except BaseException as e:  # noqa: BLE001 - raised by map() on the calling thread
                errors[i] = e
                state["failed"] = True
            finally:
                with cond:
                    state["left"] -= 1
                    cond.notify_all()

        self._grow(n)
        for i in range(n):
            self._queue.put(lambda i=i: task(i))  # type: ignore[misc]
        with cond:
            while state["left"]:
                cond.wait()
        for e in errors:
            if e is not None:
                raise e
        return results

    def shutdown(self) -> None:
        """Stop the threads once the calls queued so far have run."""
        with self._lock:
            threads, self._threads = self._threads, []
        for _ in threads:
            self._queue.put(None)
        for t in threads:
            t.join()
