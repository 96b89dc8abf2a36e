"""The measured runs `model.size: auto`'s loss law is calibrated on: shapes trained side by side for the same
seconds on one corpus, each with the tokens it saw and the held-out bits per byte it reached
(`benchmarks/budget_quality.py --skip-baseline --variant dWxL=model.d_model=W,model.n_layers=L ...`).

Only the law's repeat discount (sizing.REPEAT_DECAY) is fitted here: at a corpus's 8–12th epoch Muennighoff et
al.'s R* = 15.4 (fitted at billions of parameters) still counted repeats as nearly new text, and so preferred a
small model seeing many epochs to a larger one seeing fewer; these runs say the larger one is better there. The
step cost (seconds per token of each shape) is measured by the plan's probe, not fitted here: each row's tokens are
what its shape really saw, so a row judges the loss law alone.

The dropout rule (sizing.DROPOUT_FROM_EPOCHS) is fitted to DROPOUT_CELLS the same way: one corpus, budget and shape
trained with and without dropout, the rule's regret on a cell being how much worse its level measured than the
best level there.

A sweep is one corpus and budget. A decay's regret on a sweep is how much worse (bits per byte) the shape the law
prefers was than the best measured one; `fit_repeat_decay` takes the decay with the least total regret. Versioned
with the code: add rows (a new corpus, machine class or budget) and tests/test_sizing.py says whether
REPEAT_DECAY still fits them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ultrathink.train import sizing


@dataclass(frozen=True)
class Run:
    shape: str  # d_model x layers, as the run's variant named it
    non_embedding_params: int
    tokens: int  # trained on: steps × batch × seq_len
    bpb: float  # held-out bits per byte


@dataclass(frozen=True)
class Sweep:
    corpus: str
    budget: str
    corpus_tokens: int  # the training split's tokens under the corpus's own (auto-sized) tokenizer
    runs: tuple[Run, ...]
    where: str = "2 cores of an AMD EPYC Zen 4 (AVX512-BF16), bf16"

    def pick(self, repeat_decay: float) -> Run:
        """The run whose (parameters, tokens) the law predicts the lowest loss for."""
        return min(self.runs, key=lambda r: sizing.predicted_loss(r.non_embedding_params, r.tokens,
                                                                   self.corpus_tokens, repeat_decay))

    def regret(self, repeat_decay: float) -> float:
        return self.regret_of(self.pick(repeat_decay))

    def regret_of(self, run: Run) -> float:
        """How much worse `run` measured than the sweep's best run (bits per byte)."""
        return run.bpb - min(r.bpb for r in self.runs)


# Rows from three sessions on the same machine (2026-11-24/25); where a shape was run twice, both runs are rows. The
# corpora: the first 90% of each (the rest is the held-out text), tokenized by the auto-sized tokenizer.
PRIDE, SHAKESPEARE, WIKITEXT = 303_755, 489_223, 830_799
SWEEPS: tuple[Sweep, ...] = (
    Sweep("Pride and Prejudice (0.63 MB, vocab 384)", "2min", PRIDE, (
        Run("d192x2", 885_952, 3_432_448, 2.2158), Run("d192x2", 885_952, 3_493_888, 2.2187),
        Run("d192x3", 1_328_832, 2_160_640, 2.0995), Run("d192x4", 1_771_712, 1_632_256, 2.1013),
        Run("d256x3", 2_214_016, 1_313_792, 2.1271), Run("d192x4", 1_771_712, 1_605_632, 2.0961))),
    Sweep("tiny Shakespeare (1.0 MB, vocab 448)", "2min", SHAKESPEARE, (
        Run("d192x2", 885_952, 3_170_304, 2.2024), Run("d192x2", 885_952, 3_584_000, 2.2006),
        Run("d192x3", 1_328_832, 1_869_824, 2.1711), Run("d192x3", 1_328_832, 2_398_208, 2.1454),
        Run("d192x4", 1_771_712, 1_404_928, 2.1810), Run("d256x3", 2_214_016, 1_359_872, 2.2090),
        Run("d192x3", 1_328_832, 2_273_280, 2.1570))),
    Sweep("WikiText-2 valid+test (2.1 MB, vocab 704)", "2min", WIKITEXT, (
        Run("d192x2", 885_952, 3_104_768, 1.7405), Run("d192x2", 885_952, 2_633_728, 1.7617),
        Run("d192x3", 1_328_832, 2_115_584, 1.7616), Run("d192x3", 1_328_832, 2_134_016, 1.7589))),
    Sweep("WikiText-2 valid+test (2.1 MB, vocab 704)", "12s", WIKITEXT, (
        Run("d128x1", 197_120, 750_592, 2.0121), Run("d192x3", 1_328_832, 144_384, 2.4802))),
    # 2026-11-25, later: every run here is worse than the 2-minute ones above (7–23 epochs, dropout 0);
    # the law's pick (d320 × 4) is still the best of the three.
    Sweep("tiny Shakespeare (1.0 MB, vocab 448)", "10min", SHAKESPEARE, (
        Run("d320x4", 5_082_432, 3_330_048, 2.2060), Run("d256x4", 2_951_936, 5_320_704, 2.2132),
        Run("d192x3", 1_328_832, 11_436_032, 2.2422))),
)


def total_regret(repeat_decay: float, sweeps: tuple[Sweep, ...] = SWEEPS) -> float:
    return sum(s.regret(repeat_decay) for s in sweeps)


# Decays tried: Muennighoff's 15.4 and a grid below it, coarse enough that a fit moves only on real evidence.
GRID = (1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 12.0, 15.4)


def fit_repeat_decay(sweeps: tuple[Sweep, ...] = SWEEPS) -> float:
    """The decay of GRID with the least total regret; among equals, the smallest (the strongest discount). The rule
    in use does not see the tokens a shape will get but predicts them from the probe's step cost, a few % off
    either way; the strongest discount that fits keeps the larger shape's measured win clear of that error (at 2
    min on tiny Shakespeare, R* 6 fits the measured tokens too, but the predicted ones tip it back to d192 × 2)."""
    best = min(total_regret(d, sweeps) for d in GRID)
    return min(d for d in GRID if total_regret(d, sweeps) <= best + 1e-9)


# ---- dropout -----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DropoutCell:
    """One corpus, budget and shape trained for the same seconds with dropout 0 and other levels: `undropped_tokens`
    are what each run without dropout trained on (its epochs are what sizing.dropout_for sees when it chooses),
    `bpb` each level's held-out bits per byte, a tuple where the level was run more than once."""
    corpus: str
    budget: str
    shape: str
    corpus_tokens: int
    undropped_tokens: tuple[int, ...]
    bpb: dict[float, tuple[float, ...]]
    where: str = "2 cores of an AMD EPYC Zen 4 (AVX512-BF16), bf16"

    @property
    def epochs(self) -> float:
        return sum(self.undropped_tokens) / len(self.undropped_tokens) / self.corpus_tokens

    def mean(self, level: float) -> float:
        return sum(self.bpb[level]) / len(self.bpb[level])

    def regret(self, level: float) -> float:
        """How much worse `level` measured here than the best level (bits per byte); inf where it was not run."""
        return self.mean(level) - min(self.mean(x) for x in self.bpb) if level in self.bpb else math.inf


# Runs of `budget_quality.py --skip-baseline --set model.dropout=X` (2026-11-25), the shape the sizing picked for
# each; one run per level unless two are listed. WikiText-2 at 10 min: the run with dropout set was sized at its own
# slower step and got d256 × 3 (the rule now sizes at the speed without dropout, so it would get d320 × 4).
DROPOUT_CELLS: tuple[DropoutCell, ...] = (
    DropoutCell("WikiText-2 valid+test (2.1 MB, vocab 704)", "2min", "d192x2", WIKITEXT, (3_104_768, 2_633_728),
                {0.0: (1.7405, 1.7617), 0.1: (1.8087,)}),
    DropoutCell("WikiText-2 valid+test (2.1 MB, vocab 704)", "10min", "d320x4 (0.1: d256x3)", WIKITEXT,
                (3_510_272,), {0.0: (1.6865,), 0.1: (1.6782,)}),
    DropoutCell("Pride and Prejudice (0.63 MB, vocab 384)", "2min", "d192x2", PRIDE, (2_783_232, 3_051_520),
                {0.0: (2.1713, 2.1798), 0.1: (2.1391,), 0.2: (2.1811,)}),
    DropoutCell("tiny Shakespeare (1.0 MB, vocab 448)", "2min", "d192x2", SHAKESPEARE, (3_526_656, 2_850_816),
                {0.0: (2.2031, 2.1950), 0.1: (2.1998,), 0.2: (2.2489,)}),
    DropoutCell("tiny Shakespeare (1.0 MB, vocab 448)", "10min", "d320x4", SHAKESPEARE, (3_330_048,),
                {0.0: (2.2060,), 0.1: (2.1385,), 0.2: (2.1631,)}),
    DropoutCell("Pride and Prejudice (0.63 MB, vocab 384)", "10min", "d320x4", PRIDE, (3_600_384,),
                {0.0: (2.2027,), 0.1: (2.0815,), 0.2: (2.0771,)}),
)

# A total regret this close to the least is a tie: one run per level spreads by 0.01–0.03 bits/byte at 2 min.
NOISE = 0.01
# Steps tried: the epochs from which 0.1, and from which 0.2, apply (inf: never).
EPOCH_GRID = (2.0, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 12.0, 15.0, 20.0, math.inf)


def dropout_regret(steps: tuple[tuple[float, float], ...], cells: tuple[DropoutCell, ...] = DROPOUT_CELLS) -> float:
    """The total regret of the levels a rule of (epochs from which, dropout) `steps` picks on `cells`."""
    return sum(cell.regret(max((level for start, level in steps if cell.epochs >= start), default=0.0))
               for cell in cells)


def fit_dropout_steps(cells: tuple[DropoutCell, ...] = DROPOUT_CELLS) -> tuple[tuple[float, float], ...]:
    """The rule of EPOCH_GRID steps that the runs support: the fewest steps whose total regret on `cells` is within
    NOISE of the least any rule has (a step that only wins by less than the runs' spread is not evidence), then the
    least regret, then the latest (dropout slows every step). A level no cell ran at its epochs cannot be chosen."""
    rules = {tuple(step for step in ((first, 0.1), (second, 0.2)) if step[0] < math.inf)
             for first in EPOCH_GRID for second in EPOCH_GRID if second >= first}
    best = min(dropout_regret(rule, cells) for rule in rules)
    supported = [rule for rule in rules if dropout_regret(rule, cells) <= best + NOISE]
    return min(supported, key=lambda rule: (len(rule), round(dropout_regret(rule, cells), 9),
                                            [-start for start, _ in rule]))
