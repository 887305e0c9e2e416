"""A signal-safe stop: SIGINT/SIGTERM become a flag that a training loop checks at safe points
(after an optimizer step); the loop then saves a checkpoint (`rlhf_core.checkpoint`), prints how
to resume, and exits 130 (SIGINT) / 143 (SIGTERM).
"""

from __future__ import annotations

import os
import signal
from types import FrameType
from typing import Any


class StopSignal:
    """Context manager: SIGINT/SIGTERM set `requested` instead of killing the process.

    A second signal of the same kind restores the default behaviour (so Ctrl-C twice still kills).
    Nested in another StopSignal (a pipeline such as the quickstart holds one around the trainers
    it runs), it starts with the outer one's pending signal and hands its own back on exit, so a
    Ctrl-C is never lost between or inside stages. (Python's default handler raises
    KeyboardInterrupt wherever the main thread is, and one raised inside a `__del__`, such as a
    progress bar's while weights load, is printed as "Exception ignored" and dropped: the likely
    way the quickstart test once saw a Ctrl-C lost and the run exit 0.)
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def exit_code(self) -> int:
        return 128 + (self.signum or 0)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.signum = signum

    def __enter__(self) -> StopSignal:
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: signals cannot be caught here
                continue
            outer = _stop_signal_of(self._previous[sig])
            if outer is not None and outer.signum is not None and self.signum is None:
                self.signum = outer.signum  # a signal that came before this block
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
            outer = _stop_signal_of(handler)
            if outer is not None and outer.signum is None and self.signum is not None:
                outer.signum = self.signum


def _stop_signal_of(handler: Any) -> StopSignal | None:
    """The StopSignal whose handler `handler` is, if it is one."""
    owner = getattr(handler, "__self__", None)
    return owner if isinstance(owner, StopSignal) else None
