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
    agreed = False  # True: every rank of the job raised it, after the same collectives

    def __init__(self, msg: str = "", local: bool = False) -> None:
        super().__init__(msg)
        self.local = local  # True: this rank alone hit it, so this rank prints it


class OutOfMemory(LrmoeError):
    """No plan fits the memory budget, even with every fallback: what a GPU would do at
    that step (docs/design.md §5 "Out of memory"). ``needs_bytes``: the smallest total a
    rank needed among the fallbacks tried; ``budget_bytes``: the budget; ``detail``: the
    ledger's own line (rank, terms, shortfall). :func:`lrmoe.train.step_oom.verdict` words
    it for a step."""

    def __init__(self, msg: str, needs_bytes: int, budget_bytes: int, detail: str = "") -> None:
        super().__init__(msg)
        self.needs_bytes, self.budget_bytes, self.detail = int(needs_bytes), int(budget_bytes), detail


def require(cond: bool, msg: str) -> None:
    if not cond:
        raise LrmoeError(msg)


def quiet_unless(err: LrmoeError, speak: bool) -> LrmoeError:
    """``err``, an error every rank raises alike (``agreed``), printed by the CLI only
    where ``speak`` (rank 0)."""
    err.quiet = not speak
    err.agreed = True
    return err
