"""The one error type users see.

Every bad config, bad input or infeasible plan raises :class:`LrmoeError` with a
message that names the field, the value and what would be valid. The CLI turns it
into exit code 2 and one line on stderr.
"""


class LrmoeError(ValueError):
    """A problem with the user's input, config, data, checkpoint or budget."""


def require(cond: bool, msg: str) -> None:
    if not cond:
        raise LrmoeError(msg)
