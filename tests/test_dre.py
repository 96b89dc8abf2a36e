import pytest
import torch

from ultrathink.config import ModelConfig
from ultrathink.model import UltraThink
from ultrathink.model.dre import PATHS, RoutedBlock
from ultrathink.model.generate import generate

VOCAB = 97


def cfg(**dre) -> ModelConfig:
    return ModelConfig(d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, seq_len=64, dropout=0.0,
                       dre={"enabled": True, "every": 2, **dre})


def routed_model(seed=0, **dre) -> UltraThink:
    """A DRE model past warmup whose thresholds come from one observed training batch."""
    torch.manual_seed(seed)
    model = UltraThink(cfg(warmup_steps=0, **dre), VOCAB)
    for block in model.routed_blocks.values():  # a router that matters: scores of a few units, not ~0.02
        torch.nn.init.normal_(block.router.weight, std=0.5)
    model.train()(torch.randint(0, VOCAB, (8, 64)))
    model.after_optimizer_step()
    return model.eval()


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
    assert routed.health_metrics()["dre_flops_ratio"] == 1.0


def test_unselected_tokens_pass_unchanged_and_selected_ones_get_the_scaled_block_output():
    model = routed_model()
    block: RoutedBlock = model.routed_blocks[1]
    x = torch.randn(1, 20, 64)
    cos, sin = model.rotary(0, 20)
    with torch.no_grad():
        out = block(x, cos, sin)
        scores = block.router(x).squeeze(-1)[0]
        selected = scores > block.thresholds[list(PATHS).index("standard")]
        assert 0 < selected.sum() < 20
        idx = selected.nonzero()[:, 0]
        # The block run on the selected tokens alone, as a short causal sequence at their own positions.
        sub = block.block(x[:, idx], cos[idx], sin[idx])
    assert torch.equal(out[0, ~selected], x[0, ~selected])
    expected = x[:, idx] + torch.sigmoid(scores[idx])[:, None] * (sub - x[:, idx])
    assert torch.allclose(out[:, idx], expected, atol=1e-5)


def test_router_gets_gradient_through_the_output_scale():
    model = routed_model().train()
    x, y = torch.randint(0, VOCAB, (2, 32)), torch.randint(0, VOCAB, (2, 32))
    model(x, y)[1].backward()
    for block in model.routed_blocks.values():
        assert block.router.weight.grad.abs().sum() > 0


def test_thresholds_keep_each_path_near_its_capacity():
    x = torch.randint(0, VOCAB, (8, 64))
    for path, capacity in PATHS.items():
        model = routed_model(path=path)
        model(x)
        for i in model.routed_blocks:
            assert model.health_metrics()[f"dre/layer{i}/kept"] == pytest.approx(capacity, abs=0.1)
        assert model.health_metrics()["dre_flops_ratio"] < 1


def test_force_path_applies_at_inference_only():
    model = routed_model(path="deep", force_path="fast")
    x = torch.randint(0, VOCAB, (8, 64))
    model(x)
    assert model.health_metrics()["dre_kept"] == pytest.approx(0.25, abs=0.1)
    assert model.health_line(model.health_metrics()).startswith("dre=[path=fast,kept=")
    model.train()(x)
    assert model.health_metrics()["dre_kept"] == pytest.approx(0.75, abs=0.1)


@pytest.mark.parametrize("training", [True, False])
def test_later_tokens_never_change_earlier_logits(training):
    model = routed_model().train(training)
    x = torch.randint(0, VOCAB, (3, 40))
    y = x.clone()
    y[:, 25:] = (y[:, 25:] + 1) % VOCAB
    with torch.no_grad():
        a, b = model(x)[0], model(y)[0]
    assert 0.2 < model.health_metrics()["dre_kept"] < 0.8  # routing really skipped tokens
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
        model(x)
        paths.append(model.health_line(model.health_metrics()))
        model.after_optimizer_step()
    assert [p.split(",")[0] for p in paths] == ["dre=[path=warmup"] * 2 + ["dre=[path=standard"]
    model.save_pretrained(tmp_path)
    loaded = UltraThink.from_pretrained(tmp_path)
    for i, block in model.routed_blocks.items():
        assert torch.equal(loaded.routed_blocks[i].thresholds, block.thresholds)
        assert loaded.routed_blocks[i].steps.item() == 3


def test_training_loss_adds_the_router_bce_toward_top_capacity_membership():
    model = routed_model(aux_loss_weight=0.5).train()
    scores = {}
    hooks = [b.router.register_forward_hook(lambda m, inp, out, i=i: scores.__setitem__(i, out.squeeze(-1)))
             for i, b in model.routed_blocks.items()]
    x, y = torch.randint(0, VOCAB, (2, 32)), torch.randint(0, VOCAB, (2, 32))
    logits, loss = model(x, y)[:2]
    for h in hooks:
        h.remove()
    expected = []
    for i, s in scores.items():
        in_top = torch.zeros_like(s)
        in_top.scatter_(1, s.topk(16, dim=1).indices, 1.0)  # standard path: top half of each sequence
        z = s - model.routed_blocks[i].thresholds[1]
        bce = -(in_top * torch.nn.functional.logsigmoid(z) + (1 - in_top) * torch.nn.functional.logsigmoid(-z))
        expected.append(0.5 * bce.mean())
    ce = torch.nn.functional.cross_entropy(logits.view(-1, VOCAB), y.view(-1))
    assert loss.item() == pytest.approx((ce + sum(expected) / len(expected)).item(), rel=1e-6)
