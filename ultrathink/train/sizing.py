"""`model.size: auto`: the model shape a compute budget and a corpus call for.

The rule, in three steps:
1. **Candidates.** Every depth L from 1 to 32 with width d = 64·L, or 64 narrower or wider (loss is nearly flat
   over a wide band of aspect ratios, Kaplan et al. 2020; 64 per layer is nanochat's), heads of 64 dimensions, key/value heads half the heads
   (grouped-query attention) when the heads are even, context the largest power of two ≤ d (so attention scores
   cost at most about a sixth of the weight FLOPs), clamped to [64, 2048]. Shape keys set in params.yaml win: only
   candidates that agree with them are considered.
2. **Tokens each candidate can see**: the budget's FLOPs divided by the candidate's training FLOPs per token (the
   model's own count, `UltraThink.flops_per_token`). A time budget divides its seconds by each candidate's seconds
   per token (StepCost): its FLOPs at the device's matmul peak, plus a memory-bound share that grows with
   layers × width, fitted to the step time measured on this machine (budget.py's probe). At a CPU's small widths
   that share is most of a step, so one FLOP rate for every shape misjudged them: d128 × 1 layer ran 1.7× the FLOPs
   of d64 × 2 layers in the same 10 s and was the better model on three corpora (benchmarks/README.md). The model
   picks which shapes are probed; between probed shapes their measured speeds decide (best_measured).
3. **Predicted loss**, and the lowest wins (within TIE of it, the cheapest shape): Chinchilla's fit L(N, D) = E + A/N^α + B/D^β (Hoffmann et al. 2022,
   approach 3; N = non-embedding parameters), with D the *effective* tokens when the corpus repeats — each further
   epoch is worth less, with Muennighoff et al. 2023's form of the decay and its constant fitted to this regime
   (REPEAT_DECAY, from the measured runs in sizing_evidence.py). So a small corpus and a large budget give a larger
   model trained for fewer epochs, rather than 100 passes over the same text — as far as the runs go: N counts at
   most MEASURED_PARAMS_PER_TOKEN per unique training token (useful_params), the most at which a larger model was
   measured to pay. A budget far beyond its corpus then trains that model for more steps.

Dropout (model.dropout null) is DROPOUT or 0, whichever the same law predicts better for the chosen shape
(dropout_pays). Dropout slows a step (on a CPU it also takes attention off its flash kernel), so it leaves fewer
tokens; what it buys is repeated tokens that keep more of their worth: with it their repeats are discounted at
DROPOUT_REPEAT_DECAY, without it at REPEAT_DECAY. A time budget's plan measures the slowdown at the chosen shape
and, dropout kept, sizes the shape again at that speed (plan.py); a FLOPs or tokens budget is not shortened by it.
The law has no term for how much a model overfits, so dropout is also kept only for models with many parameters per
unique token (DROPOUT_MIN_PARAMS_PER_TOKEN). Both constants are fitted to runs side by side (sizing_evidence.py):
the 2-minute models (1–6 parameters per token) measured 0.04–0.08 bits/byte worse with it at 3.5–7 epochs, 5 minutes
on Pride (17 per token, 5.7 epochs, as the law predicts) 0.04 worse, the 10-minute ones (10 and 21 per token, 7–9
epochs) 0.07–0.11 better, where without it 10 minutes measured worse than 2. Dropout is weighed only beside a weight
decay below REPEATED_WEIGHT_DECAY: the plan gives a run of many epochs that decay (train.weight_decay null,
weight_decay_for), and at 10 minutes on two corpora the decay alone then measured better than with dropout added
(sizing_evidence.DROPOUT_OVER_DECAY). Beside that decay only a model of many parameters per unique token
(DROPOUT_AT_BOUND_PARAMS_PER_TOKEN, about half the bound and more: where a budget is large beside its corpus) keeps
dropout, and more of it (DROPOUT_AT_BOUND): there dropout 0.2 measured 0.01-0.11 bits/byte better. Reading the
corpus many times is not enough: below that bound 0.2 measured worse at every seed however many epochs a run read
(sizing_evidence.DROPOUT_FOR_EPOCHS).

The batch is the one that gives about TARGET_STEPS optimizer steps (a power of two of sequences, at least
MIN_BATCH): small budgets need many small steps more than large batches. A budget that buys more tokens than its
model can use (saturated) has seconds to spare: on a GPU, whose step at these sizes takes about as long at half the
batch, the plan then halves the batch for twice the steps (spare_batch, SATURATED_STEPS). The learning rate is
train.lr's.

The absolute losses of the fit mean nothing for our tokenizer; only where its minimum lies is used. A FLOPs budget
needs no measurement; a tokens budget fixes D, so N comes from Chinchilla's 20 tokens per parameter instead.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, field, replace

import torch
from ultrathink.config import ModelConfig
from ultrathink.device import device_type
from ultrathink.model import UltraThink

CHINCHILLA = {"E": 1.69, "A": 406.4, "B": 410.7, "alpha": 0.34, "beta": 0.28}
# R*_D of Muennighoff et al. 2023: the repetitions after which added epochs are worth 1/e as much. They fitted 15.4 at
# billions of parameters; fitted here to shapes trained side by side on small corpora (sizing_evidence.SWEEPS, each
# shape by its repeats' means): at 5–12 epochs 15.4 kept choosing the smaller model, which measured 0.06–0.12
# bits/byte worse. Over the 21 sweeps of November 2026 R* 4, 5 and 6 were within one run's noise of each other
# (total regret 0.176, 0.169, 0.162), and the fit took the strongest discount among them, 5. Nine sweeps under the
# recipe of December 2026 (the weight average, β₁ 0.8, the output's temperature, the budget's vocabulary; 2, 5 and
# 10 minutes, the slow class emulated) moved it to 6: over all 30, R* 6 0.224 against 5's 0.248 and 4's 0.260,
# noise 0.012. Through the real planning step R* 6 picked the best shape measured on the slow class's tiny
# Shakespeare cell in 1 of 2 plans (R* 5: 0 of 3) and at 5 minutes in 2 of 2 (R* 5: 1 of 4), d192 × 3 on tiny
# Shakespeare at 2 minutes in 12 of 12 (R* 5: 12 of 18), and d192 × 4 on Pride in 5 of 12 (0.006 worse than d256 × 3).
REPEAT_DECAY = 6.0
# Non-embedding parameters beyond this many per unique training token are credited with nothing (useful_params): the
# most per token at which a shape measured best in its sweep (sizing_evidence.params_per_token_edge). Chinchilla's
# A/N^α rewards size without end, and past the measured runs that is extrapolation: 2 minutes on an H200 chose 434M
# parameters for tiny Shakespeare (886 per token), which scored no better than 14.8M trained for 12 seconds. The
# bound changes one pick on the sweeps, between two shapes that measured alike (tiny Shakespeare's first 100 KB:
# d256 × 3 for d320 × 4, 0.0002 apart); it stops the law where its evidence stops.
MEASURED_PARAMS_PER_TOKEN = 64.0
TOKENS_PER_PARAM = 20  # Chinchilla's compute-optimal ratio, used when the budget is in tokens
# The optimizer steps a plan's batch is sized for (batch_for).
TARGET_STEPS = 1000
# ... and by device type, for a plan whose budget buys more tokens than its model can use (saturated: the rest of
# the budget is spare; spare_batch). A CPU: more steps at the same tokens measured no better (benchmarks/README.md,
# twenty-sixth session): 2000 at 2 minutes scored 0.010 worse on tiny Shakespeare and 0.084 worse on Pride, where
# validation plateaued at step 1000 and the runs ended after 52-71 s; on the 100-150 KB slices (the model at the
# bound) half the batch 0.029 worse on both, four times it 0.019-0.049 worse. A GPU: a small model's step takes
# about as long at half the batch (an H200, d576 x 8: 63 against 62 ms), so there twice the steps cost tokens, not
# seconds, and the saturated runs at 2 minutes had plateaued with half their budget unspent. Half the batch (2000
# steps) measured better on an H200 at 2 minutes by 0.074 and 0.057 bits/byte on tiny Shakespeare (seeds 1337, 1)
# and 0.055 on Pride (twenty-sixth and twenty-seventh sessions). A plan the seconds bind (12 s on a GPU) would lose
# half its tokens: unmeasured, so it keeps its batch. Any other device type goes by the CPU's.
SATURATED_STEPS = {"cpu": 1000, "cuda": 2000}
# model.dropout null under size auto: the level tried (0.2 was never clearly better than 0.1 where dropout paid,
# benchmarks/README.md), and R*_D with it — fitted to runs with and without it, together with the threshold below
# (sizing_evidence.fit_dropout): at R* 6, 30 (15.4 at R* 5).
DROPOUT = 0.1
DROPOUT_REPEAT_DECAY = 30.0
# ... and only for a model of at least this many non-embedding parameters per unique training token: below it the
# models measured did not overfit enough for dropout to pay even where the law said it would (0.9M parameters on
# 0.3M tokens, 7 epochs, dropout 1.26× slower: 0.04 bits/byte worse; sizing_evidence.dropout_threshold). At R* 6
# the law picks d256 × 3 in the 5-minute tiny Shakespeare sweep of November 2026 (4.5 per token), where dropout
# measured better.
DROPOUT_MIN_PARAMS_PER_TOKEN = 3.7
# Beside the repeated-text decay, a model of at least this many non-embedding parameters per unique training token
# (the law's pick when a budget is large beside its corpus: a GPU's minutes, a small corpus on a CPU) trains with
# DROPOUT_AT_BOUND, and no smaller one with any: at 53-66 per token 0.2 measured 0.04-0.11 bits/byte better than
# none on three slices at two seeds, and on an H200 0.018 better (0.1 there 0.019 worse, one seed); at 10 minutes on
# a CPU a plan that kept it (d320 x 5, 34 per token) 0.008-0.070 better than the plan without it at three seeds.
# Beside the same decay 0.1 measured worse at 10 and 21 per token, and 0.2 at every seed at up to 27, in runs that
# read their corpus 8-13 times (sizing_evidence.DROPOUT_AT_BOUND, .DROPOUT_OVER_DECAY, .DROPOUT_FOR_EPOCHS). The
# threshold is the geometric middle of that gap (sizing_evidence.dropout_at_bound_threshold). Many epochs alone
# keep none: a rule that kept 0.2 from 10 planned epochs (by a model of 5.2 per token and 5.5M planned tokens)
# rested on one run, 10 minutes of WikiText-2 measured before the weight average and the output's temperature;
# under them the same corpus, at its shape and about its epochs, measured 0.027-0.029 worse with it at two seeds
# (sizing_evidence.DROPOUT_FOR_EPOCHS).
DROPOUT_AT_BOUND = 0.2
DROPOUT_AT_BOUND_PARAMS_PER_TOKEN = 30.0
# Predicted losses this close (relative) are a tie: the fit cannot tell them apart, and a measured throughput that
# moves with the machine's load would otherwise pick either. A tie goes to the cheaper shape (fewer FLOPs per
# token, then fewer parameters): more steps in the same budget.
TIE = 0.005
# A time budget's step-cost model, fitted to one probed shape, has mispredicted another's tokens by up to a fifth
# (Pride: 1.35M predicted, 1.08M trained; on a Zen 5, d256 × 4 about 15% short). A fifth of the tokens moves the
# law's prediction by about 2%, so a runner-up predicted within this of the choice is probed too and the two are
# compared at their measured speeds (best_measured).
MEASURE_MARGIN = 0.02
# A probe's step time is one moment of the machine's, and a shared CPU's speed wanders: on 2 busy cores of an AMD
# EPYC Zen 3, medians of five steps of one shape read 71-110 ms over 40 s (90 in the middle), so two shapes probed one
# after the other can be measured as fast as each other when one is 1.46× the other's step. A measured shape that
# would be predicted better than the choice were its speed this much faster and the choice's this much slower is
# measured again side by side with it (plan.py; could_overtake).
PROBE_SPREAD = 0.2
# train.weight_decay null: AdamW's decoupled decay on the hidden matrices, by the epochs a run is planned to see. A
# regulariser that costs nothing per step, so unlike dropout it needs no speed measured: WEIGHT_DECAY below
# REPEATED_DECAY_EPOCHS passes over the corpus, REPEATED_WEIGHT_DECAY from there. Fitted to runs at equal steps
# (sizing_evidence.WEIGHT_DECAY_CELLS, six at two seeds): 1.0 lost 0.006–0.026 bits/byte at 2.5–4.6 epochs, tied at
# 5.3, won 0.004 at 6.9 and 0.092 at 6.8 (10 minutes, a model of 10 parameters per unique token).
WEIGHT_DECAY = 0.1
REPEATED_WEIGHT_DECAY = 1.0
REPEATED_DECAY_EPOCHS = 4.9
# train.seq_len_warmup null: short contexts first (loader.ContextWarmup) over SEQ_LEN_WARMUP of the steps of a run
# planned to see its corpus SHORT_CONTEXTS_EPOCHS times or more, else whole windows from the start. Measured
# (benchmarks/README.md, "Short contexts first"), two seeds each: at equal steps 0.011 and 0.005 bits/byte better at
# 8.3 and 10.6 epochs (tiny Shakespeare, Pride), 0.004 worse at 5.0 (WikiText-2) and 0.008 worse at 7.7 (the
# embedded Python reference, vocabulary 4096: the pipeline's own run); at equal wall-clock 0.016-0.026 better at 2
# minutes on tiny Shakespeare and Pride, 0.011-0.061 worse at 12 s (1.3-2.8 epochs) and 0.014 worse on WikiText-2
# at 2 minutes (4.6-5.2). The threshold is placed between the loss at 7.7 and the gain at 8.3 epochs: a fit to
# four corpora, with nothing measured in that gap.
SEQ_LEN_WARMUP = 0.3
SHORT_CONTEXTS_EPOCHS = 8.0
MIN_BATCH = 4
HEAD_DIM = 64
MAX_LAYERS = 32
SHAPE_KEYS = ("d_model", "n_layers", "n_heads", "n_kv_heads", "seq_len")


@dataclass(frozen=True)
class Shape:
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    seq_len: int

    @classmethod
    def of(cls, model_cfg) -> "Shape":
        """The shape a (fully sized) ModelConfig has."""
        return cls(**{k: getattr(model_cfg, k) for k in SHAPE_KEYS})

    def describe(self) -> str:
        """E.g. `d_model 192, 3 layers, 3 heads (3 kv), seq_len 128`."""
        return (f"d_model {self.d_model}, {self.n_layers} layers, {self.n_heads} heads ({self.n_kv_heads} kv), "
                f"seq_len {self.seq_len}")


def round_figures(value: float, figures: int = 2) -> float:
    """A measured rate to 2 significant figures: sizing then sees the same number from timings a few % apart."""
    return float(f"{value:.{figures - 1}e}")


@dataclass(frozen=True)
class StepCost:
    """A training token's seconds at a shape: its FLOPs at the device's matmul `peak` (FLOP/s), plus
    `per_layer_width` seconds for every layer × d_model — the memory-bound work (norms, rotary, activations,
    the optimizer's passes) that does not shrink with the FLOPs."""
    peak: float
    per_layer_width: float = 0.0

    def seconds_per_token(self, shape: Shape, flops_per_token: int) -> float:
        return flops_per_token / self.peak + self.per_layer_width * shape.n_layers * shape.d_model

    @classmethod
    def fitted(cls, peak: float, shape: Shape, flops_per_token: int, seconds_per_token: float) -> "StepCost":
        """The cost that reproduces a measured `seconds_per_token` at `shape` (2 significant figures, so timings a
        few % apart give the same cost); none below the peak's share."""
        rest = max(0.0, seconds_per_token - flops_per_token / peak) / (shape.n_layers * shape.d_model)
        return cls(peak, round_figures(rest))


@dataclass
class Sizing:
    """The chosen shape and batch, with the figures behind the choice (logged and kept in the run's plan)."""
    shape: Shape
    batch_size: int
    params: int  # all parameters (the tied embedding once)
    non_embedding_params: int
    flops_per_token: int
    tokens: float  # what the budget buys at this shape, at most its saturating_tokens (a tokens budget: all of it)
    epochs: float  # tokens / the corpus's training tokens
    predicted_loss: float
    runner_up: dict
    dropout: float | None = None  # model.dropout's, or with_dropout's choice (None: a plan recorded before either)
    # A time budget's probed shapes, as best_measured compared them (probed_record: shape, batch, the tokens their
    # measured speed buys, the loss the law predicts for those, why it was probed). Empty: no time budget, or a
    # plan recorded before they were kept.
    measured: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return {**asdict(self), "shape": asdict(self.shape)}

    @classmethod
    def from_dict(cls, raw: dict) -> "Sizing":
        return cls(**{**raw, "shape": Shape(**raw["shape"])})

    def explain(self) -> str:
        return (f"model.size auto: {self.shape.describe()}, batch {self.batch_size}: {self.params / 1e6:.2f}M params, "
                f"{self.tokens / 1e6:.2f}M tokens ({self.epochs:.1f} epochs of the corpus) — the lowest loss "
                f"Chinchilla's fit predicts for this budget with repeated data discounted (R* {REPEAT_DECAY:g}) "
                f"and at most {MEASURED_PARAMS_PER_TOKEN:g} parameters per token credited "
                f"(next best: {self.runner_up.get('shape')})"
                + ("" if self.dropout is None else f"; dropout {self.dropout:g}")
                + (f"; measured: {describe_measured(self.measured)}" if self.measured else ""))


def describe_measured(measured: list[dict]) -> str:
    """A time budget's probed shapes as best_measured compared them (Sizing.measured), e.g. `192x3 batch 16
    (first guess): 2.10M tokens, predicted loss 3.1234`."""
    return ", ".join(f"{m['shape']['d_model']}x{m['shape']['n_layers']} batch {m['batch_size']} ({m['why']}): "
                     f"{m['tokens'] / 1e6:.2f}M tokens, predicted loss {m['predicted_loss']:.4f}" for m in measured)


def effective_tokens(tokens: float, unique: float, repeat_decay: float = REPEAT_DECAY) -> float:
    """Muennighoff et al.'s data-constrained scaling: the first epoch counts in full, repeats less and less."""
    if tokens <= unique:
        return tokens
    repeats = tokens / unique - 1
    return unique + unique * repeat_decay * (1 - math.exp(-repeats / repeat_decay))


def useful_params(non_embedding_params: int, unique: float,
                  params_per_token: float = MEASURED_PARAMS_PER_TOKEN) -> float:
    """The parameters the law credits: at most `params_per_token` per unique training token."""
    return min(non_embedding_params, params_per_token * unique)


def predicted_loss(non_embedding_params: int, tokens: float, unique: float, repeat_decay: float = REPEAT_DECAY,
                   params_per_token: float = MEASURED_PARAMS_PER_TOKEN) -> float:
    c = CHINCHILLA
    return (c["E"] + c["A"] / useful_params(non_embedding_params, unique, params_per_token) ** c["alpha"]
            + c["B"] / effective_tokens(tokens, unique, repeat_decay) ** c["beta"])


def saturating_tokens(non_embedding_params: int, unique: float, repeat_decay: float = REPEAT_DECAY) -> float:
    """The tokens past which the law predicts a model of `non_embedding_params` on `unique` training tokens less
    than TIE better than it would ever be: repeats are worth ever less (effective_tokens tends to unique × (1 + R*)),
    so a budget's tokens beyond these buy nothing the law can tell apart. About 22 epochs at R* 6, 105–108 at dropout's."""
    floor = predicted_loss(non_embedding_params, math.inf, unique, repeat_decay)

    def enough(tokens: float) -> bool:
        return predicted_loss(non_embedding_params, tokens, unique, repeat_decay) <= floor * (1 + TIE)

    low, high = 0.0, unique * (1 + repeat_decay)
    while not enough(high):
        low, high = high, high * 2
    while high - low > 1e-3 * high:  # bisection: the loss falls as the tokens grow
        middle = (low + high) / 2
        low, high = (low, middle) if enough(middle) else (middle, high)
    return high


def repeat_decay(sized: "Sizing") -> float:
    """The repeat discount the law applies to a sized run's tokens: dropout's where it keeps dropout."""
    return DROPOUT_REPEAT_DECAY if sized.dropout else REPEAT_DECAY


def saturated(sized: "Sizing", corpus_tokens: int) -> "Sizing":
    """`sized` with its tokens at most its model's saturating_tokens (at dropout's repeat discount where it keeps
    dropout): the rest of a budget larger than the corpus can use is left unspent. Past them the law sees no gain,
    and runs lost: a time budget on an H200 planned 165 epochs of tiny Shakespeare, and the best validation was the
    first (27 epochs); of 400 epochs of Pride, likewise (benchmarks/README.md)."""
    tokens = min(sized.tokens, saturating_tokens(sized.non_embedding_params, corpus_tokens, repeat_decay(sized)))
    return replace(sized, tokens=tokens, epochs=tokens / corpus_tokens)


def candidate_shapes(fixed: dict[str, int]) -> list[Shape]:
    shapes = []
    for layers in range(1, MAX_LAYERS + 1):
        for d in (64 * layers - 64, 64 * layers, 64 * layers + 64):
            if d < 64:
                continue
            shape = shape_for(fixed.get("d_model", d), fixed.get("n_layers", layers))
            shape.update(fixed)
            if valid(shape):
                shapes.append(Shape(**shape))
    return list(dict.fromkeys(shapes))


def shape_for(d: int, layers: int) -> dict[str, int]:
    heads = max(1, d // HEAD_DIM)
    return {"d_model": d, "n_layers": layers, "n_heads": heads, "n_kv_heads": heads // 2 if heads % 2 == 0 else heads,
            "seq_len": min(2048, max(64, 2 ** int(math.log2(d))))}


def valid(shape: dict) -> bool:
    d, h, kv = shape["d_model"], shape["n_heads"], shape["n_kv_heads"]
    return d % h == 0 and h % kv == 0 and (d // h) % 2 == 0


@functools.lru_cache(maxsize=4096)
def _counts(shape: Shape, model_json: str, vocab_size: int) -> tuple[int, int, int]:
    cfg = ModelConfig.model_validate_json(model_json)
    with torch.device("meta"):
        model = UltraThink(cfg, vocab_size)
    params = model.num_params()
    return params, params - vocab_size * shape.d_model, model.flops_per_token()


def counts(shape: Shape, model_cfg, vocab_size: int) -> tuple[int, int, int]:
    """(parameters, non-embedding parameters, training FLOPs per token) of `shape`, from the model itself, built
    on the meta device: no memory and no init (the 95 candidate shapes take 5-6.5 s on an AVX2-only EPYC, once per
    vocabulary and process)."""
    cfg = model_cfg.model_copy(update={**asdict(shape), "dropout": 0.0, "size": "manual"})  # counts: no dropout
    return _counts(shape, cfg.model_dump_json(), vocab_size)


def dropout_pays(non_embedding_params: int, tokens: float, dropped_tokens: float, corpus_tokens: int,
                 dropout_decay: float = DROPOUT_REPEAT_DECAY,
                 min_params_per_token: float = DROPOUT_MIN_PARAMS_PER_TOKEN,
                 repeat_decay: float = REPEAT_DECAY) -> bool:
    """Whether dropout is predicted to pay: the model has `min_params_per_token` non-embedding parameters per unique
    training token or more, and `dropped_tokens` with dropout (repeats discounted at `dropout_decay`) are predicted
    to beat `tokens` without it by more than TIE: a tie goes to the faster step."""
    if non_embedding_params < min_params_per_token * corpus_tokens:
        return False
    without = predicted_loss(non_embedding_params, tokens, corpus_tokens, repeat_decay)
    return predicted_loss(non_embedding_params, dropped_tokens, corpus_tokens, dropout_decay) < without * (1 - TIE)


def with_dropout(sized: "Sizing", corpus_tokens: int, slowdown: float = 1.0,
                 weight_decay: float | None = None) -> "Sizing":
    """`sized` (its tokens at the step speed without dropout) with model.dropout null decided: DROPOUT where it pays
    when a step with it takes `slowdown`× as long, its tokens and epochs then those of the dropped run; else 0. A
    slowdown of 1 (dropout free) is the most it can pay: a time budget measures the real one (a step with dropout
    does more work, so a measured slowdown below 1 is noise and counts as 1). Beside a weight decay of
    REPEATED_WEIGHT_DECAY or more (`weight_decay`: train.weight_decay's; null: weight_decay_for the sized epochs)
    that decay regularises the repeated text instead: dropout on top of it measured no better where dropout had
    paid beside the base decay (sizing_evidence.DROPOUT_OVER_DECAY), so there only a model of
    DROPOUT_AT_BOUND_PARAMS_PER_TOKEN or more keeps dropout, DROPOUT_AT_BOUND, at the tokens its slowdown leaves
    (decided by those runs, not by the law: its repeat discount for dropout was fitted beside the base decay)."""
    decay = weight_decay_for(sized.epochs) if weight_decay is None else weight_decay
    dropped = sized.tokens / max(1.0, slowdown)
    if decay >= REPEATED_WEIGHT_DECAY:
        if sized.non_embedding_params < DROPOUT_AT_BOUND_PARAMS_PER_TOKEN * corpus_tokens:
            return replace(sized, dropout=0.0)
        return replace(sized, dropout=DROPOUT_AT_BOUND, tokens=dropped, epochs=dropped / corpus_tokens)
    if not dropout_pays(sized.non_embedding_params, sized.tokens, dropped, corpus_tokens):
        return replace(sized, dropout=0.0)
    return replace(sized, dropout=DROPOUT, tokens=dropped, epochs=dropped / corpus_tokens)


def weight_decay_for(epochs: float, threshold: float = REPEATED_DECAY_EPOCHS) -> float:
    """train.weight_decay null: the decay for a run planned to see its corpus `epochs` times."""
    return REPEATED_WEIGHT_DECAY if epochs >= threshold else WEIGHT_DECAY


def seq_len_warmup_for(epochs: float) -> float:
    """train.seq_len_warmup null: the share of the steps read in short contexts first, for a run planned to see its
    corpus `epochs` times."""
    return SEQ_LEN_WARMUP if epochs >= SHORT_CONTEXTS_EPOCHS else 0.0


def at_measured_speed(sized: Sizing, corpus_tokens: int, seconds: float, seconds_per_token: float,
                      dropout: float | None, weight_decay: float | None = None) -> Sizing:
    """`sized` with the tokens `seconds` buy at a measured speed (its probe's, at its batch), the loss the law
    predicts for them, and model.dropout's value, or (null) dropout decided again for those tokens; then
    saturated."""
    tokens = seconds / seconds_per_token
    timed = replace(sized, tokens=tokens, epochs=tokens / corpus_tokens, dropout=dropout,
                    predicted_loss=predicted_loss(sized.non_embedding_params, tokens, corpus_tokens))
    return saturated(timed if dropout is not None else with_dropout(timed, corpus_tokens, weight_decay=weight_decay),
                     corpus_tokens)


def best_measured(measured: list[Sizing]) -> Sizing:
    """Of shapes whose speed was measured (at_measured_speed), the one the law predicts best; within TIE of it the
    cheapest, as `choose` breaks ties. The step-cost model decides which shapes a time budget measures; it has no
    per-step term, so it overrates a shape whose small batch leaves a step's fixed work to few tokens (d256 × 3 at
    batch 4 on Pride: 1.35M tokens predicted, 1.08M trained, and 0.028 bits/byte worse than the d192 × 3 it
    displaced). Between shapes both measured, the measurement decides."""
    return _cheapest_of_the_best(measured, lambda s: s.predicted_loss, lambda s: (s.flops_per_token, s.params))


def could_overtake(other: Sizing, best: Sizing, corpus_tokens: int) -> bool:
    """Whether the law would predict `other` better than `best` (both at their measured speeds, at_measured_speed)
    had `other`'s probe read PROBE_SPREAD slow and `best`'s PROBE_SPREAD fast: then the order of two probes taken at
    different moments is within the machine's wander, and only a measurement side by side can tell them apart."""
    def loss(sized: Sizing, factor: float) -> float:
        return predicted_loss(sized.non_embedding_params, sized.tokens * factor, corpus_tokens, repeat_decay(sized))

    return loss(other, 1 + PROBE_SPREAD) < loss(best, 1 - PROBE_SPREAD)


def probed_record(sized: Sizing, why: str) -> dict:
    """One shape a time budget probed, as its plan keeps it (Sizing.measured): at its measured speed
    (at_measured_speed), and why it was probed (first guess, refitted choice, last choice, near runner-up)."""
    return {"shape": asdict(sized.shape), "batch_size": sized.batch_size, "tokens": sized.tokens,
            "predicted_loss": sized.predicted_loss, "why": why}


def near_runner_up(sized: Sizing) -> Shape | None:
    """The law's next best shape where it is predicted within MEASURE_MARGIN of `sized` at the step-cost model's
    speeds: near enough for the model's error to reverse them, so worth measuring."""
    runner = sized.runner_up
    if not runner or runner["score"] > sized.predicted_loss * (1 + MEASURE_MARGIN):
        return None
    return Shape(**runner["shape"])


def _cheapest_of_the_best(options: list, loss, cost):
    """The option of least `loss`, or within TIE of it the one of least `cost` (then least loss)."""
    best = min(loss(o) for o in options)
    return min((o for o in options if loss(o) <= best * (1 + TIE)), key=lambda o: (*cost(o), loss(o)))


def batch_for(tokens: float, seq_len: int) -> int:
    sequences = max(MIN_BATCH, tokens / TARGET_STEPS / seq_len)
    return 2 ** round(math.log2(sequences))


def spare_batch(sized: Sizing, bought_tokens: float, corpus_tokens: int, device, world_size: int = 1,
                grad_accum: int = 1) -> int | None:
    """The smaller batch a plan on `device` trains at where its budget buys more tokens (`bought_tokens`, at the
    plan's batch) than its model can use: its saturating_tokens, at the repeat discount the batch was sized at
    (batch_for's tokens; dropout's discount credits a budget's tokens further, but the runs with it at the bound
    plateaued after 10-14 epochs). There SATURATED_STEPS replace TARGET_STEPS for the same tokens. None where the
    budget binds, on a device type that keeps TARGET_STEPS, at MIN_BATCH, or where the smaller global batch (×
    `grad_accum` sequences) would not split evenly over `world_size` ranks. The plan decides it after the shape,
    at the batch the law's evidence was measured at; a time budget's tokens at the smaller batch are then measured,
    not predicted (on a GPU a step at half the batch takes about as long, which the step-cost model cannot say)."""
    steps = SATURATED_STEPS.get(device_type(device), SATURATED_STEPS["cpu"])
    if bought_tokens <= saturating_tokens(sized.non_embedding_params, corpus_tokens) or steps <= TARGET_STEPS:
        return None
    batch = max(MIN_BATCH, sized.batch_size * TARGET_STEPS // steps)
    return batch if batch < sized.batch_size and batch * grad_accum % world_size == 0 else None


def choose(model_cfg, vocab_size: int, corpus_tokens: int, *, flops: float | None = None,
           tokens: float | None = None, seconds: float | None = None, cost: StepCost | None = None,
           batch_size: int | None = None, weight_decay: float | None = None,
           below_params: int | None = None) -> Sizing:
    """The shape for a budget of `flops` (compute), `tokens`, or `seconds` at `cost`, on a corpus of
    `corpus_tokens` training tokens; a compute or time budget's tokens then `saturated`, the batch sized for those.
    Shape keys of `model_cfg` that are set (not null) are kept; `weight_decay` (train.weight_decay's) has a say in
    dropout (with_dropout); `below_params` leaves out shapes of at least that many parameters (one that ran out of
    the device's memory)."""
    fixed = {k: getattr(model_cfg, k) for k in SHAPE_KEYS if getattr(model_cfg, k) is not None}
    scored = []
    for shape in candidate_shapes(fixed):
        params, non_embedding, per_token = counts(shape, model_cfg, vocab_size)
        if below_params is not None and params >= below_params:
            continue
        if tokens is not None:  # a tokens budget: Chinchilla's ratio, the nearest candidate
            seen = tokens
            score = abs(math.log(non_embedding * TOKENS_PER_PARAM / tokens))
        else:
            seen = flops / per_token if seconds is None else seconds / cost.seconds_per_token(shape, per_token)
            score = predicted_loss(non_embedding, seen, corpus_tokens)
        scored.append((score, shape, params, non_embedding, per_token, seen))
    if not scored:
        smaller = "" if below_params is None else f" below {below_params:,} parameters (larger ones ran out of memory)"
        raise ValueError(f"model.size auto: no valid shape{smaller} agrees with the fixed keys {fixed}")
    scored.sort(key=lambda row: row[0])
    chosen = _cheapest_of_the_best(scored, lambda row: row[0], lambda row: (row[4], row[2]))
    score, shape, params, non_embedding, per_token, seen = chosen
    runner = next((row for row in scored if row is not chosen), None)
    spent_on_need = tokens is None  # a compute or time budget, not a number of tokens the user asked for
    trained = min(seen, saturating_tokens(non_embedding, corpus_tokens)) if spent_on_need else seen
    sized = Sizing(shape, batch_size or batch_for(trained, shape.seq_len), params, non_embedding, per_token, seen,
                   seen / corpus_tokens, score, {"shape": asdict(runner[1]), "score": runner[0]} if runner else {},
                   model_cfg.dropout)
    if model_cfg.dropout is None:
        sized = with_dropout(sized, corpus_tokens, weight_decay=weight_decay)
    return saturated(sized, corpus_tokens) if spent_on_need else sized
