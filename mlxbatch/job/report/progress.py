"""What a run shows while it works: a "loading model" line, then a progress bar of the rows run in this run.

Owns the bar's arithmetic. Rows an earlier run finished are not progress: as the feed finds them, they leave the
bar's total and are shown beside it (``resumed=``), so the rate and the time left are those of the rows this run
computes. Beside the bar: rows in flight, errors, input and output tokens per second and the share of prompt
tokens whose KV came from the prefix cache or a running row (``cached``). Without a terminal, the same figures
go to the log every 30 seconds. While the bar shows, log lines are written above it (``tqdm.write``), not into
its line.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any, TextIO

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

log = logging.getLogger(__name__)

REFRESH_S = 0.5
LOG_EVERY_S = 30.0


class Progress:
    def __init__(self, enabled: bool, total: int | None, file: TextIO | None = None) -> None:
        self.enabled = enabled
        self._file = file
        self._total = total
        self._bar: tqdm | None = None
        self._redirect: Any = None  # logging through tqdm.write while the bar shows
        self.resumed = 0
        self.done = 0  # rows finished in this run (a disabled bar counts nothing)
        self._last = self._last_log = 0.0

    def loading(self, model: str) -> None:
        if self.enabled:
            print(f"mlxbatch: loading model {model} ...", file=self._file or sys.stderr, flush=True)
        else:
            log.info("loading model %s", model)

    def engine(self, batch: str) -> None:
        """The engine's batch (set, or sized by the device): on a terminal only; without one the engine logs it."""
        if self.enabled and batch:
            print(f"mlxbatch: engine: {batch}", file=self._file or sys.stderr, flush=True)

    def start(self) -> None:
        self._bar = tqdm(total=self._total, disable=not self.enabled, unit="row", dynamic_ncols=True,
                         file=self._file)
        self._last_log = time.monotonic()
        if self.enabled:  # log lines (a warning, the Ctrl-C notice) above the bar, not written into its line
            self._redirect = logging_redirect_tqdm(tqdm_class=tqdm)
            self._redirect.__enter__()

    def skipped(self, n: int) -> None:
        """``n`` more rows were found done by an earlier run: not this run's work."""
        if n <= 0:
            return
        self.resumed += n
        if self._total is not None:
            self._total = max(self.done, self._total - n)
        if self._bar is not None and self._bar.total is not None:
            self._bar.total = max(self._bar.n, self._bar.total - n)
            self._bar.refresh()

    def finished(self, n: int = 1) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(n)

    def show(self, stats: Any, in_flight: int, engine: Any, force: bool = False) -> None:
        """Refresh the figures beside the bar (at most every REFRESH_S), or log them without a terminal."""
        now = time.monotonic()
        if not force and now - self._last < REFRESH_S:
            return
        self._last = now
        wall = max(stats.wall_s, 1e-9)
        figures = {"in_flight": in_flight, "resumed": self.resumed, "errors": stats.errors,
                   "in_tok_s": f"{stats.prompt_tokens / wall:.0f}", "out_tok_s": f"{stats.generated_tokens / wall:.0f}",
                   "cached": f"{cache_share(engine):.0%}"}
        if self.enabled and self._bar is not None:
            self._bar.set_postfix(figures, refresh=False)
        elif now - self._last_log >= LOG_EVERY_S:
            self._last_log = now
            log.info("%d/%s rows this run, %s", self.done, self._total if self._total is not None else "?",
                     ", ".join(f"{k} {v}" for k, v in figures.items()))

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._redirect is not None:
            self._redirect.__exit__(None, None, None)
            self._redirect = None


def cache_share(engine: Any) -> float:
    """The share of prompt tokens the engine did not compute (prefix cache blocks or a running row's KV)."""
    st = engine.stats()
    reused = (st.get("prefix_cache") or {}).get("tokens_reused", 0)
    computed = st.get("profile", {}).get("prefill_tokens", 0)
    return reused / (reused + computed) if reused + computed else 0.0
