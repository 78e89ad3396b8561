"""The one exception type a user can fix by changing what they asked for.

The CLI prints it as a single line (``recserve <command>: error: <message>``) and exits 2; anything
else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """A problem in the user's input (arguments, files, plan); str() says what to do."""
