"""The one exception type a user should see: bad config or input, with the fix in the message."""


class ConfigError(ValueError):
    """A config, mesh, rule or input that cannot work. The CLI prints it without a traceback."""
