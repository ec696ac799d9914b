"""The one error type for bad input: ``str(err)`` is one line naming the field and the fix."""


class ConfigError(ValueError):
    """A bad configuration value. ``str(err)`` is one line naming the field and the fix."""
