"""Process-level helpers shared by every command."""

import signal
from typing import Callable


def stop_on_signals(stop: Callable[[], None]) -> None:
    """Call ``stop`` on SIGTERM or SIGINT: service loops finish their step and exit cleanly
    (deregister, close sockets) instead of dying mid-write."""
    signal.signal(signal.SIGTERM, lambda signum, frame: stop())
    signal.signal(signal.SIGINT, lambda signum, frame: stop())
