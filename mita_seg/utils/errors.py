"""The error a user fixes by changing what they gave (a file, an option), raised by library
code: defined here, below every layer that raises it, so that no library module imports the
command line (the ``cli`` package re-exports it for the tools and reports it as one
``error:`` line)."""

__all__ = ['InputError']


class InputError(ValueError):
    """A file or option the user gave cannot be used as what it was given for (a config that
    does not parse or defines no model, a file that is no image, a ``--cfg-options`` value
    the model cannot be built with); the message names it and what to give instead."""
