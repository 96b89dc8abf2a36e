"""Which loss law should `model.size: auto` rank shapes by? Two fits to the measured sweeps of
ultrathink/train/sizing_evidence.py, judged by the regret of the shape each would have picked on a sweep it did not
see (leave one sweep out):

- **Chinchilla + R\\***, what ships: Hoffmann et al.'s constants, only Muennighoff's repeat discount R* fitted
  (sizing_evidence.fit_repeat_decay, least total regret over its grid);
- **our own law**: L = E_corpus + A / N^α + B / D'^β in bits per byte, D' the repeat-discounted tokens, with A, α, B, β
  and R* shared and one E per corpus (E cannot change a ranking within a sweep), fitted by robust least squares
  (soft L1, scale 0.02 bits/byte: about the run-to-run spread) from a grid of starting points.

    .venv/bin/python benchmarks/sizing_fit.py

Prints each fit's constants, its regret on the sweeps it was fitted to, and its regret on each left-out sweep.
No training: the figures are the evidence table's.
"""

from __future__ import annotations

import itertools
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from scipy.optimize import least_squares

# This checkout's package, not an editable install of another clone (train_throughput.py says why).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ultrathink.train import sizing  # noqa: E402
from ultrathink.train.sizing_evidence import SWEEPS, Measured, Sweep, fit_repeat_decay, total_regret  # noqa: E402

STARTS = list(itertools.product((2.0, 5.0), (2.0, 5.0), (0.2, 0.5), (0.2, 0.5), (2.0, 8.0)))  # ln A, ln B, α, β, R*


@dataclass(frozen=True)
class Law:
    a: float
    alpha: float
    b: float
    beta: float
    repeat_decay: float

    def loss(self, non_embedding_params: int, tokens: float, sweep: Sweep) -> float:
        """Predicted bits per byte less the corpus's E (a constant within a sweep)."""
        seen = sizing.effective_tokens(tokens, sweep.corpus_tokens, self.repeat_decay)
        return self.a / non_embedding_params ** self.alpha + self.b / seen ** self.beta

    def pick(self, sweep: Sweep) -> Measured:
        """The shape it predicts best at its runs' mean tokens (as sizing_evidence judges Chinchilla + R*)."""
        return min(sweep.shapes(), key=lambda m: self.loss(m.non_embedding_params, m.tokens, sweep))

    def regret(self, sweep: Sweep) -> float:
        return sweep.regret_of(self.pick(sweep))


def fit_law(sweeps: tuple[Sweep, ...]) -> tuple[Law, dict[str, float]]:
    """Our own law fitted to `sweeps`: the constants, and each corpus's E."""
    corpora = sorted({s.corpus for s in sweeps})
    rows = [(s, r, corpora.index(s.corpus)) for s in sweeps for r in s.runs]

    def law(x) -> Law:
        return Law(math.exp(x[0]), x[2], math.exp(x[1]), x[3], x[4])

    def residuals(x):
        return [x[5 + c] + law(x).loss(r.non_embedding_params, r.tokens, s) - r.bpb for s, r, c in rows]

    lower = [-5, -5, 0.01, 0.01, 0.5] + [0.0] * len(corpora)
    upper = [30, 30, 2.0, 2.0, 100.0] + [5.0] * len(corpora)
    best = min((least_squares(residuals, [*start, *[1.5] * len(corpora)], bounds=(lower, upper), loss="soft_l1",
                              f_scale=0.02) for start in STARTS), key=lambda out: out.cost)
    return law(best.x), dict(zip(corpora, best.x[5:]))


def name(sweep: Sweep) -> str:
    return f"{sweep.corpus.split(' (')[0]}, {sweep.budget}"


def main() -> None:
    law, floors = fit_law(SWEEPS)
    decay = fit_repeat_decay(SWEEPS)
    print(f"{len(SWEEPS)} sweeps, {sum(len(s.runs) for s in SWEEPS)} runs (ultrathink/train/sizing_evidence.py)")
    print(f"Chinchilla + R*: R* {decay:g}; in-sample regret {total_regret(decay):.4f} bits/byte")
    print(f"own law: A {law.a:.4g}, α {law.alpha:.3f}, B {law.b:.4g}, β {law.beta:.3f}, R* {law.repeat_decay:.2f}, "
          f"E " + ", ".join(f"{c.split(' (')[0]} {e:.3f}" for c, e in floors.items())
          + f"; in-sample regret {sum(law.regret(s) for s in SWEEPS):.4f} bits/byte")
    print("\nleft-out sweep | Chinchilla + R* (R* fitted to the others): pick, regret | own law (fitted to the others): "
          "pick, regret")
    totals = [0.0, 0.0]
    for i, sweep in enumerate(SWEEPS):
        others = SWEEPS[:i] + SWEEPS[i + 1:]
        decay = fit_repeat_decay(others)
        own, _ = fit_law(others)
        totals[0] += sweep.regret(decay)
        totals[1] += own.regret(sweep)
        print(f"{name(sweep)} | R* {decay:g}: {sweep.pick(decay).shape}, {sweep.regret(decay):.4f} | "
              f"α {own.alpha:.2f} β {own.beta:.2f} R* {own.repeat_decay:.1f}: {own.pick(sweep).shape}, {own.regret(sweep):.4f}")
    print(f"total | {totals[0]:.4f} | {totals[1]:.4f}")


if __name__ == "__main__":
    main()
