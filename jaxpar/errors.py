"""The root of jaxpar's user-facing errors (a leaf module: every layer may raise them).

The command line reports a :class:`JaxparError` (bad input: a config field, a flag, a recipe, a
checkpoint, a weights file) as ``error: <one line>`` with exit code 2, and anything else as a bug.
"""


class JaxparError(Exception):
    """A user-facing error: one line that names what is wrong and the fix."""


class ConfigError(JaxparError, ValueError):
    """A user-facing error in a config, recipe, checkpoint, weights file or flag: one line naming the
    field and the fix."""


def require(ok: bool, message: str) -> None:
    """Raise :class:`ConfigError` with ``message`` (one line naming the field and the fix) unless ``ok``."""
    if not ok:
        raise ConfigError(message)
