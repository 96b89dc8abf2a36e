import math

import pytest
import torch

from ultrathink.config import ModelConfig
from ultrathink.model import UltraThink
from ultrathink.model.dre import PATHS, ROWS_MULTIPLE, RoutedBlock
from ultrathink.model.generate import generate
from ultrathink.model.routing import block_index

VOCAB = 97


def cfg(**dre) -> ModelConfig:
    return ModelConfig(d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, seq_len=64, dropout=0.0,
                       dre={"enabled": True, "every": 2, **dre})


def routed_model(seed=0, **dre) -> UltraThink:
    """A DRE model past warmup whose thresholds come from one observed training batch."""
    torch.manual_seed(seed)
    model = UltraThink(cfg(warmup_steps=0, **dre), VOCAB)
    for block in routed_blocks(model).values():  # a router that matters: scores of a few units, not ~0.02
        torch.nn.init.normal_(block.router.weight, std=0.5)
    model.update_routing(model.train()(torch.randint(0, VOCAB, (8, 64))).routing)
    return model.eval()


def routed_blocks(model: UltraThink) -> dict[int, RoutedBlock]:
    return {block_index(name): m for name, m in model.variants.items() if isinstance(m, RoutedBlock)}


def metrics(model: UltraThink, x: torch.Tensor) -> dict[str, float]:
    """Routing figures of one forward of `model` (in its current mode) on x."""
    with torch.no_grad():
        return model.routing_metrics(model(x).routing)


def test_full_capacity_during_warmup_is_exactly_the_dense_model():
    torch.manual_seed(0)
    routed = UltraThink(cfg(warmup_steps=5), VOCAB).eval()
    dense = UltraThink(ModelConfig(**{**routed.cfg.model_dump(), "dre": {}}), VOCAB).eval()
    state = {k.replace(".block.", "."): v for k, v in routed.state_dict().items()
             if ".router." not in k and not k.endswith(("thresholds", "steps"))}
    dense.load_state_dict(state)
    x = torch.randint(0, VOCAB, (2, 40))
    with torch.no_grad():
        assert torch.equal(routed(x)[0], dense(x)[0])
    assert metrics(routed, x)["dre_flops_ratio"] == 1.0


def test_unselected_tokens_pass_unchanged_and_selected_ones_get_the_scaled_block_output():
    model = routed_model()
    block: RoutedBlock = routed_blocks(model)[1]
    x = torch.randn(3, 20, 64)
    cos, sin = model.rotary(0, 20)
    with torch.no_grad():
        out, records = block(x, cos, sin)
        all_scores = block.router(x).squeeze(-1)
        kept = all_scores > block.thresholds[list(PATHS).index("standard")]
        # Three rows, up to four attention groups: each row attends alone, padded to nothing.
        assert records[""].stats["kept"] == kept.sum() == records[""].stats["slots"]
        assert len(set(kept.sum(1).tolist())) > 1  # rows keep different numbers of tokens
        for row in range(3):
            scores, selected = all_scores[row], kept[row]
            assert 0 < selected.sum() < 20
            idx = selected.nonzero()[:, 0]
            # The block run on the row's selected tokens alone, as a short causal sequence at their own positions.
            sub, _ = block.block(x[row:row + 1, idx], cos[idx], sin[idx])
            assert torch.equal(out[row, ~selected], x[row, ~selected])
            expected = x[row, idx] + torch.sigmoid(scores[idx])[:, None] * (sub[0] - x[row, idx])
            assert torch.allclose(out[row, idx], expected, atol=1e-5)


def test_the_mlp_runs_on_exactly_the_kept_tokens_of_the_batch():
    model = routed_model()
    block = routed_blocks(model)[1]
    rows = []
    hook = block.block.mlp.register_forward_hook(lambda m, inp, out: rows.append(inp[0].shape[:-1].numel()))
    x = torch.randint(0, VOCAB, (8, 64))
    stats = model(x).routing["blocks.1"]
    hook.remove()
    # The MLP: the kept tokens, padded only to a whole number of ROWS_MULTIPLE rows, never to the longest row.
    assert rows == [stats["rows"].item()] == [ROWS_MULTIPLE * math.ceil(stats["kept"].item() / ROWS_MULTIPLE)]
    # Attention: rows in groups of similar kept counts, each padded to its own longest row, not the batch's.
    scores = block.router(model.blocks[0](model.embed(x), *model.rotary(0, 64))[0]).squeeze(-1)
    counts = (scores > block.thresholds[list(PATHS).index("standard")]).sum(1)
    assert stats["kept"] == counts.sum() and stats["slots"] < 8 * counts.max()
    groups = counts.sort(descending=True).values.view(4, 2)  # 8 rows, 4 groups of 2
    assert stats["slots"] == 2 * groups.max(1).values.sum()


def test_a_block_that_keeps_no_token_passes_everything_and_still_gives_every_weight_a_gradient():
    model = routed_model().train()
    block = routed_blocks(model)[1]
    block.thresholds.fill_(1e4)  # nothing passes
    x, y = torch.randint(0, VOCAB, (2, 32)), torch.randint(0, VOCAB, (2, 32))
    inputs = {}
    hook = block.register_forward_hook(lambda m, inp, out: inputs.update(x=inp[0], out=out[0]))
    out = model(x, y)
    hook.remove()
    assert out.routing["blocks.1"]["kept"] == 0 and torch.equal(inputs["out"], inputs["x"])
    out.loss.backward()
    for name, p in block.block.named_parameters():
        assert p.grad is not None, name  # a zero gradient, so all ranks reduce the same set of gradients
        assert p.grad.abs().sum() == 0, name
    assert block.router.weight.grad.abs().sum() > 0  # the router still learns from its aux loss


def test_router_gets_gradient_through_the_output_scale():
    model = routed_model().train()
    x, y = torch.randint(0, VOCAB, (2, 32)), torch.randint(0, VOCAB, (2, 32))
    model(x, y)[1].backward()
    for block in routed_blocks(model).values():
        assert block.router.weight.grad.abs().sum() > 0


def test_thresholds_keep_each_path_near_its_capacity():
    x = torch.randint(0, VOCAB, (8, 64))
    for path, capacity in PATHS.items():
        model = routed_model(path=path)
        figures = metrics(model, x)
        for i in routed_blocks(model):
            assert figures[f"dre/layer{i}/kept"] == pytest.approx(capacity, abs=0.1)
        assert figures["dre_flops_ratio"] < 1


def test_force_path_applies_at_inference_only():
    model = routed_model(path="deep", force_path="fast")
    x = torch.randint(0, VOCAB, (8, 64))
    assert metrics(model, x)["dre_kept"] == pytest.approx(0.25, abs=0.1)
    assert metrics(model.train(), x)["dre_kept"] == pytest.approx(0.75, abs=0.1)


@pytest.mark.parametrize("training", [True, False])
def test_later_tokens_never_change_earlier_logits(training):
    model = routed_model().train(training)
    x = torch.randint(0, VOCAB, (3, 40))
    y = x.clone()
    y[:, 25:] = (y[:, 25:] + 1) % VOCAB
    with torch.no_grad():
        a, b = model(x)[0], model(y)[0]
    assert 0.2 < metrics(model, y)["dre_kept"] < 0.8  # routing really skipped tokens
    # Equal up to float noise (gathered rows change length with later selections); a routing change would show.
    assert torch.allclose(a[:, :25], b[:, :25], atol=1e-6, rtol=0)
    assert not torch.allclose(a[:, 25:], b[:, 25:], atol=1e-3)


def test_greedy_with_and_without_cache_identical_for_a_batch():
    model = routed_model()
    x = torch.randint(0, VOCAB, (3, 7))
    with_cache = generate(model, x, 40, temperature=0, use_cache=True)
    assert torch.equal(with_cache, generate(model, x, 40, temperature=0, use_cache=False))


def test_warmup_counts_optimizer_steps_and_state_survives_save(tmp_path):
    torch.manual_seed(0)
    model = UltraThink(cfg(warmup_steps=2), VOCAB).train()
    x = torch.randint(0, VOCAB, (4, 32))
    paths = []
    for _ in range(3):
        stats = model(x).routing
        paths.append(model.routing_line(model.routing_metrics(stats)))
        model.update_routing(stats)
    assert [p.split(",")[0] for p in paths] == ["dre=[path=warmup"] * 2 + ["dre=[path=standard"]
    model.save_pretrained(tmp_path)
    loaded = UltraThink.from_pretrained(tmp_path)
    for i, block in routed_blocks(model).items():
        assert torch.equal(routed_blocks(loaded)[i].thresholds, block.thresholds)
        assert routed_blocks(loaded)[i].steps.item() == 3


def test_forward_changes_no_state_and_non_finite_statistics_never_reach_the_thresholds():
    model = routed_model().train()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    stats = model(torch.randint(0, VOCAB, (4, 32))).routing
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())  # forward writes nothing
    for s in stats.values():
        s["quantiles"] = torch.full_like(s["quantiles"], float("nan"))  # what a poisoned batch observes
    model.update_routing(stats)
    for block in routed_blocks(model).values():
        assert torch.isfinite(block.thresholds).all() and block.steps.item() == 2


def test_training_loss_adds_the_router_bce_toward_top_capacity_membership():
    model = routed_model(aux_loss_weight=0.5).train()
    scores = {}
    hooks = [b.router.register_forward_hook(lambda m, inp, out, i=i: scores.__setitem__(i, out.squeeze(-1)))
             for i, b in routed_blocks(model).items()]
    x, y = torch.randint(0, VOCAB, (2, 32)), torch.randint(0, VOCAB, (2, 32))
    logits, loss = model(x, y)[:2]
    for h in hooks:
        h.remove()
    expected = []
    for i, s in scores.items():
        in_top = torch.zeros_like(s)
        in_top.scatter_(1, s.topk(16, dim=1).indices, 1.0)  # standard path: top half of each sequence
        z = s - routed_blocks(model)[i].thresholds[1]
        bce = -(in_top * torch.nn.functional.logsigmoid(z) + (1 - in_top) * torch.nn.functional.logsigmoid(-z))
        expected.append(0.5 * bce.mean())
    ce = torch.nn.functional.cross_entropy(logits.view(-1, VOCAB), y.view(-1))
    assert loss.item() == pytest.approx((ce + sum(expected) / len(expected)).item(), rel=1e-6)
