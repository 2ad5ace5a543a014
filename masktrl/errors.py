"""User-facing errors. Anything raised as MasktrlError becomes one red line and exit code 2."""


class MasktrlError(Exception):
    """An error the user can fix (bad config, missing file, unknown method...)."""


class ConfigError(MasktrlError):
    """Invalid configuration value, unknown key, or unreadable config file."""


class DataError(MasktrlError):
    """Missing or malformed data file or dataset."""


class ArtifactError(MasktrlError):
    """A stored artifact is missing, truncated or fails its hash check."""


def shown(value) -> str:
    """``str(value)`` of an object from a user's code (an exception, a reply) for a message, or a
    note when its own ``__str__`` raises: formatting it must not raise in place of the error."""
    try:
        return str(value)
    except Exception:
        return f"<a {type(value).__name__} whose str() raised>"
