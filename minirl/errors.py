"""The base class of every error a user can cause (config, data, plugins).

The CLI prints these as one line and exits with status 2; anything else is a bug in minirl
and keeps its traceback.
"""


class UserError(ValueError):
    """A mistake in the user's config, data or plugins; the message names where and how to fix it."""
