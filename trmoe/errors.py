"""User-facing errors: one clear line, exit code 2, no traceback."""

from __future__ import annotations


class UserError(Exception):
    """Bad input from the user (config, file, override). The message is one line that names
    the key or file and what is allowed; the app prints it and exits with code 2."""

    exit_code = 2
