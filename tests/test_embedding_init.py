"""train.embedding_init: a fresh model's embedding from the corpus's neighbour statistics (PPMI), at the init's
scale, without touching the global random stream; what it buys a fresh tied model before its first step; and the
train stage applying it to a fresh model only."""

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from e2e_helpers import copy_project
from ultrathink.config import ModelConfig, load_params
from ultrathink.data.tokens import load_split, read_meta
from ultrathink.model import UltraThink
from ultrathink.model.model import WEIGHTS_FILE
from ultrathink.train.distributed import Distributed
from ultrathink.train.embedding_init import corpus_embedding, init_from_corpus, neighbour_ppmi
from ultrathink.train.warm_start import WarmStartError, load_parent_weights

GROUP = 8  # tokens 0-7 and 8-15: each text below walks within one group at a time


def two_groups(tokens: int, seed: int) -> np.ndarray:
    """Runs of 40 tokens drawn uniformly from one group, the group drawn anew for each run."""
    rng = np.random.default_rng(seed)
    runs = [rng.integers(0, GROUP, 40) + GROUP * rng.integers(2) for _ in range(tokens // 40)]
    return np.concatenate(runs).astype(np.uint16)


def group_mask() -> torch.Tensor:
    return torch.block_diag(torch.ones(GROUP, GROUP), torch.ones(GROUP, GROUP)).bool()


def test_the_ppmi_is_positive_within_a_group_and_zero_across_and_for_pairs_never_seen():
    ppmi = neighbour_ppmi(two_groups(20_000, 0), 2 * GROUP).to_dense()
    assert torch.equal(ppmi, ppmi.T)
    within = ppmi[group_mask()]
    assert within.min() > 0.4 and within.max() < 0.9  # log(2): twice chance, a group being half the tokens
    # Across groups only the runs' 499 seams meet, far below chance: clipped to 0.
    assert ppmi[~group_mask()].max() == 0
    assert neighbour_ppmi(np.array([0, 1, 0, 1], dtype=np.uint16), 3).to_dense()[2].abs().sum() == 0


def test_tokens_that_keep_the_same_company_start_near_each_other_at_the_inits_scale():
    embedding = corpus_embedding(two_groups(20_000, 0), 2 * GROUP, 8, std=0.02, seed=0)
    assert embedding.shape == (2 * GROUP, 8) and embedding.dtype == torch.float32
    assert embedding.std().item() == pytest.approx(0.02, rel=1e-5)
    unit = F.normalize(embedding, dim=1)
    cosine = unit @ unit.T
    off_diagonal = group_mask() & ~torch.eye(2 * GROUP, dtype=torch.bool)
    assert cosine[off_diagonal].min() > 0.6
    assert cosine[~group_mask()].abs().max() < 1e-6
    # A random draw at the same scale has no such structure.
    drawn = F.normalize(torch.randn(2 * GROUP, 8, generator=torch.Generator().manual_seed(0)), dim=1)
    assert (drawn @ drawn.T)[off_diagonal].mean() < 0.3


def test_columns_past_the_vocabulary_are_drawn_and_the_global_stream_is_left_alone():
    tokens = two_groups(20_000, 0)
    torch.manual_seed(5)
    expected_next = torch.rand(4)
    torch.manual_seed(5)
    wide = corpus_embedding(tokens, 2 * GROUP, 24, std=0.02, seed=3)
    assert torch.equal(torch.rand(4), expected_next)
    assert torch.equal(wide, corpus_embedding(tokens, 2 * GROUP, 24, std=0.02, seed=3))
    # 16 tokens allow 16 directions; the other 8 columns are draws of the same std, and another seed draws others.
    assert wide[:, :2 * GROUP].std().item() == pytest.approx(0.02, rel=1e-5)
    assert 0.014 < wide[:, 2 * GROUP:].std().item() < 0.026
    other_seed = corpus_embedding(tokens, 2 * GROUP, 24, std=0.02, seed=4)
    assert not torch.equal(wide[:, 2 * GROUP:], other_seed[:, 2 * GROUP:])


def test_a_split_without_two_neighbouring_tokens_names_the_key():
    with pytest.raises(ValueError, match="train.embedding_init"):
        corpus_embedding(np.array([3], dtype=np.uint16), 2 * GROUP, 8, std=0.02, seed=0)


@torch.no_grad()
def held_out_loss(model: UltraThink, tokens: np.ndarray) -> float:
    windows = torch.from_numpy(tokens[: 64 * 33].astype(np.int64)).view(64, 33)
    model.eval()
    return model(windows[:, :-1], windows[:, 1:]).loss.item()


def test_a_fresh_tied_model_starts_out_predicting_a_tokens_usual_neighbours():
    """Before any step, a fresh model whose tied embedding came from the training text scores held-out text of the
    same kind (another draw) below chance, where a random embedding scores chance."""
    cfg = ModelConfig(d_model=32, n_layers=1, n_heads=2, n_kv_heads=2, seq_len=32, dropout=0.0)
    torch.manual_seed(0)
    drawn = UltraThink(cfg, 2 * GROUP)
    torch.manual_seed(0)
    from_corpus = UltraThink(cfg, 2 * GROUP)
    init_from_corpus(from_corpus, two_groups(20_000, 0), seed=0)
    held_out = two_groups(4_000, 1)
    assert held_out_loss(drawn, held_out) == pytest.approx(np.log(2 * GROUP), abs=0.05)
    assert held_out_loss(from_corpus, held_out) < held_out_loss(drawn, held_out) - 0.08  # 2.628 against 2.746
    # Only the embedding differs between the two.
    differ = [name for name, p in from_corpus.state_dict().items() if not torch.equal(p, drawn.state_dict()[name])]
    assert differ == ["embed.weight"]


@pytest.mark.slow
def test_the_train_stage_draws_a_fresh_models_embedding_from_its_split_and_a_warm_start_keeps_its_parents(
        trained_project, tmp_path, monkeypatch):
    from ultrathink.stages import pretrain
    project = copy_project(trained_project, tmp_path)
    monkeypatch.chdir(project)
    params = load_params(project / "params.yaml")
    assert params.train.embedding_init == "corpus"
    prepared = Path(params.paths.prepared_dir)
    vocab = read_meta(prepared)["vocab_size"]
    computed = []
    monkeypatch.setattr(pretrain, "init_from_corpus", lambda *args: computed.append(args) or init_from_corpus(*args))

    # The project's run resumes from its checkpoint: the init it would overwrite is never computed (at a large
    # vocabulary it costs most of a minute: benchmarks/README.md).
    resumed = pretrain.build_trainer(params, Distributed())
    assert resumed.resumed == resumed.trainer.cfg.max_steps and computed == []

    fresh_params = params.model_copy(update={"train": params.train.model_copy(update={"resume": False})})
    fresh, _, _, started = pretrain.build_trainer(fresh_params, Distributed())
    assert started is None and len(computed) == 1
    model_cfg = fresh.model.cfg
    expected = corpus_embedding(load_split(prepared, "train"), vocab, model_cfg.d_model, model_cfg.init_std,
                                params.train.seed)
    assert torch.equal(fresh.model.embed.weight.detach(), expected)
    assert not torch.equal(resumed.trainer.model.embed.weight.detach(), expected)  # the checkpoint's, trained

    drawn_params = params.model_copy(update={"train": params.train.model_copy(update={"embedding_init": "normal"})})
    drawn, _, _, _ = pretrain.build_trainer(drawn_params, Distributed())
    torch.manual_seed(params.train.seed)
    assert torch.equal(drawn.model.embed.weight.detach(), UltraThink(model_cfg, vocab).embed.weight)
    assert fresh.checkpoints.fingerprint != drawn.checkpoints.fingerprint  # two configurations' checkpoints

    parent = project / "artifacts/model"
    warm_params = params.model_copy(update={"train": params.train.model_copy(update={"init_from": str(parent)})})
    loaded = []
    monkeypatch.setattr(pretrain, "load_parent_weights",
                        lambda *args: loaded.append(args) or load_parent_weights(*args))
    warm, _, _, _ = pretrain.build_trainer(warm_params, Distributed())
    assert torch.equal(warm.model.embed.weight.detach(), load_file(parent / WEIGHTS_FILE)["embed.weight"])
    assert len(computed) == 1  # neither the drawn nor the warm-started embedding is the corpus's
    # A warm start that resumes its own checkpoint takes its weights from there: the parent's are not read again.
    warm.model.embed.weight.data.add_(1.0)
    warm.step = 3
    warm.save_checkpoint()
    again = pretrain.build_trainer(warm_params, Distributed())
    assert again.resumed == 3 and len(loaded) == 1
    assert torch.equal(again.trainer.model.embed.weight.detach(), warm.model.embed.weight.detach())
    # ... and is still checked before any work where it asks for the parent's optimizer state too.
    with_optimizer = warm_params.model_copy(update={"train": warm_params.train.model_copy(
        update={"init_optimizer": True})})
    with pytest.raises(WarmStartError, match="train.init_optimizer: .* is a model, not a checkpoint"):
        pretrain.build_trainer(with_optimizer, Distributed())
