"""SIGTERM / SIGINT as a flag checked at step boundaries (the loops save a checkpoint and return).

    with StopFlag() as stop:
        while ...:
            ...
            if stop.signal is not None: save; break
"""

from __future__ import annotations

import signal
import threading
from typing import Optional


class StopFlag:
    """Set by SIGTERM (and SIGINT) while inside the `with` block; the old handlers come back on exit.
    Outside the main thread (where handlers cannot be installed) it never fires."""

    def __init__(self):
        self.signal: Optional[int] = None
        self._old = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGTERM, signal.SIGINT):
                self._old[s] = signal.signal(s, self._handle)
        return self

    def _handle(self, signum, frame):
        self.signal = signum

    def __exit__(self, *exc):
        for s, h in self._old.items():
            signal.signal(s, h)
