"""User-facing errors: one clear line, exit code 2, no traceback."""

from __future__ import annotations


class UserError(Exception):
    """Bad input from the user (config, file, override). The message is one line that names
    the key or file and what is allowed; the app prints it and exits with code 2."""

    exit_code = 2


class RunFailed(Exception):
    """A run that cannot go on (fault guards tripped, the final checkpoint could not be written). The message
    is one line saying why and which checkpoint holds the last good state; the app exits with code 3."""

    exit_code = 3
