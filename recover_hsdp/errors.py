"""The one error type for bad input: ``str(err)`` is one line naming the field and the fix."""


def one_line(err: BaseException, limit: int = 300) -> str:
    """``"Type: first line of the message"`` (or just the type when the message is empty)."""
    text = str(err).splitlines()[0][:limit] if str(err).strip() else ""
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


class ConfigError(ValueError):
    """A bad configuration value. ``str(err)`` is one line naming the field and the fix."""
