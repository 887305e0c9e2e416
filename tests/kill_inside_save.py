"""Fault-injection harness (used by tests/test_reliability.py, not a test itself).

    python tests/kill_inside_save.py MODULE [trainer args...]

runs `python -m MODULE args...` in this process, with `rlhf_core.checkpoint.save_checkpoint`
wrapped: during its `KILL_SAVE_CALL`-th call (1-based) a profiler counts Python and C call
events, and at event number `KILL_EVENT` the process SIGKILLs itself, wherever that lands inside
the save (model files, trainer_state.pt, the manifest, the renames, pruning old checkpoints).
With `KILL_EVENT` larger than the save's event count nothing is killed and the count is printed
as `SAVE_EVENTS <n>`, so a test can spread kill points over the whole save.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys

import rlhf_core.checkpoint as checkpoint
import rlhf_core.loop as loop

KILL_CALL = int(os.environ.get("KILL_SAVE_CALL", "0"))
KILL_EVENT = int(os.environ.get("KILL_EVENT", "0"))
_original = checkpoint.save_checkpoint
_calls = 0


def save_checkpoint_with_a_kill(*args, **kwargs):
    global _calls
    _calls += 1
    if _calls != KILL_CALL:
        return _original(*args, **kwargs)
    events = 0

    def count(frame, event, arg):
        nonlocal events
        events += 1
        if events >= KILL_EVENT:
            os.kill(os.getpid(), signal.SIGKILL)

    sys.setprofile(count)
    try:
        return _original(*args, **kwargs)
    finally:
        sys.setprofile(None)
        print(f"SAVE_EVENTS {events}", flush=True)


checkpoint.save_checkpoint = save_checkpoint_with_a_kill
loop.save_checkpoint = save_checkpoint_with_a_kill  # loop.py imported the name

if __name__ == "__main__":
    module = sys.argv[1]
    sys.argv = [module, *sys.argv[2:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
