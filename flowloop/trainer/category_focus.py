"""Category draw weights that follow what the policy still gets wrong (``data.category_focus``).

Fixed ``data.category_weights`` that favour the weak categories (colour attribution, position)
lift them, but the categories they starve drift back: counting fell from 0.7 to 0.4 training
accuracy over 120 steps when it got a seventh of the samples. Here each category's weight is
scaled by ``max(1 - a, FLOOR) ** focus``, where ``a`` is a moving average of that category's
recent training accuracy, so a category that starts to fail is drawn more again, and one that
is solved keeps a small share instead of none. Measured on the shapes world it re-balances the
draw as meant, yet counting kept falling and held-out accuracy did not beat equal categories
(`benchmarks/results/recipe_sweep_h200_round12.txt`): an option, off by default.
"""

from __future__ import annotations

import numpy as np

DECAY = 0.9
"""Moving-average decay per step of observed accuracy: about the last ten steps count, the same
span `flowloop plot` averages the training curves over, long enough to smooth the one or two
groups a category gets in a step."""
FLOOR = 0.1
"""Smallest ``1 - accuracy`` a category is weighted by: a solved category still gets drawn, at
a tenth of the weight of one that is never right, so a lapse shows up in its accuracy."""


class CategoryFocus:
    """Draw probabilities over a fixed list of categories from base weights and the moving
    average of each category's training accuracy. Its state is that average, checkpointed so a
    resumed run draws the same prompts."""

    def __init__(self, categories: list[str], base_weights: np.ndarray, focus: float):
        self.categories = list(categories)
        self.base_weights = np.asarray(base_weights, dtype=np.float64)
        self.focus = float(focus)
        self.accuracy = np.full(len(self.categories), np.nan)
        """Moving average of each category's training accuracy; NaN until first seen."""

    def probs(self) -> np.ndarray:
        """``base * max(1 - accuracy, FLOOR) ** focus``, normalised; a category not seen yet
        keeps its base weight (factor 1, as if never right)."""
        miss = np.where(np.isnan(self.accuracy), 1.0, np.maximum(1.0 - self.accuracy, FLOOR))
        weights = self.base_weights * miss ** self.focus
        return weights / weights.sum()

    def observe(self, accuracy: dict[str, float]) -> None:
        """Fold in one step's training accuracy per category (categories not drawn this step are
        left as they were)."""
        for i, name in enumerate(self.categories):
            if name not in accuracy:
                continue
            seen = self.accuracy[i]
            self.accuracy[i] = accuracy[name] if np.isnan(seen) else DECAY * seen + (1.0 - DECAY) * accuracy[name]

    def state_dict(self) -> dict:
        return {"accuracy": self.accuracy.tolist()}

    def load_state_dict(self, state: dict) -> None:
        self.accuracy = np.array(state["accuracy"], dtype=np.float64)
