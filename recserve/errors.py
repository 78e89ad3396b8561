"""The one exception type a user can fix by changing what they asked for.

The CLI prints it as a single line (``recserve <command>: error: <message>``) and exits 2; anything
else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """A problem in the user's input (arguments, files, plan); str() says what to do."""


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM during a command that writes files (the CLI's handlers raise it), so that
    what the command was writing is removed on the way out, as for Ctrl-C's KeyboardInterrupt. The
    CLI prints one line, ``interrupted by SIGNAL`` and ``outcome`` (what was left written), and exits
    128 + the signal's number."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum
        self.outcome = ""
