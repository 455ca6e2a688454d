"""Several GPUs of one host: one rank process each, one host state shared by all of them.

    launch.py       start the rank processes (torchrun), used by `slidedp train --nproc N`
    session.py      DistSession: process groups, shared memory, failure status and watchdog
    ownership.py    which process runs which task of the graph, and its CPU threads
    collectives.py  the fabric agent's ALLGATHER and REDUCE on the window's buffers
The engine (../engine.py) runs the graph of R ranks in every process; docs/executor.md holds the
process and stream contract.
"""

from slidedp.exec.dist.launch import is_rank_process, launch, torchrun_argv
from slidedp.exec.dist.session import DistSession, PeerFailure, leave_rank

__all__ = ["DistSession", "PeerFailure", "is_rank_process", "launch", "leave_rank", "torchrun_argv"]
