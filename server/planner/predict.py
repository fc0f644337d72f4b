"""Next-interval predictors of one load series (request rate, mean prompt length, mean output length).

    constant         the last value
    moving_average   the mean of the last `window` values
    arima            ARIMA(1,1,1) from statsmodels, refitted on the last `history` values each interval (the
                     last value until it has `min_history` of them, or when a fit fails)
    auto             all three side by side; predicts with the one whose one-step-ahead errors have been the
                     smallest lately (exponentially weighted absolute error): the choice is made by measuring

The default is moving_average, chosen by measurement (bench/predictors.py; the figures are in docs/planner.md's SLA
planner section): moving_average and arima both beat constant, neither beats the other on every series, and the
moving average costs nothing where ARIMA refits each interval. Predictions are never negative.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections import deque
from typing import Protocol

log = logging.getLogger(__name__)

PREDICTORS = ("constant", "moving_average", "arima", "auto")


class Predictor(Protocol):
    name: str

    def add(self, value: float) -> None:
        """The value the last interval had."""
        ...

    def predict(self) -> float:
        """The next interval's value (0.0 before any value)."""
        ...


class Constant:
    name = "constant"

    def __init__(self) -> None:
        self._last = 0.0

    def add(self, value: float) -> None:
        self._last = value

    def predict(self) -> float:
        return self._last


class MovingAverage:
    name = "moving_average"

    def __init__(self, window: int = 4) -> None:
        self._values: deque[float] = deque(maxlen=window)

    def add(self, value: float) -> None:
        self._values.append(value)

    def predict(self) -> float:
        return sum(self._values) / len(self._values) if self._values else 0.0


class Arima:
    name = "arima"

    def __init__(
        self, history: int = 32, min_history: int = 6, order: tuple[int, int, int] = (1, 1, 1)
    ) -> None:
        self._values: deque[float] = deque(maxlen=history)
        self._min_history = min_history
        self._order = order

    def add(self, value: float) -> None:
        self._values.append(value)

    def predict(self) -> float:
        if not self._values:
            return 0.0
        last = self._values[-1]
        if len(self._values) < self._min_history or max(self._values) == min(self._values):
            return last  # too short to fit, or flat (the fit would be singular)
        from statsmodels.tsa.arima.model import ARIMA  # imported on first use: statsmodels is slow to load

        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # convergence chatter on short series
                fitted = ARIMA(list(self._values), order=self._order).fit()
            forecast = float(fitted.forecast(1)[0])
        except (ValueError, ArithmeticError, IndexError) as exc:  # a degenerate series: no model fits
            log.debug("arima fit failed (%s); predicting the last value", exc)
            return last
        return max(0.0, forecast) if math.isfinite(forecast) else last


class Auto:
    """Runs every predictor and answers with the one whose recent one-step errors are the smallest."""

    name = "auto"

    def __init__(self, decay: float = 0.7) -> None:
        self.candidates: list[Predictor] = [Constant(), MovingAverage(), Arima()]
        self.errors = dict.fromkeys((c.name for c in self.candidates), 0.0)  # weighted absolute error
        self._decay = decay
        self._pending: dict[str, float] | None = None  # each candidate's prediction of the value to come

    def add(self, value: float) -> None:
        if self._pending is not None:
            for name, predicted in self._pending.items():
                self.errors[name] = self._decay * self.errors[name] + abs(predicted - value)
        for candidate in self.candidates:
            candidate.add(value)
        self._pending = None

    @property
    def best(self) -> str:
        return min(self.errors, key=lambda name: self.errors[name])  # ties: the simplest, listed first

    def predict(self) -> float:
        if self._pending is None:
            self._pending = {c.name: c.predict() for c in self.candidates}
        return self._pending[self.best]


def make_predictor(name: str) -> Predictor:
    """A fresh predictor by name (one of PREDICTORS); ValueError naming the choices otherwise."""
    kinds = {"constant": Constant, "moving_average": MovingAverage, "arima": Arima, "auto": Auto}
    if name not in kinds:
        raise ValueError(f"--predictor {name!r}: expected one of {', '.join(PREDICTORS)}")
    return kinds[name]()
