"""The one error type users see.

Every bad config, bad input or infeasible plan raises :class:`LrmoeError` with a
message that names the field, the value and what would be valid. The CLI turns it
into exit code 2 (``exit_code``) and one line on stderr. Under torchrun an error every
rank raises alike (an argument, a gathered check) is ``quiet`` on all ranks but rank 0,
so the line is printed once, not once per rank.
"""


class LrmoeError(ValueError):
    """A problem with the user's input, config, data, checkpoint or budget."""

    exit_code = 2
    quiet = False  # True: another rank (or the raiser) prints this message


def require(cond: bool, msg: str) -> None:
    if not cond:
        raise LrmoeError(msg)


def quiet_unless(err: LrmoeError, speak: bool) -> LrmoeError:
    """``err``, printed by the CLI only where ``speak`` (rank 0 of an agreed error)."""
    err.quiet = not speak
    return err
