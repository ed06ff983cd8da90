"""The command lines of trmoe's tools: bad input is one line on stderr and exit code 2, like every other user
error, instead of argparse's usage block. Kept free of torch so that parsing stays instant."""

from __future__ import annotations

import argparse
from typing import NoReturn

from trmoe.errors import UserError


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors raise UserError ("<tool>: <error>; allowed: see <prog> --help"), which
    the tool prints as one line (exit code 2) before it does any work."""

    def error(self, message: str) -> NoReturn:
        if "allowed" not in message and "choose from" not in message:
            message += f"; allowed: see {self.prog} --help"
        raise UserError(f"{self.prog.removeprefix('python -m trmoe.')}: {message}")
