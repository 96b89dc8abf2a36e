"""The output's temperature, fitted on the validation split after pretraining (train.calibrate).

A model trained for several epochs of a small corpus is overconfident on text it has not seen: dividing its logits
by a temperature T a little above 1 lowers the held-out loss (post-hoc temperature scaling; Guo et al., "On
Calibration of Modern Neural Networks", 2017). T is fitted on the validation split, never on the text a model is
judged on, and folded into the final RMSNorm's gain: the logits are linear in that gain, so the saved model is an
ordinary one (its export, generation and fine-tuning see nothing new) whose logits are the trained model's over T.

One validation pass keeps the logits (in the dtype the model computes them in, at most MAX_LOGITS of them: the
first targets' rows where the pass has more), and the loss is minimised over β = 1/T on them. The loss is convex in
β (its second derivative is the variance of the logits under the model's own distribution), so Newton's method
inside a bracket that the derivative's sign shrinks finds the minimum whatever T is: far from 1 the loss is nearly
linear in β and a plain Newton step from β = 1 overshoots.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ultrathink.scoring import IGNORE
from ultrathink.train.engine import autocast

# The state-dict key of the gain whose scale is the logits' scale (tied or untied output projection alike).
OUTPUT_GAIN = "norm.weight"
BETA_RANGE = (0.25, 4.0)  # β = 1/T is searched within these; a minimum on a bound stays there
MAX_LOGITS = 1 << 26  # logits kept from the validation pass (128 MB in bf16): 2,048 targets of a 32k vocabulary
ROWS = 4096  # targets per chunk of the loss's evaluation (its float32 temporaries)


@dataclass(frozen=True)
class Calibration:
    temperature: float  # 1.0: the model is left as it was
    loss_before: float  # mean validation loss (nats per target) at T = 1, on the targets kept
    loss_after: float  # at `temperature`
    targets: int  # the validation targets the fit saw


class ValidationLogits:
    """The logits of a validation pass and their targets, and the mean loss with its first two derivatives in β
    at any β."""

    def __init__(self, logits: torch.Tensor, targets: torch.Tensor):
        self.logits, self.targets = logits, targets

    @classmethod
    @torch.no_grad()
    def of(cls, model, batches: Iterable, precision: str) -> ValidationLogits:
        device = next(model.parameters()).device
        kept, targets, room = [], [], MAX_LOGITS
        was_training = model.training
        model.eval()
        for x, y in batches:
            with autocast(precision, str(device)):
                logits = model(x.to(device)).logits
            logits, y = logits.reshape(-1, logits.shape[-1]), y.to(device).reshape(-1)
            keep, rows = y != IGNORE, room // logits.shape[-1]
            logits, y = logits[keep][:rows], y[keep][:rows]
            kept.append(logits)
            targets.append(y)
            room -= logits.numel()
            if room < logits.shape[-1]:
                break  # every rank stops at the same batch: they run the same passes
        model.train(was_training)
        return cls(torch.cat(kept), torch.cat(targets))

    def loss(self, beta: float) -> tuple[float, float, float]:
        """(mean loss, its derivative in β, its second derivative) at β."""
        loss = slope = curvature = 0.0
        for start in range(0, len(self.targets), ROWS):
            z, y = self.logits[start : start + ROWS].float(), self.targets[start : start + ROWS]
            log_p = F.log_softmax(beta * z, dim=-1)
            p = log_p.exp()
            mean_z = (p * z).sum(-1)  # d/dβ of logsumexp(βz): the logits' mean under the model's distribution
            loss += float(-log_p.gather(1, y[:, None]).sum())
            slope += float((mean_z - z.gather(1, y[:, None]).squeeze(1)).sum())
            curvature += float(((p * z * z).sum(-1) - mean_z**2).sum())
        n = max(len(self.targets), 1)
        return loss / n, slope / n, curvature / n

    def best_beta(self, tolerance: float = 1e-5, steps: int = 60) -> float:
        """The β in BETA_RANGE of the lowest loss: Newton steps from β = 1, each kept inside the bracket [lo, hi]
        that holds the minimum (by convexity, beyond any β where the derivative is negative, short of any where it
        is positive), halving it where a step would leave it; a minimum past a bound ends next to that bound."""
        lo, hi = BETA_RANGE
        beta = 1.0
        for _ in range(steps):
            _, slope, curvature = self.loss(beta)
            if slope < 0:
                lo = beta
            else:
                hi = beta
            step = beta - slope / curvature if curvature > 0 else None
            beta = step if step is not None and lo < step < hi else (lo + hi) / 2
            if hi - lo < tolerance or abs(slope) < tolerance:
                break
        return beta


def fit_temperature(model, batches: Iterable, precision: str) -> Calibration:
    """The temperature of the lowest mean loss of `model` on the (x, y) `batches` (one pass). Every rank of a run
    calls it (the forward passes are collective under FSDP); each computes the same."""
    logits = ValidationLogits.of(model, batches, precision)
    before = logits.loss(1.0)[0]
    beta = logits.best_beta()
    after = logits.loss(beta)[0]
    if not after < before:
        return Calibration(1.0, before, before, len(logits.targets))
    return Calibration(1.0 / beta, before, after, len(logits.targets))


def fold_temperature(weights: dict[str, torch.Tensor], temperature: float) -> dict[str, torch.Tensor]:
    """`weights` (a state dict of the model) whose logits are the given weights' divided by `temperature`."""
    if temperature == 1.0:
        return weights
    return {**weights, OUTPUT_GAIN: weights[OUTPUT_GAIN] / temperature}
