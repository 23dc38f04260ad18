"""One rich console on stderr for logs and live tables; stdout stays for data.

Only rank 0 of a torchrun job logs; other ranks print errors only (and no Python warnings).
"""

import logging
import os
import sys

from rich.console import Console
from rich.logging import RichHandler

console = Console(stderr=True, highlight=False, soft_wrap=True)

_configured = False


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def setup_logging(name: str, level: str | None = None) -> logging.Logger:
    """Configure the root logger once (rich on a terminal, plain lines in log files)."""
    global _configured
    if not _configured:
        level = level or os.environ.get("RLCLI_LOG_LEVEL", "INFO")
        if rank() != 0:
            level = "ERROR"
            import warnings

            warnings.filterwarnings("ignore")
        if sys.stderr.isatty():
            handler: logging.Handler = RichHandler(console=console, show_path=False, rich_tracebacks=False,
                                                   log_time_format="[%X]")
            fmt = f"{name}: %(message)s"
        else:
            handler = logging.StreamHandler(sys.stderr)
            fmt = f"%(asctime)s {name} %(levelname)s %(message)s"
        handler.setFormatter(logging.Formatter(fmt, datefmt="%H:%M:%S"))
        logging.basicConfig(level=level, handlers=[handler], force=True)
        _configured = True
    return logging.getLogger(f"rlcli.{name}")
