import math

import pytest
import torch
import torch.nn.functional as F

from ultrathink.config import ModelConfig, MoEConfig, ParamsError, load_params
from ultrathink.model import UltraThink
from ultrathink.model.export import moe_layers
from ultrathink.model.generate import generate
from ultrathink.model.model import SwiGLU
from ultrathink.model.moe import ROWS_MULTIPLE, MoE, load_balance_loss, moe_metrics, normalized_entropy, router_z_loss

D, VOCAB = 16, 97
GROUPS = {"knowledge": 2, "skill": 2, "meta": 1, "safety": 1}  # 6 experts


def layer(seed=0, **cfg) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(D, MoEConfig(enabled=True, groups=GROUPS, **cfg), lambda: SwiGLU(D, 24))
    for p in moe.parameters():  # larger than the model's init so routing is decisive and outputs are not tiny
        torch.nn.init.normal_(p, std=0.5)
    return moe


def rows_per_expert(moe: MoE, x: torch.Tensor) -> tuple[torch.Tensor, dict, list[int]]:
    """The output, the layer's statistics, and how many token rows each expert actually ran on (counted by hooks,
    not by the layer). Experts run on their tokens plus zero rows up to a multiple of ROWS_MULTIPLE: the hook
    checks that, and counts the non-zero rows."""
    seen = [0] * len(moe.experts)

    def count(i, rows):
        real = int((rows.abs().sum(-1) > 0).sum())
        assert len(rows) % ROWS_MULTIPLE == 0 and len(rows) - real < ROWS_MULTIPLE
        seen[i] += real

    hooks = [e.register_forward_hook(lambda m, inp, out, i=i: count(i, inp[0])) for i, e in enumerate(moe.experts)]
    out, records = moe(x)
    for h in hooks:
        h.remove()
    return out, records[""].stats, seen


def reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Dropless top-k MoE computed the slow way: every expert on every token, mixed with renormalised weights."""
    probs = moe.router(x).softmax(-1)
    top = probs.topk(moe.top_k, dim=-1)
    weights = top.values / top.values.sum(-1, keepdim=True)
    every = torch.stack([e(x) for e in moe.experts], dim=-2)  # (B, T, E, D)
    picked = every.gather(-2, top.indices[..., None].expand(*top.indices.shape, D))
    return (picked * weights[..., None]).sum(-2)


def test_eval_output_is_the_top_k_mixture_and_compute_is_sparse():
    moe = layer().eval()
    x = torch.randn(3, 10, D)
    with torch.no_grad():
        out, stats, seen = rows_per_expert(moe, x)
        assert torch.allclose(out, reference(moe, x), atol=1e-5)
    # Each token ran through exactly top_k experts, never all of them (an expert with no tokens runs on none).
    assert sum(seen) == moe.top_k * 30
    assert seen == stats["chosen"].tolist() == stats["processed"].tolist()


def test_training_capacity_drops_over_capacity_assignments_and_eval_is_dropless():
    moe = layer(capacity_factor=0.5).train()
    x = torch.randn(4, 12, D)
    _, stats, seen = rows_per_expert(moe, x)
    capacity = math.ceil(0.5 * 48 * 2 / 6)  # 8
    chosen = stats["chosen"]
    assert chosen.sum() == 96 and chosen.max() > capacity  # some expert was over capacity
    assert seen == torch.clamp(chosen, max=capacity).tolist() == stats["processed"].tolist()
    dropped = moe_metrics({0: (moe.cfg, stats)})["moe/layer0/dropped"]
    assert dropped == pytest.approx(1 - sum(seen) / 96)
    _, stats, seen = rows_per_expert(moe.eval(), x)
    assert seen == stats["chosen"].tolist() and sum(seen) == 96


def test_capacity_keeps_earlier_positions_so_training_stays_causal():
    cfg = ModelConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, seq_len=32, dropout=0.0,
                      moe=dict(enabled=True, every=1, capacity_factor=0.5, groups=GROUPS))
    torch.manual_seed(0)
    model = UltraThink(cfg, VOCAB).train()
    x = torch.randint(0, VOCAB, (2, 24))
    y = x.clone()
    y[:, 16:] = (y[:, 16:] + 1) % VOCAB
    a, out = model(x)[0], model(y)
    b = out.logits
    assert model.routing_metrics(out.routing)["moe_dropped_frac"] > 0
    # Equal up to float noise (an expert's matmul sees a different number of rows); a routing change would show.
    assert torch.allclose(a[:, :16], b[:, :16], atol=1e-6, rtol=0)


def test_switch_loss_is_one_at_balance_and_grows_with_skew():
    balanced = 5.0 * torch.eye(4)  # token i prefers expert i; mean probability 1/4 each
    probs = balanced.softmax(-1)
    counts = torch.bincount(probs.argmax(-1), minlength=4)
    assert load_balance_loss(probs, counts).item() == pytest.approx(1.0)
    skewed = torch.tensor([[2.0, 0, 0, 0]]).repeat(8, 1)  # everyone prefers expert 0
    p0 = math.exp(2) / (math.exp(2) + 3)
    assert load_balance_loss(skewed.softmax(-1), torch.tensor([8, 0, 0, 0])).item() == pytest.approx(4 * p0)


def test_z_loss_is_mean_squared_logsumexp():
    assert router_z_loss(torch.zeros(5, 8)).item() == pytest.approx(math.log(8) ** 2)
    logits = torch.tensor([[0.0, math.log(3)], [math.log(2), math.log(2)]])  # logsumexp: log 4, log 4
    assert router_z_loss(logits).item() == pytest.approx(math.log(4) ** 2)


def test_training_loss_adds_weighted_aux_losses_and_eval_loss_is_pure_cross_entropy():
    cfg = ModelConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, seq_len=32, dropout=0.0,
                      moe=dict(enabled=True, every=1, groups=GROUPS, aux_loss_weight=0.5, z_loss_weight=0.1))
    torch.manual_seed(0)
    model = UltraThink(cfg, VOCAB).train()
    x, y = torch.randint(0, VOCAB, (2, 16)), torch.randint(0, VOCAB, (2, 16))
    router_logits = {}  # captured by hooks, to recompute each layer's aux losses by hand
    hooks = [m.router.register_forward_hook(lambda mod, inp, out, i=i: router_logits.__setitem__(i, out.float()))
             for i, m in moe_layers(model).items()]
    logits, loss = model(x, y)[:2]
    for h in hooks:
        h.remove()
    ce = F.cross_entropy(logits.view(-1, VOCAB), y.view(-1))
    expected = []
    for logits_i in router_logits.values():
        probs = logits_i.softmax(-1)
        counts = torch.bincount(probs.topk(2).indices.flatten(), minlength=6)
        expected.append(0.5 * load_balance_loss(probs, counts) + 0.1 * router_z_loss(logits_i))
    assert loss.item() == pytest.approx((ce + sum(expected) / 2).item(), rel=1e-6)
    assert loss.item() > ce.item() + 0.5  # the balance loss alone is at least 1·0.5
    eval_logits, eval_loss, eval_aux, _ = model.eval()(x, y)
    assert eval_aux is None
    assert eval_loss.item() == pytest.approx(F.cross_entropy(eval_logits.view(-1, VOCAB), y.view(-1)).item())


def test_gradients_reach_router_and_every_used_expert_and_an_unused_one_gets_zeros():
    moe = layer().train()
    moe.select_bias[0] = -1e4  # expert 0 is never chosen: a dead expert
    out, records = moe(torch.randn(2, 16, D))
    (out.pow(2).mean() + records[""].aux_loss).backward()
    assert moe.router.weight.grad.abs().sum() > 0
    processed = records[""].stats["processed"].tolist()
    assert processed[0] == 0 and all(n > 0 for n in processed[1:])
    for e, used in zip(moe.experts, processed):
        # Every expert has a gradient (DDP and ZeRO need the same set on every rank); a dead one's is zero.
        for p in e.parameters():
            assert p.grad is not None and (p.grad.abs().sum() > 0) == (used > 0)


def test_bias_balancing_moves_a_skewed_router_toward_balance():
    moe = layer(bias_balancing=True, bias_update_rate=0.02, capacity_factor=None).train()
    x = torch.randn(4, 32, D) * 0.3 + 0.5  # inputs of positive mean: a few experts win for most tokens
    before = moe(x)[1][""].stats["chosen"]
    for _ in range(60):
        moe.update(moe(x)[1][""].stats)
    after = moe(x)[1][""].stats["chosen"]
    assert normalized_entropy(before) < 0.8 and normalized_entropy(after) > normalized_entropy(before) + 0.15
    assert after.max() < before.max() and after.min() > before.min()
    bias = moe.select_bias
    assert bias[before.argmax()] < 0 < bias[before.argmin()]  # the overloaded expert became less attractive


def test_bias_is_not_nudged_without_bias_balancing_and_forward_changes_no_state():
    moe = layer(bias_balancing=True).train()
    state = {k: v.clone() for k, v in moe.state_dict().items()}
    attributes = set(vars(moe))
    _, records = moe(torch.randn(2, 8, D))
    # A forward writes nothing: the bias moves only when the trainer applies a step's statistics.
    assert all(torch.equal(v, moe.state_dict()[k]) for k, v in state.items()) and set(vars(moe)) == attributes
    moe.update(records[""].stats)
    assert not torch.equal(moe.select_bias, torch.zeros(6))
    off = layer().train()
    off.update(off(torch.randn(2, 8, D))[1][""].stats)
    assert torch.equal(off.select_bias, torch.zeros(6))


def test_health_metrics_values():
    assert normalized_entropy(torch.tensor([3, 3, 3, 3])) == pytest.approx(1.0)
    assert normalized_entropy(torch.tensor([9, 0, 0, 0])) == pytest.approx(0.0)
    moe = layer().eval()
    chosen = torch.tensor([8.0, 4, 4, 0, 0, 0])  # knowledge: 8+4, skill: 4+0, meta 0, safety 0
    stats = {"chosen": chosen, "processed": chosen.clone(), "forwards": torch.tensor(2.0),
             "aux_loss": torch.tensor(0.5)}
    m = moe_metrics({3: (moe.cfg, stats)})
    assert m["moe/layer3/max_share"] == pytest.approx(0.5) and m["moe/layer3/dead"] == 3
    assert m["moe/knowledge/share"] == pytest.approx(0.75) and m["moe/knowledge/max_share"] == pytest.approx(8 / 12)
    assert m["moe/skill/dead"] == 1 and m["moe/meta/dead"] == 1
    assert m["moe_max_expert_share"] == pytest.approx(0.5) and m["moe_dropped_frac"] == 0
    assert m["moe_aux_loss"] == pytest.approx(0.25)  # summed over 2 forwards, reported per forward


def moe_model(seed=0) -> UltraThink:
    cfg = ModelConfig(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, seq_len=64,
                      moe=dict(enabled=True, every=2, groups=GROUPS))
    torch.manual_seed(seed)
    return UltraThink(cfg, VOCAB).eval()


def test_only_every_nth_block_is_moe_and_flops_count_active_experts():
    model = moe_model()
    assert list(model.variants) == ["blocks.1.mlp"] and not isinstance(model.blocks[0].mlp, MoE)
    expert = sum(p.numel() for p in moe_layers(model)[1].experts[0].parameters())
    assert model.active_params() == model.num_params() - 4 * expert  # 6 experts, 2 active


def test_greedy_with_and_without_cache_identical_for_moe():
    model = moe_model()
    x = torch.randint(0, VOCAB, (3, 7))
    assert torch.equal(generate(model, x, 25, temperature=0, use_cache=True),
                       generate(model, x, 25, temperature=0, use_cache=False))


def test_save_load_round_trip_keeps_selection_bias(tmp_path):
    model = moe_model()
    moe_layers(model)[1].select_bias += torch.arange(6.0) / 10
    model.save_pretrained(tmp_path)
    loaded = UltraThink.from_pretrained(tmp_path)
    assert torch.equal(moe_layers(loaded)[1].select_bias, moe_layers(model)[1].select_bias)


def test_config_rejects_top_k_over_experts_and_moe_with_dre_on_one_block(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text("model:\n  moe: {enabled: true, top_k: 9}\n")
    with pytest.raises(ParamsError, match=r"model.moe: top_k \(9\) must not exceed the number of experts \(8\)"):
        load_params(path)
    path.write_text("model:\n  moe: {enabled: true}\n  dre: {enabled: true}\n")
    with pytest.raises(ParamsError, match="moe and dre must not apply to the same block"):
        load_params(path)
