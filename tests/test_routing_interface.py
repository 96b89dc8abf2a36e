"""A third routing variant plugs in through its own file and its config section alone (ultrathink/model/routing.py).
Defined here, it is built into the blocks, trained by the real Trainer, its statistics summed over micro-batches and
applied only after applied steps, its aux loss added, its figures logged and printed: no change to the model, the
trainer or the engines."""

from __future__ import annotations

import math
import torch

from test_train import MODEL, make_trainer, poison
from ultrathink.config import VariantConfig
from ultrathink.model.routing import Routing, RoutingModule, count, implements, prefixed


class TallyConfig(VariantConfig):
    enabled: bool = True
    every: int = 2
    aux_loss_weight: float = 0.5


class TalliedModelConfig(type(MODEL)):
    tally: TallyConfig = TallyConfig()


@implements(TallyConfig)
class Tally(RoutingModule):
    """Wraps a block; counts the tokens it saw in applied training steps (a buffer only `update` moves) and adds
    a weighted mean square of its output as aux loss."""

    def __init__(self, block: torch.nn.Module, cfg: TallyConfig):
        super().__init__()
        self.block, self.cfg = block, cfg
        self.register_buffer("seen", torch.zeros((), dtype=torch.float64))

    @classmethod
    def build(cls, cfg, layer: int, block: torch.nn.Module) -> torch.nn.Module:
        return cls(block, cfg.tally) if cfg.tally.applies_to(layer) else block

    def forward(self, x, cos, sin, cache=None):
        out, inner = self.block(x, cos, sin, cache)
        aux = self.cfg.aux_loss_weight * out.float().pow(2).mean() if self.training else None
        return out, {"": Routing(aux, {"tokens": count(x.shape[0] * x.shape[1], x)}), **prefixed("block", inner)}

    def update(self, stats) -> None:
        self.seen += stats["tokens"].to(self.seen)

    @classmethod
    def metrics(cls, modules, model) -> dict[str, float]:
        return {"tally_tokens": sum(stats["tokens"].item() for _, stats in modules.values())}

    @classmethod
    def line(cls, metrics, modules) -> str:
        return f"tally=[tokens={metrics['tally_tokens']:.0f}]"


CFG = TalliedModelConfig(**{**MODEL.model_dump(), "n_layers": 4, "dropout": 0.0})


def test_a_new_variant_is_found_built_and_its_aux_loss_added():
    from ultrathink.model import UltraThink

    torch.manual_seed(0)
    model = UltraThink(CFG, 50).train()
    assert list(model.variants) == ["blocks.1", "blocks.3"]
    x = torch.randint(0, 50, (2, 16))
    out = model(x, x)
    assert out.routing["blocks.1"]["tokens"] == 32
    ce = torch.nn.functional.cross_entropy(out.logits.view(-1, 50), x.view(-1))
    assert out.aux_loss > 0 and torch.allclose(out.loss, ce + out.aux_loss)


def test_the_trainer_sums_applies_and_logs_a_new_variant_and_drops_a_skipped_step(tmp_path, capsys):
    trainer = make_trainer(tmp_path, 6, model_cfg=CFG, grad_accum=2, log_every=1, eval_every=100)
    poison(trainer, {5})  # the third step's first micro-batch: that step is skipped, its statistics dropped
    logged = []
    trainer.log_metrics = lambda record, step: logged.append(record)
    result = trainer.fit()
    assert result.step == 6 and result.skipped_steps == 1 and math.isfinite(result.history[-1]["train_loss"])
    per_step = 2 * 4 * MODEL.seq_len  # grad_accum × batch × tokens per row, for each of the two wrapped blocks
    assert [r["tally_tokens"] for r in logged] == [2 * per_step] * 6
    for module in trainer.model.variants.values():
        assert module.seen.item() == 6 * per_step  # applied steps only
    captured = capsys.readouterr()
    assert "tally=[tokens=" in captured.out + captured.err
