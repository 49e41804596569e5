"""How many threads a forward step uses: all of them while they pay, fewer beside a busy neighbour.

Every parallel region of a step ends when its slowest thread does. On a quiet machine that is
soon, and two threads give a decode step nearly twice one thread's speed. Beside another
CPU-bound process the OS time-slices the cores, a region's second thread waits for its slice,
and a decode step's ~180 regions each wait: a server beside a `cli.py bench` took 27-42 s for 32
tokens instead of 0.7 s. One thread has nothing to wait for.

So each step is timed (a moving average per size of step), and:
- on all threads, once steps much slower than their average have cost PROBE_AFTER seconds more
  than it in a row, the next step tries one thread, and keeps one thread if that is faster (a
  neighbour arrived). Beside a neighbour one step of two threads costs that at once; a quiet,
  noisy machine's lone slow step does not, where probing after any slow step cost int8 decode of
  the default model 6% (128.6 against 136.9 tok/s without probes, 0 of 5 alternating rounds)
  by keeping one thread for 16 steps after a spike. A quiet machine never pays a probe;
- a probe's count is kept only when its step beats the current count's average by SWITCH_GAIN.
  A burst of slow steps on a quiet host lifts the all-thread average to about one thread's own
  time, and a one-thread probe then looked faster by a few percent: 16 steps on one thread, 1.6x
  slower each (float32 decode of the default model 0.93x of the same tree without the tuner, 6
  of 6 alternating rounds; logged: a 33.0 ms one-thread probe against a 35.6 ms average). Beside
  a neighbour the other way round: an all-thread probe that met the neighbour's pause (35.0 ms
  against one thread's 42.1) took all threads back into 170 ms steps. A real change of regime
  gains plainly: quiet, all threads are 1.6x faster than one; beside a neighbour, several times;
- on one thread, all of them are tried again every `probe_every` steps, the interval doubling
  up to `max_probe_every` while one thread stays faster (the neighbour is still there).
"""

from __future__ import annotations

import threading
import time


class ThreadTuner:
    """Chooses the thread count of each step among `choices` (most first), by measured time."""

    SLOWER = 1.5  # a step this much slower than its average makes the tuner try the other count
    ALPHA = 0.3  # weight of the newest step in the moving averages
    PROBE_AFTER = 0.03  # seconds that consecutive slow steps lose before one thread is tried
    SWITCH_GAIN = 1.25  # how much faster than the current count's average a probe must be to switch

    def __init__(self, threads: int, probe_every: int = 16, max_probe_every: int = 256):
        self.choices = (threads, 1) if threads > 1 else (1,)
        self.probe_every, self.max_probe_every = probe_every, max_probe_every
        self._lock = threading.Lock()
        self._sizes: dict[int, _SizeStats] = {}

    def choose(self, rows: int) -> int:
        """The thread count for a step of `rows` rows."""
        if len(self.choices) == 1:
            return self.choices[0]
        with self._lock:
            return self._stats(rows).next_choice(self)

    def record(self, rows: int, threads: int, seconds: float) -> None:
        """How long a step of `rows` rows took on `threads` threads."""
        if len(self.choices) > 1:
            with self._lock:
                self._stats(rows).record(self, threads, seconds)

    def _stats(self, rows: int) -> "_SizeStats":
        size = min(rows.bit_length(), 10)  # steps of 1, 2-3, 4-7, .. rows, up to 512 and more
        stats = self._sizes.get(size)
        if stats is None:
            stats = self._sizes[size] = _SizeStats(self.choices, self.probe_every)
        return stats


class _SizeStats:
    def __init__(self, choices, probe_every):
        self.average = {c: None for c in choices}
        self.current = choices[0]
        self.interval = probe_every
        self.countdown = probe_every
        self.probing = False
        self.lost = 0.0  # seconds the current run of slow steps took over their average

    def next_choice(self, tuner: ThreadTuner) -> int:
        most = tuner.choices[0]
        if self.current != most:
            self.countdown -= 1
        self.probing = self.countdown <= 0
        if self.probing:
            return next(c for c in tuner.choices if c != self.current)
        return self.current

    def record(self, tuner: ThreadTuner, threads: int, seconds: float) -> None:
        old = self.average[threads]
        self.average[threads] = seconds if old is None else (1 - tuner.ALPHA) * old + tuner.ALPHA * seconds
        if self.probing:
            self.probing = False
            if seconds * tuner.SWITCH_GAIN < self.average[self.current]:  # the other count was plainly faster: take it
                self.current, self.interval = threads, tuner.probe_every
            elif self.current != tuner.choices[0]:
                self.interval = min(2 * self.interval, tuner.max_probe_every)  # one thread still pays
            self.countdown = self.interval
        elif old is not None and self.current == tuner.choices[0]:
            self.lost = self.lost + seconds - old if seconds > tuner.SLOWER * old else 0.0
            if self.lost > tuner.PROBE_AFTER:  # slow for long enough on every thread: try one thread next step
                self.countdown, self.lost = 0, 0.0


class StepTimer:
    """`with timer.step(rows):` runs the body on the tuner's thread count for this Python thread
    (Numba's is per thread) and records how long it took."""

    def __init__(self, tuner: ThreadTuner):
        self.tuner = tuner

    def step(self, rows: int):
        return _Step(self.tuner, rows)


class _Step:
    def __init__(self, tuner, rows):
        self.tuner, self.rows = tuner, rows

    def __enter__(self):
        import numba

        self.threads = self.tuner.choose(self.rows)
        numba.set_num_threads(self.threads)
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.tuner.record(self.rows, self.threads, time.perf_counter() - self.start)
        return False
