"""The one error type the CLI turns into a one-line message and a non-zero exit."""


class MoetError(Exception):
    """A user-facing failure: the message names the file or key and says how to fix it."""


class CheckpointError(MoetError):
    """A checkpoint file or tensor is unreadable, inconsistent or unsupported."""


class ConfigError(MoetError):
    """A knob, YAML key or command-line value is invalid."""
