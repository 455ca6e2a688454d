"""The one timing rule: `warmup` untimed runs, then `repeats` timed runs, and the median is kept
(the host rates over their rounds: Rounds.rate).

`median_s` takes a function that runs once and returns its own duration (for runs that time
themselves, e.g. several threads started together). `wall_median_s` times on the host clock with
`sync` (e.g. torch.cuda.synchronize for work on several streams) before the clock starts and
before it stops, a sample repeating the call for at least `min_s` when given. `cuda_median_s`
times work that `fn` enqueues on the current CUDA stream with CUDA events recorded around it on
that stream: the GPU time of that work, with the host's launch time hidden when the queue runs
ahead. `run_together` runs bodies in threads of their own whose measured parts start together.
`Rounds` keeps rates sampled once per round of a sweep (the host rates against thread count,
each round on freshly allocated buffers): each rate's samples then lie seconds apart and on
memory placed anew, and a rate is the trimmed harmonic mean of its rounds (Rounds.rate).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence

import torch


def median_s(run_s: Callable[[], float], warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        run_s()
    return statistics.median(run_s() for _ in range(repeats))


def _none() -> None:
    return None


def wall_median_s(fn: Callable[[], object], warmup: int, repeats: int,
                  sync: Callable[[], None] = _none, min_s: float = 0.0) -> float:
    """Seconds per call of fn; with `min_s`, each timed sample calls fn until at least `min_s`
    has passed and counts the time per call (short kernels: fewer samples at the clock's and
    the machine's whims)."""
    def run_s() -> float:
        sync()
        t0 = time.perf_counter()
        calls = 0
        while True:
            fn()
            calls += 1
            sync()
            if (t := time.perf_counter() - t0) >= min_s:
                return t / calls

    return median_s(run_s, warmup, repeats)


def cuda_median_s(fn: Callable[[], object], warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events) / 1e3


class Rounds:
    """Rates by key, one sample per round (module docstring); a key is (kernel, *where), e.g.
    ("adam", threads).

    A rate is the harmonic mean of its rounds, the fastest and the slowest left out from 5
    rounds on: the rate of the mean time per unit of work, which is what a fixed amount of work
    (an update of N parameters) takes on average. On nvidia-h200 a host rate depended on where
    its buffers landed: AdamW at 12 threads read 3.25-4.35 Gparam/s on ten fresh allocations of
    the same buffers, in two groups, within 9% on any one of them
    (benchmarks/probes/host_placement_probe.py); so each round samples fresh buffers, and a
    median of such rounds would pick one group or the other by chance. Leaving out the two
    extremes keeps one burst of load from elsewhere from moving the rate."""

    TRIM_FROM = 5  # rounds from which the fastest and the slowest are left out

    def __init__(self) -> None:
        self.samples: dict[tuple, list[float]] = defaultdict(list)

    def add(self, key: tuple, rate: float) -> None:
        self.samples[key].append(rate)

    def kept(self, key: tuple) -> list[float]:
        """The rounds a rate averages, sorted: all, or without the two extremes from TRIM_FROM."""
        xs = sorted(self.samples[key])
        return xs[1:-1] if len(xs) >= self.TRIM_FROM else xs

    def rate(self, key: tuple) -> float:
        return statistics.harmonic_mean(self.kept(key))

    def mean(self, key: tuple) -> float:
        """The arithmetic mean of the kept rounds: for a figure that is not a rate (a weight
        that may be 0, where a harmonic mean is undefined)."""
        return statistics.fmean(self.kept(key))

    def range(self, key: tuple) -> tuple[float, float]:
        """(slowest, fastest) of the kept rounds over the rate: factors around 1, how far one
        allocation of the buffers read from the average (HostSpec.rate_range)."""
        xs, rate = self.kept(key), self.rate(key)
        return xs[0] / rate, xs[-1] / rate

    def spread(self, kernel: str) -> float:
        """The largest max / min - 1 of one key's rounds over the keys of `kernel` (0 where none
        was sampled): 0.25 = some rate of it differed by 25% between rounds."""
        return max((max(v) / min(v) - 1 for k, v in self.samples.items()
                    if k[0] == kernel and min(v) > 0), default=0.0)

    def kernels(self) -> set[str]:
        return {k[0] for k in self.samples}

    def rows(self) -> list[dict]:
        """Every sample, by key: [{"kernel", "where", "rates"}], in the order sampled (the
        profile's rounds file, for looking at how a rate's rounds spread)."""
        return [{"kernel": k[0], "where": list(k[1:]), "rates": list(v)}
                for k, v in self.samples.items()]


def rounds_rule(rounds: int) -> str:
    """How Rounds.rate combines `rounds` rounds, for the profile's source lines."""
    return "the harmonic mean" + (" without the fastest and the slowest"
                                  if rounds >= Rounds.TRIM_FROM else "")


def run_together(bodies: Sequence[Callable[[Callable[[], None]], None]], what: str) -> None:
    """Run each body in a thread of its own. A body gets `start`, which it calls once its setup
    is done: every body's measured part begins when all have called it. A body that raises breaks
    that barrier, so the others leave it instead of waiting (or finish, if already past it), and
    run_together then raises RuntimeError naming `what`, from the first error. A body that returns
    without calling `start` is an error too (the others would wait for it)."""
    go = threading.Barrier(len(bodies))
    errors: list[BaseException] = []

    def run(body: Callable[[Callable[[], None]], None]) -> None:
        started = False

        def start() -> None:
            nonlocal started
            started = True
            go.wait()

        try:
            body(start)
            if not started:
                raise RuntimeError("a body returned without starting")
        except threading.BrokenBarrierError:
            pass  # another body failed first
        except BaseException as e:  # noqa: BLE001 - re-raised by the calling thread below
            errors.append(e)
            go.abort()

    threads = [threading.Thread(target=run, args=(b,)) for b in bodies]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"{what} failed: {errors[0]}") from errors[0]
