"""The project's exceptions.

Library code raises these (or ``ValueError``); ``rlcli.cli._errors`` maps each to
one line on stderr and an exit code. Their messages are written for the user: they
name the flag, key, file or peer to change.
"""


class RLCLIError(Exception):
    """Base of every error a user can cause or fix."""

    exit_code = 1


class ConfigError(RLCLIError):
    """A recipe, flag or override is invalid (unknown key, bad value, incompatible flags)."""

    exit_code = 2


class RunDirError(RLCLIError):
    """The run directory cannot be used (belongs to another recipe, unreadable marker)."""

    exit_code = 2


class ModelLoadError(RLCLIError):
    """A model directory, tensor or tokenizer is missing or does not match its config."""

    exit_code = 2


class PeerUnreachable(RLCLIError):
    """A peer process (rl-infer, rl-cache, ...) did not answer in time."""

    exit_code = 1


class ProtocolError(RLCLIError):
    """A peer sent a message this version cannot read."""

    exit_code = 1


class StorageFull(RLCLIError):
    """A durable write failed for lack of space (or a file-size limit, or a read-only run directory);
    the write was abandoned and the previous STABLE state is untouched."""

    exit_code = 1


class CorruptFile(RLCLIError):
    """A durable file's bytes do not match the checksum written with it (a flipped bit on disk or in
    transit); the reader falls back (an older version, a rewrite) instead of using it."""

    exit_code = 1
