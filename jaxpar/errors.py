"""The root of jaxpar's user-facing errors (a leaf module: every layer may raise them).

:class:`JaxparError` is what the command line reports as ``error: <one line>`` with exit code 2
(bad input: a config field, a flag, a recipe, a checkpoint, a weights file), as opposed to a bug,
which it reports as an internal error with a traceback file.
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
