"""``max_error_rate``: the share of a job's rows that may fail, judged on rows in input order, across runs.

Owns the decision. Rows finish out of input order (errors found before generation at once, generated rows as the
plan runs them), so counting rows as they finish would judge a window by whichever errors are cheapest to find.
Instead a row counts once every row before it in the input has finished too (the finished prefix of the input),
and rows an earlier run checkpointed count with their stored result. During a run the job stops once that prefix
holds ``MIN_ROWS`` rows and more than ``max_rate`` of them failed; at the end the same rule is applied to every
row of the results as they are on disk, whatever their number (a small job whose rows all fail fails).
"""

from __future__ import annotations

from dataclasses import dataclass, field

MIN_ROWS = 20  # rows in the finished prefix before the job may be stopped early


@dataclass
class ErrorRate:
    max_rate: float
    rows: int = 0  # rows of the finished prefix of the input
    errors: int = 0  # of which failed
    _next: int = 0  # the first input position not finished yet
    _ahead: dict[int, bool] = field(default_factory=dict)  # finished rows past the prefix: position -> failed

    def finished(self, index: int, error: bool) -> None:
        """Row ``index`` (its input position) finished, in this run or an earlier one."""
        self._ahead[index] = error
        while self._next in self._ahead:
            self.errors += self._ahead.pop(self._next)
            self.rows += 1
            self._next += 1

    def exceeded(self) -> bool:
        """Whether the job should stop now (a decision on at least ``MIN_ROWS`` rows in input order)."""
        return self.rows >= MIN_ROWS and self.errors > self.max_rate * self.rows

    def exceeded_at_end(self, rows: int, errors: int) -> bool:
        """Whether a finished job's results (``errors`` of ``rows``, all runs) failed the limit."""
        return rows > 0 and errors > self.max_rate * rows

    def message(self, rows: int, errors: int, where: str) -> str:
        return (f"{errors} of {rows} rows failed (rows in input order, earlier runs included), more than "
                f"max_error_rate={self.max_rate}; the finished rows are checkpointed in {where}")
