"""Wire messages (msgspec structs) shared by all commands."""

from rlcli.protocol.messages import *  # noqa: F401,F403
from rlcli.protocol.messages import __all__  # noqa: F401
