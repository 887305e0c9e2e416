"""Named kill points for fault-injection tests: SIGKILL this process at an exact place.

    RLHF_KILL_AT="checkpoint.staged:3"   SIGKILL at the 3rd time this process reaches that point
    RLHF_FAULT_TRACE=PATH                append "<pid> <point> <n>" to PATH at every point reached

Both are read once, at import. Unset (the default), `fault_point` is a function that returns at
once: the production cost is one empty call per point. The points sit inside the writes a kill
could tear (tests/test_kill_soak.py names them in its report):

    checkpoint.staged      a checkpoint's files are in its temporary directory, no manifest yet
    checkpoint.prune       the new checkpoint is in place, an old one renamed aside, not deleted
    rollout_log.insert     the rollout log's rows are inserted, not committed (writer thread)
    final.evaluated        the final evaluation is logged; final/ and summary.json not written

Counts are per process: under torchrun each rank counts its own hits (a point every rank reaches
kills them all; one only the main process reaches kills it alone). Not here: kills at random
times, which the test driver sends from outside.
"""

from __future__ import annotations

import os
import signal
import threading

KILL_AT = os.environ.get("RLHF_KILL_AT", "")
TRACE = os.environ.get("RLHF_FAULT_TRACE", "")
_hits: dict[str, int] = {}
_lock = threading.Lock()


def _armed(name: str) -> None:
    with _lock:  # the rollout log's writer thread reaches its point beside the main thread
        _hits[name] = n = _hits.get(name, 0) + 1
        if TRACE:
            with open(TRACE, "a") as fh:
                fh.write(f"{os.getpid()} {name} {n}\n")
        if KILL_AT == f"{name}:{n}":
            os.kill(os.getpid(), signal.SIGKILL)


def _off(name: str) -> None:
    return None


#: `fault_point(name)`: a no-op unless RLHF_KILL_AT or RLHF_FAULT_TRACE is set (see above).
fault_point = _armed if (KILL_AT or TRACE) else _off
