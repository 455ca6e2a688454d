"""Per-worker OpenMP teams (interpreter.own_omp_team): each thread keeps the size it set, whatever
the other threads set and in whichever order they start their first parallel op."""

from __future__ import annotations

import threading

import torch

from slidedp.exec.interpreter import own_omp_team


def _teams(setter) -> dict[str, int]:
    """Team sizes after 'cast' set 1 and then 'update' set 2 (in this order, enforced), each
    running its first parallel op only after both have set."""
    out: dict[str, int] = {}
    go = threading.Event()

    def worker(name: str, n: int, has_set: threading.Event) -> None:
        setter(n)
        has_set.set()
        go.wait()
        torch.ones(1 << 20).sum()
        out[name] = torch.get_num_threads()

    ts = []
    for name, n in (("cast", 1), ("update", 2)):
        has_set = threading.Event()
        ts.append(threading.Thread(target=worker, args=(name, n, has_set)))
        ts[-1].start()
        assert has_set.wait(10)
    go.set()
    for t in ts:
        t.join()
    return out


def test_each_worker_keeps_its_own_team():
    before = torch.get_num_threads()
    try:
        assert _teams(own_omp_team) == {"cast": 1, "update": 2}
    finally:
        torch.set_num_threads(before)


def test_plain_set_num_threads_is_the_race_own_omp_team_avoids():
    """Documents torch's behaviour that own_omp_team works around (if torch changes it, this
    fails and the workaround can go)."""
    before = torch.get_num_threads()
    try:
        assert _teams(torch.set_num_threads) == {"cast": 2, "update": 2}
    finally:
        torch.set_num_threads(before)
