"""Stopping a run cleanly: the first Ctrl-C or SIGTERM asks the recipe to finish its step and
checkpoint it (`flowloop.trainer.recipe.RLRecipe.train` checks ``requested`` after every step)."""

from __future__ import annotations

import signal
import threading

__all__ = ["StopRequest"]


class StopRequest:
    """First Ctrl-C or SIGTERM (what schedulers send): finish the running step, checkpoint it,
    then stop (weights are never saved half-updated). A second one interrupts at once. Outside
    the main thread it does nothing."""

    SIGNALS = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}

    def __init__(self, log):
        self.log = log
        self.requested = False
        self.signal_name = None
        self._previous: dict = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._previous = {signum: signal.signal(signum, self._ask) for signum in self.SIGNALS}
        return self

    def _ask(self, signum, frame):
        if self.requested:  # the second request: stop now
            self.__exit__()
            raise KeyboardInterrupt
        self.requested = True
        self.signal_name = self.SIGNALS[signum]
        self.log(f"\n{self.signal_name}: finishing this step, then writing a checkpoint (once more to stop at once)")

    def __exit__(self, *exc):
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous = {}
        return False
