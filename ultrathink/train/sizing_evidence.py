"""The measured runs `model.size: auto`'s loss law is calibrated on: shapes trained side by side for the same
seconds on one corpus, each with the tokens it saw and the held-out bits per byte it reached
(`benchmarks/budget_quality.py --skip-baseline --variant dWxL=model.d_model=W,model.n_layers=L ...`).

The law's repeat discount (sizing.REPEAT_DECAY) is fitted here: at a corpus's 8–12th epoch Muennighoff et
al.'s R* = 15.4 (fitted at billions of parameters) still counted repeats as nearly new text, and so preferred a
small model seeing many epochs to a larger one seeing fewer; these runs say the larger one is better there. The
step cost (seconds per token of each shape) is measured by the plan's probe, not fitted here: each row's tokens are
what its shape really saw, so a row judges the loss law alone.

The dropout rule's repeat discount (sizing.DROPOUT_REPEAT_DECAY) is fitted the same way, to runs of the law's shape
with dropout beside those without (a sweep's `dropped` runs): the rule keeps dropout where the tokens its slower
step left, their repeats discounted at that R*, are predicted to beat the tokens without it, and its regret on a
sweep is how much worse the level it keeps measured than the better of the two at that shape. (Earlier dropout runs
whose tokens were not recorded are in benchmarks/README.md only: without their tokens they cannot judge the law.)

A sweep is one corpus and budget. A shape run more than once counts by its runs' means (tokens and bits per byte):
repeats of one configuration differ by up to 0.04 bits/byte, more than most gaps between shapes. A decay's regret
on a sweep is how much worse (mean bits per byte) the shape the law prefers was than the best measured one;
`fit_repeat_decay` takes the decay with the least total regret, and `fit_dropout` the dropout rule's two constants
at that decay; each counts a total within one run's noise of the least as a tie (`noise`: the spread between a
sweep's repeats, at one seed but in the sweeps of December 2026, and the spread between seeds of one configuration
at equal steps, SEED_RUNS). Versioned with the code: add rows (a new corpus, machine class, budget or recipe) and
tests/test_budget.py says whether REPEAT_DECAY and DROPOUT_REPEAT_DECAY still fit them.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from ultrathink.train import sizing


@dataclass(frozen=True)
class Run:
    shape: str  # d_model x layers, as the run's variant named it
    non_embedding_params: int
    tokens: int  # trained on: steps × batch × seq_len
    bpb: float  # held-out bits per byte


@dataclass(frozen=True)
class Measured:
    """One shape in a sweep: its runs' mean tokens and mean bits per byte. Repeats of one configuration differ by
    up to 0.04 bits/byte and by a fifth in tokens (the machine's load), so a law is judged on the means: judged run
    by run, it was credited for preferring whichever repeat happened to see the most tokens."""
    shape: str
    non_embedding_params: int
    tokens: float
    bpb: float
    runs: int

    @classmethod
    def of(cls, runs: tuple[Run, ...]) -> "Measured":
        return cls(runs[0].shape, runs[0].non_embedding_params, _mean(runs, "tokens"), _mean(runs, "bpb"), len(runs))


@dataclass(frozen=True)
class Sweep:
    corpus: str
    budget: str
    corpus_tokens: int  # the training split's tokens under the corpus's own (auto-sized) tokenizer
    runs: tuple[Run, ...]  # without dropout
    dropped: tuple[Run, ...] = ()  # with dropout sizing.DROPOUT, at shapes of `runs` (its tokens: what it saw)
    where: str = "2 cores of an AMD EPYC Zen 4 (AVX512-BF16), bf16"

    def shapes(self) -> tuple[Measured, ...]:
        """Each shape run without dropout, its repeats averaged."""
        names = dict.fromkeys(r.shape for r in self.runs)
        return tuple(Measured.of(tuple(r for r in self.runs if r.shape == name)) for name in names)

    def pick(self, repeat_decay: float, params_per_token: float = sizing.MEASURED_PARAMS_PER_TOKEN) -> Measured:
        """The shape whose (parameters, mean tokens) the law predicts the lowest loss for. This judges the law
        alone, not the plan's tie-break (sizing.TIE: within 0.5% the cheaper shape): judged with it, the 21 sweeps
        of then could not tell R* 4 from 5 (total regret 0.1615 against 0.1617, noise 0.013), and a fit that took
        R* 4 on that made the real planning step pick d192 x 4 on tiny Shakespeare's 2-minute cell in 6 of 6 plans,
        where R* 5 picked d192 x 3 in 5 of 7 (measured 0.011 better than x 4), and changed no pick on Pride's
        (benchmarks/README.md, seventy-third session)."""
        return min(self.shapes(), key=lambda m: sizing.predicted_loss(
            m.non_embedding_params, m.tokens, self.corpus_tokens, repeat_decay, params_per_token))

    def regret(self, repeat_decay: float, params_per_token: float = sizing.MEASURED_PARAMS_PER_TOKEN) -> float:
        return self.regret_of(self.pick(repeat_decay, params_per_token))

    def best(self) -> Measured:
        """The shape that measured best (mean bits per byte)."""
        return min(self.shapes(), key=lambda m: m.bpb)

    def regret_of(self, shape: Measured) -> float:
        """How much worse `shape` measured than the sweep's best shape without dropout (mean bits per byte)."""
        return shape.bpb - self.best().bpb

    def at_pick(self, repeat_decay: float) -> tuple[tuple[Run, ...], tuple[Run, ...]]:
        """The runs without and with dropout of the shape the law picks."""
        shape = self.pick(repeat_decay).shape
        return tuple(r for r in self.runs if r.shape == shape), tuple(r for r in self.dropped if r.shape == shape)

    def dropout_measured_better(self, repeat_decay: float) -> bool | None:
        """Whether dropout measured better at the law's shape (mean bits per byte); None where it was not run."""
        undropped, dropped = self.at_pick(repeat_decay)
        return _mean(dropped, "bpb") < _mean(undropped, "bpb") if dropped else None

    def params_per_token(self, repeat_decay: float) -> float:
        """Non-embedding parameters of the law's shape per unique training token."""
        return self.pick(repeat_decay).non_embedding_params / self.corpus_tokens

    def dropout_regret(self, repeat_decay: float, dropout_decay: float, min_params_per_token: float) -> float:
        """At the law's shape, how much worse the level sizing.dropout_pays keeps measured than the better level
        (each level's mean), averaged over the runs with dropout: each is one draw of the slowdown a plan would
        measure (its tokens against the mean tokens without it). 0 where the shape was not run with dropout."""
        undropped, dropped = self.at_pick(repeat_decay)
        if not dropped:
            return 0.0
        without, with_ = _mean(undropped, "bpb"), _mean(dropped, "bpb")
        kept = [sizing.dropout_pays(r.non_embedding_params, _mean(undropped, "tokens"), r.tokens, self.corpus_tokens,
                                    dropout_decay, min_params_per_token, repeat_decay) for r in dropped]
        return sum((with_ if k else without) - min(without, with_) for k in kept) / len(kept)


def _mean(runs: tuple[Run, ...], field: str) -> float:
    return sum(getattr(r, field) for r in runs) / len(runs)


# Rows from the sessions' machines (2026-11-24/26; a Zen 4 where `where` does not say otherwise); where a shape was
# run more than once, each run is a row. The corpora: the first 90% of each (the rest is the held-out text), tokenized
# by the auto-sized tokenizer.
PRIDE, SHAKESPEARE, WIKITEXT, PRIDE_NTOLL = 303_755, 489_223, 830_799, 297_073
ZEN5 = "2 cores of an AMD EPYC Zen 5 (AVX512-BF16), bf16"
ZEN4 = "2 cores of an AMD EPYC Zen 4 (AVX512-BF16), bf16"
SLOW_EMULATED = "1 core of an AMD EPYC Zen 4, fp32 (the slow class emulated: train.precision fp32, train.threads 1)"
# ... and under the budget's vocabulary (tokenizer.vocab_size auto from 1 minute: √bytes of the training split)
TS_960, PRIDE_768, WIKITEXT_1408 = 372_624, 211_676, 685_101
SWEEPS: tuple[Sweep, ...] = (
    Sweep("Pride and Prejudice (0.63 MB, vocab 384)", "2min", PRIDE, (
        Run("d192x2", 885_952, 3_432_448, 2.2158), Run("d192x2", 885_952, 3_493_888, 2.2187),
        Run("d192x3", 1_328_832, 2_160_640, 2.0995), Run("d192x4", 1_771_712, 1_632_256, 2.1013),
        Run("d256x3", 2_214_016, 1_313_792, 2.1271), Run("d192x4", 1_771_712, 1_605_632, 2.0961))),
    Sweep("tiny Shakespeare (1.0 MB, vocab 448)", "2min", SHAKESPEARE, (
        Run("d192x2", 885_952, 3_170_304, 2.2024), Run("d192x2", 885_952, 3_584_000, 2.2006),
        Run("d192x3", 1_328_832, 1_869_824, 2.1711), Run("d192x3", 1_328_832, 2_398_208, 2.1454),
        Run("d192x4", 1_771_712, 1_404_928, 2.1810), Run("d256x3", 2_214_016, 1_359_872, 2.2090),
        Run("d192x3", 1_328_832, 2_273_280, 2.1570), Run("d192x3", 1_328_832, 1_972_224, 2.1646),
        # The shipped rule's own runs since: R* 5 (sixth session), then R* 4 (tenth).
        Run("d192x2", 885_952, 2_174_976, 2.2159), Run("d192x3", 1_328_832, 2_074_624, 2.1675),
        Run("d192x3", 1_328_832, 1_992_704, 2.1710)),
        dropped=(Run("d192x3", 1_328_832, 1_562_624, 2.2428),)),
    Sweep("WikiText-2 valid+test (2.1 MB, vocab 704)", "2min", WIKITEXT, (
        Run("d192x2", 885_952, 3_104_768, 1.7405), Run("d192x2", 885_952, 2_633_728, 1.7617),
        Run("d192x3", 1_328_832, 2_115_584, 1.7616), Run("d192x3", 1_328_832, 2_134_016, 1.7589),
        Run("d192x2", 885_952, 2_777_088, 1.7544), Run("d192x2", 885_952, 2_695_168, 1.7563),
        Run("d192x2", 885_952, 2_838_528, 1.7516)),
        dropped=(Run("d192x2", 885_952, 1_949_696, 1.8275),)),
    Sweep("WikiText-2 valid+test (2.1 MB, vocab 704)", "12s", WIKITEXT, (
        Run("d128x1", 197_120, 750_592, 2.0121), Run("d192x3", 1_328_832, 144_384, 2.4802))),
    # 2026-11-25, later: every run here is worse than the 2-minute ones above (7–23 epochs, dropout 0);
    # the law's pick (d320 × 4) is still the best of the three.
    Sweep("tiny Shakespeare (1.0 MB, vocab 448)", "10min", SHAKESPEARE, (
        Run("d320x4", 5_082_432, 3_330_048, 2.2060), Run("d256x4", 2_951_936, 5_320_704, 2.2132),
        Run("d192x3", 1_328_832, 11_436_032, 2.2422)),
        dropped=(Run("d320x4", 5_082_432, 2_543_616, 2.1385),)),
    # 2026-11-25, sixth session: another copy of the novel (ntoll/pride_and_prejudice_and_python, 684 KB, no
    # Gutenberg header, hard-wrapped at 70): its held-out text is easier than the first copy's, so its rows are
    # their own corpus.
    Sweep("Pride and Prejudice, ntoll's copy (0.62 MB, vocab 384)", "2min", PRIDE_NTOLL, (
        Run("d192x4", 1_771_712, 1_656_832, 1.6470), Run("d192x3", 1_328_832, 1_853_440, 1.6419),
        # R* 4 before the probed shapes were compared at their measured speeds (planned 1.35M tokens at batch 4),
        # then after (batch 8).
        Run("d256x3", 2_214_016, 1_083_392, 1.6699), Run("d256x3", 2_214_016, 1_376_256, 1.6497)),
        dropped=(Run("d192x4", 1_771_712, 1_050_624, 1.7205),)),
    Sweep("Pride and Prejudice, ntoll's copy (0.62 MB, vocab 384)", "2min", PRIDE_NTOLL, (
        Run("d192x2", 885_952, 2_033_664, 1.6586),),
        dropped=(Run("d192x2", 885_952, 1_331_200, 1.7327), Run("d192x2", 885_952, 1_615_872, 1.7016)),
        where="2 cores of an AMD EPYC Zen 4 (AVX512-BF16), fp32"),
    Sweep("Pride and Prejudice, ntoll's copy (0.62 MB, vocab 384)", "5min", PRIDE_NTOLL, (
        Run("d320x4", 5_082_432, 1_693_696, 1.6253),),
        dropped=(Run("d320x4", 5_082_432, 1_189_888, 1.6616),)),
    Sweep("Pride and Prejudice, ntoll's copy (0.62 MB, vocab 384)", "10min", PRIDE_NTOLL, (
        Run("d320x5", 6_352_960, 2_752_512, 1.7114),),
        dropped=(Run("d320x5", 6_352_960, 1_998_848, 1.6040),)),
    # 2026-11-26, ninth session: the shipped 5-minute pick three times, with dropout twice, and one run with
    # train.compile whose faster probed step sized a deeper model (its tokens are what it saw). Batch 16, seq 256.
    Sweep("tiny Shakespeare (1.0 MB, vocab 448)", "5min", SHAKESPEARE, (
        Run("d256x3", 2_214_016, 3_764_224, 2.2014), Run("d256x3", 2_214_016, 3_420_160, 2.1649),
        Run("d256x3", 2_214_016, 3_162_112, 2.1642), Run("d256x4", 2_951_936, 2_646_016, 2.1563),
        # Tenth session: the R* 4 rule's pick, eager, twice.
        Run("d256x4", 2_951_936, 2_568_192, 2.1675), Run("d256x4", 2_951_936, 2_637_824, 2.1701)),
        dropped=(Run("d256x3", 2_214_016, 2_535_424, 2.1562), Run("d256x3", 2_214_016, 2_310_144, 2.1740))),
    # 2026-11-26, thirteenth session: the first 100 KB of tiny Shakespeare and of Pride (ntoll's copy) and the first
    # 150 KB of WikiText-2, 2 minutes: a budget large beside its corpus (the regime a GPU is in beside a whole one),
    # the shipped defaults (weight decay 1.0 at these epochs), one run per shape but the Shakespeare pick's (twice,
    # to the same best checkpoint). The law's picks are at 57–91 parameters per token. They disagree: on WikiText-2
    # the pick (64 per token) measured best and the smaller shapes 0.04–0.11 worse; on Pride d192 × 3 (26 per token)
    # measured best and the pick (57) 0.045 worse; on Shakespeare the smallest shape (7 per token) measured best and
    # the pick (91) 0.067 worse. Those two are the law's misses beyond the spread, and no bound on the parameters per
    # token it credits fixes them without missing WikiText-2 (test_budget.py).
    Sweep("tiny Shakespeare, first 100 KB (0.09 MB, vocab 320)", "2min", 55_694, (
        Run("d320x4", 5_082_432, 603_136, 2.4387), Run("d320x4", 5_082_432, 576_512, 2.4387),
        Run("d128x2", 394_112, 5_541_888, 2.3713), Run("d192x3", 1_328_832, 1_746_944, 2.3812),
        Run("d256x3", 2_214_016, 1_105_920, 2.4389))),
    Sweep("WikiText-2 valid+test, first 150 KB (0.13 MB, vocab 320)", "2min", 79_082, (
        Run("d320x4", 5_082_432, 634_880, 2.4543), Run("d128x1", 197_120, 8_871_936, 2.5618),
        Run("d128x2", 394_112, 5_390_336, 2.5337), Run("d192x2", 885_952, 2_392_064, 2.4970),
        Run("d192x3", 1_328_832, 1_640_448, 2.5125))),
    Sweep("Pride and Prejudice, ntoll's copy, first 100 KB (0.09 MB, vocab 320)", "2min", 51_419, (
        Run("d256x4", 2_951_936, 990_208, 2.2336), Run("d128x2", 394_112, 5_840_896, 2.3235),
        Run("d192x3", 1_328_832, 2_041_856, 2.1888), Run("d256x3", 2_214_016, 1_268_736, 2.2558))),
    # The same session, the whole of Pride at 5 minutes with the shipped defaults (weight decay 1.0, where the
    # earlier 5-minute Pride sweep ran 0.1): the law's pick (17 parameters per token) and d256 × 4 (10 per token),
    # 0.011 better.
    Sweep("Pride and Prejudice, ntoll's copy (0.62 MB, vocab 384)", "5min, weight decay 1.0", PRIDE_NTOLL, (
        Run("d320x4", 5_082_432, 1_865_728, 1.6118), Run("d256x4", 2_951_936, 2_607_104, 1.6010))),
    # ... and at 10 minutes: the law's pick (21 per token) 0.090 better than d256 × 4 (10 per token, 18 epochs).
    Sweep("Pride and Prejudice, ntoll's copy (0.62 MB, vocab 384)", "10min, weight decay 1.0", PRIDE_NTOLL, (
        Run("d320x5", 6_352_960, 2_873_344, 1.6113), Run("d256x4", 2_951_936, 5_296_128, 1.7016))),
    # 2026-11-26, fourteenth session: another machine class, 2 cores of an AMD EPYC Zen 5 (about twice the Zen 4's
    # steps in the same seconds), the shipped defaults, 2 minutes, one run per shape but the picks'. On the mean
    # tokens the law at R* 4 picks the best shape on Pride, and shapes within the spread on Shakespeare (d192 × 4,
    # 0.016 worse than d256 × 3's mean) and WikiText-2 (d256 × 3, 0.010 worse; every shape there is within 0.015).
    # Live, the rule's picks moved with the probe's timing (Shakespeare: d256 × 3, then d192 × 4, 0.021 worse), and
    # on Pride it picked d320 × 4 twice, 0.047 worse than d256 × 4: the law prefers d256 × 4 by 0.06% of predicted
    # loss at the tokens each shape's own plan predicted (1.87M against 1.29M), so the rule cannot have measured
    # d256 × 4 at that speed: it compares only the shapes it probes, and the step-cost model, fitted to another
    # shape's probe, decides which. Since then a near runner-up is probed too (sizing.MEASURE_MARGIN); the last two
    # runs of each pick here are that rule's (Pride: d256 × 3, twice).
    Sweep("tiny Shakespeare (1.0 MB, vocab 448)", "2min, Zen 5", SHAKESPEARE, (
        Run("d256x3", 2_214_016, 2_299_904, 2.1353), Run("d192x4", 1_771_712, 2_822_144, 2.1563),
        Run("d192x3", 1_328_832, 3_780_608, 2.1412), Run("d256x4", 2_951_936, 1_779_712, 2.1778),
        Run("d320x4", 5_082_432, 1_119_232, 2.2201), Run("d256x3", 2_214_016, 2_322_432, 2.1330),
        Run("d256x3", 2_214_016, 2_136_064, 2.1540),
        # 2026-11-26, fifteenth session, same class: the rule's picks, with the shapes each run probed recorded
        # (sizing.Sizing.measured): d192 × 4 (with d256 × 3 and d256 × 4), then d256 × 3 twice.
        Run("d192x4", 1_771_712, 2_527_232, 2.1478), Run("d256x3", 2_214_016, 2_084_864, 2.1638),
        Run("d256x3", 2_214_016, 2_088_960, 2.1632)), where=ZEN5),
    Sweep("Pride and Prejudice, ntoll's copy (0.62 MB, vocab 384)", "2min, Zen 5", PRIDE_NTOLL, (
        Run("d320x4", 5_082_432, 1_234_944, 1.6499), Run("d320x4", 5_082_432, 1_212_416, 1.6497),
        Run("d192x3", 1_328_832, 3_436_544, 1.6693), Run("d256x3", 2_214_016, 2_183_168, 1.6281),
        Run("d256x4", 2_951_936, 1_792_000, 1.6027), Run("d256x3", 2_214_016, 1_978_368, 1.6206),
        Run("d256x3", 2_214_016, 2_142_208, 1.6263),
        Run("d256x4", 2_951_936, 1_726_464, 1.6114)), where=ZEN5),  # fifteenth session: the rule's pick
    Sweep("WikiText-2 valid+test (2.1 MB, vocab 704)", "2min, Zen 5", WIKITEXT, (
        Run("d192x3", 1_328_832, 3_715_072, 1.7078), Run("d192x3", 1_328_832, 3_567_616, 1.7123),
        Run("d192x2", 885_952, 5_009_408, 1.7156), Run("d256x3", 2_214_016, 2_322_432, 1.7223),
        Run("d192x4", 1_771_712, 2_453_504, 1.7214), Run("d192x3", 1_328_832, 3_420_160, 1.7159),
        Run("d192x3", 1_328_832, 3_158_016, 1.7144),
        Run("d192x3", 1_328_832, 3_792_896, 1.7068)), where=ZEN5),  # fifteenth session: the rule's pick
    # 2026-11-27, nineteenth session, same class, after each epoch's windows were cut from another offset
    # (train/loader.py): a repeat is worth more than it was, so the law's discount is judged again. The shipped
    # defaults of then (R* 4, weight decay 1.0 from 3.9 epochs), one run per shape; the first run of each is the
    # rule's pick, each at the batch the rule gives it. On these three R* 4 and 5 pick alike (d192 × 4, best on
    # Shakespeare; d256 × 3 on Pride, 0.013 worse than d256 × 4; d192 × 4 on WikiText-2, 0.008 worse than d192 × 3),
    # R* 6 picks the best on WikiText-2: over all the sweeps R* 6's total fell by 0.008, and the fit moved to 5.
    Sweep("tiny Shakespeare (1.0 MB, vocab 448)", "2min, Zen 5, shifted windows", SHAKESPEARE, (
        Run("d192x4", 1_771_712, 3_338_240, 2.1257), Run("d192x3", 1_328_832, 4_481_024, 2.1438),
        Run("d192x4", 1_771_712, 3_452_928, 2.1300), Run("d256x3", 2_214_016, 2_220_032, 2.1442),
        Run("d256x4", 2_951_936, 1_808_384, 2.1609)), where=ZEN5),
    Sweep("Pride and Prejudice, ntoll's copy (0.62 MB, vocab 384)", "2min, Zen 5, shifted windows", PRIDE_NTOLL, (
        Run("d256x3", 2_214_016, 2_473_984, 1.5968), Run("d192x3", 1_328_832, 4_829_184, 1.6801),
        Run("d256x3", 2_214_016, 2_797_568, 1.6147), Run("d256x4", 2_951_936, 1_785_856, 1.5927),
        Run("d320x4", 5_082_432, 1_293_312, 1.6115)), where=ZEN5),
    Sweep("WikiText-2 valid+test (2.1 MB, vocab 704)", "2min, Zen 5, shifted windows", WIKITEXT, (
        Run("d192x3", 1_328_832, 4_534_272, 1.6970), Run("d192x2", 885_952, 6_619_136, 1.7031),
        Run("d192x3", 1_328_832, 4_681_728, 1.6886), Run("d192x4", 1_771_712, 3_493_888, 1.7005),
        Run("d256x3", 2_214_016, 2_631_680, 1.7067)), where=ZEN5),
    # 2026-12-05/06, seventy-first to seventy-third sessions, Zen 4, under the recipe of then: the weight average over
    # the decay, Adam's β₁ 0.8, the output's temperature, the budget's vocabulary (hence other corpus tokens). Rows of
    # `budget_quality.py` (JSON, tokens included) at seeds 1337, 1 and 2 mixed, the sizing's candidate shapes only,
    # the plan sizing batch, window, dropout and weight decay. At 2 minutes tiny Shakespeare's and WikiText-2's best
    # shape is the smaller of the plan's two, Pride's the larger; on the slow class (emulated: one thread, fp32) the
    # smaller d128 × 3 measured better than the pick d192 × 2. These nine sweeps moved the fit from R* 5 to 6: R* 6
    # picks tiny Shakespeare's best at 2 minutes here, where R* 5 picks d256 × 3 (0.017 worse), and the same shapes
    # as R* 5 on the other eight (benchmarks/README.md, seventy-third and seventy-fourth sessions).
    Sweep("tiny Shakespeare (1.0 MB, vocab 960)", "2min, the recipe of 2026-12", TS_960, (
        Run("d192x4", 1_771_712, 1_951_744, 2.0630), Run("d192x4", 1_771_712, 1_728_512, 2.0840),
        Run("d192x2", 885_952, 3_698_688, 2.0756), Run("d256x3", 2_214_016, 1_624_064, 2.0859),
        Run("d192x4", 1_771_712, 1_982_464, 2.0647), Run("d192x3", 1_328_832, 2_729_984, 2.0600),
        Run("d192x3", 1_328_832, 2_770_944, 2.0689), Run("d192x3", 1_328_832, 2_383_872, 2.0720),
        Run("d192x3", 1_328_832, 2_308_096, 2.0705), Run("d192x3", 1_328_832, 2_297_856, 2.0718),
        Run("d192x3", 1_328_832, 2_304_000, 2.0707), Run("d192x3", 1_328_832, 2_639_872, 2.0594),
        Run("d192x3", 1_328_832, 2_390_016, 2.0718), Run("d192x3", 1_328_832, 2_320_384, 2.0704),
        Run("d192x3", 1_328_832, 2_551_808, 2.0727), Run("d192x3", 1_328_832, 2_484_224, 2.0703),
        Run("d192x3", 1_328_832, 2_326_528, 2.0682))),
    Sweep("Pride and Prejudice, ntoll's copy (0.62 MB, vocab 768)", "2min, the recipe of 2026-12", PRIDE_768, (
        Run("d256x3", 2_214_016, 1_669_120, 1.5297), Run("d256x3", 2_214_016, 1_628_160, 1.5352),
        Run("d192x4", 1_771_712, 2_099_200, 1.5411), Run("d192x4", 1_771_712, 2_213_888, 1.5409),
        Run("d256x3", 2_214_016, 1_644_544, 1.5373), Run("d192x4", 1_771_712, 2_021_376, 1.5383),
        Run("d256x3", 2_214_016, 1_523_712, 1.5441), Run("d256x3", 2_214_016, 1_607_680, 1.5360),
        Run("d256x3", 2_214_016, 1_667_072, 1.5362))),
    Sweep("WikiText-2 valid+test (2.1 MB, vocab 1408)", "2min, the recipe of 2026-12", WIKITEXT_1408, (
        Run("d192x3", 1_328_832, 2_463_744, 1.6845), Run("d192x2", 885_952, 3_477_504, 1.6678),
        Run("d192x2", 885_952, 3_371_008, 1.6732))),
    Sweep("tiny Shakespeare (1.0 MB, vocab 960)", "2min, the recipe of 2026-12", TS_960, (
        Run("d128x3", 591_104, 1_536_000, 2.1444), Run("d192x2", 885_952, 1_188_864, 2.1619),
        Run("d192x2", 885_952, 1_149_952, 2.1606), Run("d192x2", 885_952, 1_163_264, 2.1523),
        Run("d192x2", 885_952, 1_083_392, 2.1612), Run("d128x3", 591_104, 1_501_184, 2.1428),
        Run("d128x3", 591_104, 1_523_712, 2.1458)), where=SLOW_EMULATED),
    # Seventy-third session, 5 minutes, seed 1337: the plan's pick (the defaults) beside two shapes; on tiny
    # Shakespeare two more runs at seed 1 (seventy-fourth session), the plan's pick that time and the variant, both
    # d256 × 4.
    Sweep("WikiText-2 valid+test (2.1 MB, vocab 1408)", "5min, the recipe of 2026-12", WIKITEXT_1408, (
        Run("d256x3", 2_214_016, 3_760_128, 1.6305), Run("d192x3", 1_328_832, 6_074_368, 1.6235),
        Run("d256x4", 2_951_936, 3_022_848, 1.6424))),
    Sweep("tiny Shakespeare (1.0 MB, vocab 960)", "5min, the recipe of 2026-12", TS_960, (
        Run("d256x5", 3_689_856, 2_568_192, 2.0430), Run("d256x4", 2_951_936, 3_018_752, 2.0311),
        Run("d192x4", 1_771_712, 5_140_480, 2.0400), Run("d256x4", 2_951_936, 3_452_928, 2.0350),
        Run("d256x4", 2_951_936, 3_072_000, 2.0355))),
    Sweep("Pride and Prejudice, ntoll's copy (0.62 MB, vocab 768)", "5min, the recipe of 2026-12", PRIDE_768, (
        Run("d320x4", 5_082_432, 2_058_240, 1.5230), Run("d256x4", 2_951_936, 2_019_328, 1.5459),
        Run("d256x3", 2_214_016, 2_019_328, 1.5526))),
    # Seventy-fourth session, 10 minutes, seed 1337: the plan's pick (d320 × 4, at R* 5 and at 6) beside d256 × 4.
    # On tiny Shakespeare the smaller one's validation plateaued at step 400 (17.9 epochs planned), which ended its
    # run at 470 s.
    Sweep("tiny Shakespeare (1.0 MB, vocab 960)", "10min, the recipe of 2026-12", TS_960, (
        Run("d320x4", 5_082_432, 4_472_832, 2.0287), Run("d256x4", 2_951_936, 4_038_656, 2.0459))),
    Sweep("WikiText-2 valid+test (2.1 MB, vocab 1408)", "10min, the recipe of 2026-12", WIKITEXT_1408, (
        Run("d320x4", 5_082_432, 4_149_248, 1.6173), Run("d256x4", 2_951_936, 6_250_496, 1.6066))),
)


def total_regret(repeat_decay: float, sweeps: tuple[Sweep, ...] = SWEEPS,
                 params_per_token: float = sizing.MEASURED_PARAMS_PER_TOKEN) -> float:
    return sum(s.regret(repeat_decay, params_per_token) for s in sweeps)


# Decays tried: Muennighoff's 15.4 and a grid below it, coarse enough that a fit moves only on real evidence.
GRID = (1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 12.0, 15.4)


def run_spread(sweeps: tuple[Sweep, ...] = SWEEPS) -> float:
    """The standard deviation of one run's bits per byte, pooled over every shape run more than once in a sweep:
    the same configuration trains more or fewer steps in its seconds as the machine's load moves. 0 where no shape
    was run twice: no spread was measured."""
    return _pooled_sd([[r.bpb for r in s.runs if r.shape == m.shape] for s in sweeps for m in s.shapes() if m.runs > 1])


@dataclass(frozen=True)
class DecayCell:
    """One configuration trained with sizing.WEIGHT_DECAY and with sizing.REPEATED_WEIGHT_DECAY, nothing else
    changed: at equal steps (`--budget Nsteps`: such runs repeat to the last digit, and decay costs nothing per
    step, so equal steps are equal seconds) unless `how` says otherwise. `epochs`: tokens trained / the corpus's."""
    corpus: str
    shape: str
    epochs: float
    base_runs: tuple[float, ...]  # held-out bits per byte with the base decay, one per seed
    repeated_runs: tuple[float, ...]  # with the repeated-text decay, the same seeds
    how: str = "equal steps"

    @property
    def base(self) -> float:
        return statistics.fmean(self.base_runs)

    @property
    def repeated(self) -> float:
        return statistics.fmean(self.repeated_runs)

    def regret(self, threshold: float) -> float:
        """How much worse the decay sizing.weight_decay_for picks at `threshold` measured than the better one."""
        repeated = sizing.weight_decay_for(self.epochs, threshold) == sizing.REPEATED_WEIGHT_DECAY
        picked = self.repeated if repeated else self.base
        return picked - min(self.base, self.repeated)


# The shapes the sizing picked at 2 and 5 minutes, batch as planned there (benchmarks/README.md, "Weight decay by the
# epochs planned"), each configuration at seeds 1337 and 1, judged by their means (2026-11-27, nineteenth session,
# Zen 5, bf16, after each epoch's windows were cut from another offset: with the fixed windows the strong decay had
# measured 0.009–0.025 better at 4.2, 5.3 and 6.9 epochs, a tie at 4.6; now it loses by 0.012–0.026 at 3.7–4.6
# epochs, ties at 5.3 and wins by 0.004 at 6.9: a repeat cut at other tokens overfits less). Two cells are the
# eleventh session's, one seed with the fixed windows (Zen 4), not run again: WikiText-2 at 2.5 epochs and 10
# minutes of tiny Shakespeare, the two farthest from the threshold.
WEIGHT_DECAY_CELLS: tuple[DecayCell, ...] = (
    DecayCell("WikiText-2", "d192x3, seq 128, batch 16, 1000 steps (fixed windows)", 2.47, (1.7576,), (1.7759,)),
    DecayCell("WikiText-2", "d192x2, seq 128, batch 32, 693 steps", 3.42, (1.7473, 1.7436), (1.7544, 1.7489)),
    DecayCell("Pride, ntoll's copy", "d192x2, seq 128, batch 8, 1063 steps", 3.66, (1.6917, 1.6944), (1.7172, 1.7203)),
    DecayCell("tiny Shakespeare", "d192x3, seq 128, batch 16, 1000 steps", 4.19, (2.1619, 2.1496), (2.1736, 2.1744)),
    DecayCell("Pride, ntoll's copy", "d256x3, seq 256, batch 8, 672 steps", 4.63, (1.6270, 1.6277), (1.6424, 1.6357)),
    DecayCell("tiny Shakespeare", "d256x4, seq 256, batch 16, 627 steps", 5.25, (2.1271, 2.1400), (2.1300, 2.1369)),
    DecayCell("Pride, ntoll's copy", "d192x3, seq 128, batch 16, 1000 steps", 6.90, (1.6162, 1.6186), (1.6140, 1.6120)),
    DecayCell("tiny Shakespeare", "d320x4, seq 256, batch 16, 10 minutes (fixed windows)", 6.81, (2.2060,), (2.1140,),
              how="equal seconds: 813 and 839 steps"),
)


@dataclass(frozen=True)
class Seeds:
    """One configuration at equal steps once per train.seed (`budget_quality.py --budget Nsteps --seeds ...`): such
    runs repeat to the last digit, so they differ by the seed alone (the initialisation and the batches' order)."""
    corpus: str
    how: str
    bpb: tuple[float, ...]


# Every configuration run at more than one seed (2026-11-27, Zen 5, bf16; benchmarks/README.md). The sweeps' runs
# are all seed 1337, so their spread (run_spread) holds the machine's share of the noise and not the seed's.
SEED_RUNS: tuple[Seeds, ...] = (
    Seeds("tiny Shakespeare", "d192x4, seq 128, batch 16, 1000 steps", (2.1837, 2.1853, 2.1814, 2.1513)),
    Seeds("tiny Shakespeare", "the same, Adam's beta2 0.99", (2.1622, 2.1884, 2.1780, 2.1703)),
    Seeds("tiny Shakespeare", "the same, windows shifted each epoch", (2.1642, 2.1785, 2.1770, 2.1455)),
    Seeds("Pride, ntoll's copy", "d256x4, seq 256, batch 8, 1000 steps", (1.6045, 1.6003)),
    Seeds("Pride, ntoll's copy", "the same, Adam's beta2 0.99", (1.5950, 1.5982)),
    Seeds("Pride, ntoll's copy", "the same, windows shifted each epoch", (1.5825, 1.5799)),
    Seeds("WikiText-2", "d192x3, seq 128, batch 32, 1000 steps", (1.7047, 1.7070)),
    Seeds("WikiText-2", "the same, Adam's beta2 0.99", (1.6998, 1.7062)),
    Seeds("WikiText-2", "the same, windows shifted each epoch", (1.6972, 1.7009)),
) + tuple(Seeds(c.corpus, f"{c.shape}, weight decay {decay:g}", runs)  # and the weight-decay cells
       for c in WEIGHT_DECAY_CELLS
       for decay, runs in ((sizing.WEIGHT_DECAY, c.base_runs), (sizing.REPEATED_WEIGHT_DECAY, c.repeated_runs))
       if len(runs) > 1)


def seed_spread(groups: tuple[Seeds, ...] = SEED_RUNS) -> float:
    """The standard deviation of one run's bits per byte between seeds, pooled over SEED_RUNS."""
    return _pooled_sd([g.bpb for g in groups])


def noise(sweeps: tuple[Sweep, ...] = SWEEPS, seeds: tuple[Seeds, ...] = SEED_RUNS) -> float:
    """One run's noise: the machine's share (run_spread) and the seed's (seed_spread), independent, so added in
    quadrature. The fits below count a smaller difference in total regret as a tie."""
    return math.hypot(run_spread(sweeps), seed_spread(seeds))


def _pooled_sd(groups: list) -> float:
    groups = [g for g in groups if len(g) > 1]
    if not groups:
        return 0.0
    return math.sqrt(sum(statistics.variance(g) * (len(g) - 1) for g in groups) / sum(len(g) - 1 for g in groups))


def fit_repeat_decay(sweeps: tuple[Sweep, ...] = SWEEPS) -> float:
    """The decay of GRID with the least total regret; among equals, the smallest (the strongest discount). Equal
    means within one run's noise (noise(): the machine's spread and the seed's): a smaller difference is noise, and
    a fit that followed it would flip with each run added (R* 5 beat 4 by 0.007 bits/byte over 18 sweeps, where one
    run's spread at one seed is 0.010). Over 21 sweeps R* 6 beat 4 by 0.014 and 5 by 0.008, where one run's noise
    was 0.013: so R* 5. Over 30 (nine under the recipe of December 2026) R* 6 beats 5 by 0.025 and 4 by 0.037,
    noise 0.012: so R* 6. The rule in use does not see the tokens a shape will get but predicts them from the probe's
    step cost, a few % off either way; the strongest discount that fits keeps the larger shape's measured win clear
    of that error."""
    regrets = {d: total_regret(d, sweeps) for d in GRID}
    tie = min(regrets.values()) + noise(sweeps)
    return min(d for d, regret in regrets.items() if regret <= tie)


def params_per_token_edge(sweeps: tuple[Sweep, ...] = SWEEPS) -> float:
    """The most non-embedding parameters per unique training token at which a shape measured best in a sweep of
    several shapes (2 figures): how far the runs show a larger model paying. sizing credits no more."""
    return sizing.round_figures(max(s.best().non_embedding_params / s.corpus_tokens
                                    for s in sweeps if len(s.shapes()) > 1))


# R*_D with dropout tried: from R*'s own range to repeats as good as new text.
DROPOUT_GRID = (4.0, 5.0, 6.0, 8.0, 10.0, 12.0, 15.4, 20.0, 30.0, 50.0, 100.0)


def total_dropout_regret(repeat_decay: float, dropout_decay: float, min_params_per_token: float,
                         sweeps: tuple[Sweep, ...] = SWEEPS) -> float:
    return sum(s.dropout_regret(repeat_decay, dropout_decay, min_params_per_token) for s in sweeps)


def dropout_threshold(repeat_decay: float, dropout_decay: float, sweeps: tuple[Sweep, ...] = SWEEPS) -> float:
    """Non-embedding parameters per unique token from which dropout may be kept: the geometric middle (2 figures) of
    the gap between the most per token at which the law alone (no threshold) kept dropout that measured worse and
    the fewest at which dropout measured better, so neither side's nearest run sets it; 0 where the law alone never
    keeps dropout that measured worse. Raises where the runs do not separate."""
    erred = [s.params_per_token(repeat_decay) for s in sweeps
             if s.dropout_measured_better(repeat_decay) is False
             and s.dropout_regret(repeat_decay, dropout_decay, 0.0) > 0]
    paid = [s.params_per_token(repeat_decay) for s in sweeps if s.dropout_measured_better(repeat_decay)]
    return _middle_of_gap(max(erred, default=0.0), min(paid), "the law kept dropout that")


def _at_every_seed(dropped: tuple[float, ...], undropped: tuple[float, ...], worse: bool) -> bool:
    """Whether the runs with dropout measured worse (`worse`) or better than those without it at every seed."""
    return all(d > u if worse else d < u for d, u in zip(dropped, undropped))


def _middle_of_gap(worse: float, better: float, who: str) -> float:
    """The geometric middle (2 figures) of the parameters per token between `worse`, the most at which dropout
    measured worse, and `better`, the fewest at which it measured better; raises where they do not separate."""
    if worse >= better:
        raise ValueError(f"{who} measured worse at {worse:.1f} parameters per token, and better at {better:.1f}: "
                         f"no threshold separates them")
    return sizing.round_figures(math.sqrt(worse * better))


def fit_dropout(repeat_decay: float, sweeps: tuple[Sweep, ...] = SWEEPS) -> tuple[float, float]:
    """(R*_D, threshold), fitted together at the law's R*: each R*_D of DROPOUT_GRID with its own threshold, judged
    by the total dropout regret of the two; the least wins, among equals (within one run's noise, as for R*) the
    smallest R*_D (dropout kept only as far as the runs say it pays: it slows every step). An R*_D whose runs no
    threshold separates is not a candidate."""
    candidates = []
    for decay in DROPOUT_GRID:
        try:
            threshold = dropout_threshold(repeat_decay, decay, sweeps)
        except ValueError:
            continue
        candidates.append((total_dropout_regret(repeat_decay, decay, threshold, sweeps), decay, threshold))
    tie = min(regret for regret, _, _ in candidates) + noise(sweeps)
    return min((decay, threshold) for regret, decay, threshold in candidates if regret <= tie)


def weight_decay_regret(threshold: float, cells: tuple[DecayCell, ...] = WEIGHT_DECAY_CELLS) -> float:
    return sum(c.regret(threshold) for c in cells)


def fit_weight_decay_epochs(cells: tuple[DecayCell, ...] = WEIGHT_DECAY_CELLS) -> float:
    """The planned epochs from which the repeated-text decay is used: of the geometric middles (2 figures) between
    neighbouring cells' epochs, the one of least total regret; among equals the lowest (more runs regularised)."""
    epochs = sorted({c.epochs for c in cells})
    middles = [sizing.round_figures(math.sqrt(a * b)) for a, b in zip(epochs, epochs[1:])]
    best = min(weight_decay_regret(m, cells) for m in middles)
    return min(m for m in middles if weight_decay_regret(m, cells) <= best + 1e-9)


@dataclass(frozen=True)
class DropoutOverDecay:
    """The law's pick at a budget where dropout paid beside the base decay (a sweep's dropped run), trained with
    the repeated-text decay with and without dropout, side by side in one process for the same seconds."""
    corpus: str
    shape: str
    undropped: float  # bits per byte: sizing.REPEATED_WEIGHT_DECAY, dropout 0
    dropped: float  # sizing.REPEATED_WEIGHT_DECAY and sizing.DROPOUT
    base_dropped: float  # sizing.WEIGHT_DECAY and sizing.DROPOUT: what the rule kept before the decay was planned
    params_per_token: float  # the shape's non-embedding parameters per unique training token
    epochs: float  # the passes over the corpus the run without dropout read


# 2026-11-26, eleventh session, the same machine, bf16, `--budget 10min --variant nodrop=model.dropout=0`.
DROPOUT_OVER_DECAY: tuple[DropoutOverDecay, ...] = (
    DropoutOverDecay("tiny Shakespeare", "d320x4, 838 steps; with dropout 601", 2.1118, 2.1262, 2.1385,
                     5_082_432 / SHAKESPEARE, 838 * 16 * 256 / SHAKESPEARE),
    DropoutOverDecay("Pride, ntoll's copy", "d320x5, 1325 steps; with dropout 497", 1.5951, 1.5993, 1.6040,
                     6_352_960 / PRIDE_NTOLL, 1325 * 8 * 256 / PRIDE_NTOLL),
)


@dataclass(frozen=True)
class DropoutAtBound:
    """The law's pick where a budget is large beside its corpus (its parameters per unique token near the bound,
    sizing.MEASURED_PARAMS_PER_TOKEN), trained with the repeated-text decay without dropout and with
    sizing.DROPOUT_AT_BOUND (`--set model.dropout=0.2`: the plan re-sized it with dropout's repeat discount), one
    pair per seed. `params_per_token`: the fewest of the pair's shapes."""
    corpus: str
    where: str
    params_per_token: float
    undropped: tuple[float, ...]  # held-out bits per byte, one per seed
    dropped: tuple[float, ...]  # the same seeds

    @property
    def better_at_every_seed(self) -> bool:
        return _at_every_seed(self.dropped, self.undropped, worse=False)

    @property
    def worse_at_every_seed(self) -> bool:
        return _at_every_seed(self.dropped, self.undropped, worse=True)


# 2026-11-28, twenty-fifth session: the slices of the sweeps above at 2 minutes (seeds 1337 and 1; with dropout the
# plan chose d256 x 4, 53 per token, at seed 1337 and d256 x 5, 66, at seed 1 on the Shakespeare slice; d320 x 4
# both times on WikiText-2), and one seed on an H200, tiny Shakespeare whole at 2 minutes (d576 x 8 both). The
# Pride slice came after the rule was set, to check it on a third corpus: the rule's own runs (dropout 0.2, d256 x
# 5) against `--variant nodrop=model.dropout=0` (d256 x 4, 57 per token, at seed 1337; d256 x 5 at seed 1). The
# first 500 KB of tiny Shakespeare at 10 minutes came later (2026-12-05, sixty-fifth session, ZEN4, seeds 1337, 1
# and 2): the rule kept 0.2 (the plan without it weighed d384 x 6, 51 per token, or d384 x 5, 43) and chose d320 x 5
# each time; the plan without dropout chose d320 x 6 (40 per token) and d384 x 5 (43) twice, and at every seed
# stopped gaining by step 300 of about 770, so train.decay_patience decayed it from there and it ended at step 368.
DROPOUT_AT_BOUND: tuple[DropoutAtBound, ...] = (
    DropoutAtBound("tiny Shakespeare, first 100 KB", ZEN5, 2_951_936 / 55_697, (2.2923, 2.2809), (2.1876, 2.1689)),
    DropoutAtBound("WikiText-2 valid+test, first 150 KB", ZEN5, 5_082_432 / 79_201, (2.4310, 2.4047),
                   (2.3666, 2.3639)),
    DropoutAtBound("tiny Shakespeare", "one NVIDIA H200, bf16", 31_861_312 / SHAKESPEARE, (2.1887,), (2.1704,)),
    DropoutAtBound("Pride and Prejudice, ntoll's copy, first 100 KB", ZEN5, 2_951_936 / 51_439, (2.1475, 2.1827),
                   (1.9853, 2.0215)),
    DropoutAtBound("tiny Shakespeare, first 500 KB, 10 minutes", ZEN4, 6_352_960 / 189_585, (2.3351, 2.2815, 2.3012),
                   (2.2655, 2.2738, 2.2913)),
)


@dataclass(frozen=True)
class DropoutForEpochs:
    """A run that reads its corpus many times by a model below sizing.DROPOUT_AT_BOUND_PARAMS_PER_TOKEN, trained with
    the repeated-text decay without dropout and with sizing.DROPOUT_AT_BOUND, side by side on one machine, one pair
    per seed."""
    corpus: str
    shapes: str  # without dropout; with it
    epochs: float  # the passes over the corpus the run without dropout read (or its sizing planned)
    non_embedding_params: int  # that run's (or sizing's) model
    corpus_tokens: int  # unique training tokens
    undropped_runs: tuple[float, ...]  # held-out bits per byte, one per seed
    dropped_runs: tuple[float, ...]  # the same seeds

    @property
    def params_per_token(self) -> float:
        return self.non_embedding_params / self.corpus_tokens

    @property
    def worse_at_every_seed(self) -> bool:
        return _at_every_seed(self.dropped_runs, self.undropped_runs, worse=True)


# Runs of many epochs below the bound where 0.2 measured worse than no dropout at every seed, all beside the
# repeated-text decay. Until the sixty-seventh session sizing kept 0.2 for a run planned to read its corpus 10 times
# or more (by a model of 5.2 or more per token, over 5.5M or more planned tokens), on the strength of one run: 10
# minutes of WikiText-2 valid+test on ZEN5 (2026-11-28, twenty-ninth session; vocabulary 1408, 685,101 training
# tokens; d320x4, 10.8 epochs: 1.6685 without, 1.6557 with 0.2), measured before the weight average
# (train.ema_horizon) and the output's temperature (train.calibrate). Under them every such pair lost, that corpus's
# included (its last row), so the rule went.
DROPOUT_FOR_EPOCHS: tuple[DropoutForEpochs, ...] = (
    # The shape the sizing picks for 2 minutes of tiny Shakespeare under a vocabulary of 448 (489,223 training
    # tokens), at equal steps with weight decay 1.0 and short contexts first, seeds 1337 and 1 (2026-11-29,
    # thirty-second session, ZEN5). Equal steps favour dropout (a step with it took 1.5x as long here).
    DropoutForEpochs("tiny Shakespeare", "d192x4 batch 32, 1450 steps, both", 1450 * 32 * 128 / 489_223,
                     1_771_712, 489_223, (2.1190, 2.1326), (2.1336, 2.1475)),
    # The 2- and 5-minute plans of two small corpora on ZEN4 (2026-12-04, sixty-third and sixty-fourth sessions),
    # and 10 minutes of tiny Shakespeare (2026-12-05, sixty-sixth session), under today's recipe: the defaults, which
    # kept 0.2 then (`budget_quality.py --budget 2min|5min|10min`), against the plan without dropout at the same seed
    # (`--set model.dropout=0`). `epochs` and the size are the undropped sizing the rule weighed at the first seed
    # (the plan then sized its shape again at dropout's speed, 1.3-1.4x a step: fewer epochs).
    DropoutForEpochs("the embedded Python reference, seeds 1337 and 1",
                     "d256x3 seq 256 batch 4, 1516 steps / batch 8, 799; d192x4 batch 8, 1017 / d256x3 seq 256 "
                     "batch 8, 399 (weighed: d256x3 batch 8 at 11.8 / 12.1 epochs)", 1_564_672 / 133_105, 2_214_016,
                     133_105, (1.5463, 1.5420), (1.6342, 1.6843)),
    DropoutForEpochs("tiny Shakespeare, first 500 KB, seed 1337", "d256x3 seq 256 batch 8, 726 steps; d192x3 batch 8, "
                     "1253 (weighed: d192x4 batch 16 at 10.1 epochs)", 1_923_072 / 189_585, 1_771_712, 189_585,
                     (2.3301,), (2.4302,)),
    DropoutForEpochs("tiny Shakespeare, first 500 KB, 5 minutes, seeds 1337 and 1", "d320x4 seq 256 batch 8, 1034 / "
                     "1113 steps; d320x4 seq 256 batch 8, 678 / 714 (weighed: d320x4 batch 8 at 12.2 / 11.1 epochs)",
                     2_310_144 / 189_585, 5_082_432, 189_585, (2.3252, 2.2972), (2.3341, 2.3346)),
    # 10 minutes of the whole of tiny Shakespeare (vocabulary 960, 372,624 training tokens): without dropout the
    # weight average and the output's temperature (1.21) took the memorising run's validation loss below the
    # dropped run's.
    DropoutForEpochs("tiny Shakespeare, 10 minutes, seeds 1337 and 1", "d320x4 batch 16, 1118 / 1109 steps; "
                     "d320x4 batch 16, 717 / 720 (weighed: d320x4 batch 16 at 11.0 / 12.7 epochs)",
                     4_108_288 / 372_624, 5_082_432, 372_624, (2.0291, 2.0276), (2.0540, 2.0448)),
    # The paid run's corpus and vocabulary, and its shape at seed 1337, 16 minutes on ZEN4 (2026-12-05, sixty-seventh
    # session; 16 minutes there bought 90% of the tokens ZEN5's 10 did): the defaults (no dropout: 9.7 and 8.5
    # planned epochs) against `--set model.dropout=0.2` at the same seed, `budget_quality.py --corpus wt2.txt
    # --budget 16min`.
    # (A first run of the defaults at seed 1 met a slow spell of the host, 453 steps where the plan had measured
    # for 558 and the others took 705-819, and scored 1.6651: run again.)
    DropoutForEpochs("WikiText-2 valid+test, 16 minutes, seeds 1337 and 1", "d320x4 batch 32, 819 steps / d320x5 "
                     "batch 32, 705; d320x4 batch 16, 987 / 998", 6_709_248 / 685_101, 5_082_432, 685_101,
                     (1.6062, 1.6031), (1.6329, 1.6325)),
)


def dropout_at_bound_threshold(paid: tuple[DropoutAtBound, ...] = DROPOUT_AT_BOUND,
                               erred: tuple[DropoutOverDecay, ...] = DROPOUT_OVER_DECAY,
                               erred_for_epochs: tuple[DropoutForEpochs, ...] = DROPOUT_FOR_EPOCHS) -> float:
    """Parameters per unique token from which dropout is kept beside the repeated-text decay, whatever the epochs:
    the geometric middle (2 figures) of the gap between the most at which dropout beside it measured worse (0.1,
    `erred`; or sizing.DROPOUT_AT_BOUND at every seed, in `erred_for_epochs` or in a pair of `paid`) and the fewest
    at which it measured better at every seed. Raises where the runs do not separate."""
    worse = ([c.params_per_token for c in erred if c.dropped > c.undropped]
             + [c.params_per_token for c in erred_for_epochs + paid if c.worse_at_every_seed])
    return _middle_of_gap(max(worse), min(c.params_per_token for c in paid if c.better_at_every_seed),
                          "dropout beside the repeated-text decay")
