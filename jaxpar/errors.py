"""The project's user-facing error type (a leaf module: every layer may raise it)."""


class ConfigError(ValueError):
    """A user-facing error in a config, recipe, checkpoint, weights file or flag: one line naming the
    field and the fix. The CLI prints it without a traceback and exits with code 2."""
