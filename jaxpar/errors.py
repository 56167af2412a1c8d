"""The root of jaxpar's user-facing errors.

:class:`JaxparError` is what the command line reports as ``error: <one line>`` with exit code 2
(bad input: a config field, a flag, a recipe file), as opposed to a bug, which it reports as an
internal error with a traceback file. :class:`jaxpar.config.ConfigError` is its subclass; this
module imports nothing so that any module can raise it.
"""


class JaxparError(Exception):
    """A user-facing error: one line that names what is wrong and the fix."""
