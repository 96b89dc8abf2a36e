from pathlib import Path

import pytest
import yaml

from ultrathink.config import Params, ParamsError, default_params_yaml, load_params, schema_rows
from ultrathink.config.fingerprint import training_params_hash

ROOT = Path(__file__).resolve().parents[1]


def write(tmp_path, data) -> Path:
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_shipped_params_are_the_schema_defaults():
    assert load_params(ROOT / "params.yaml") == Params()


def test_default_yaml_round_trips():
    assert Params.model_validate(yaml.safe_load(default_params_yaml())) == Params()


def test_typo_names_key_and_suggests(tmp_path):
    with pytest.raises(ParamsError) as exc:
        load_params(write(tmp_path, {"train": {"lrr": 0.1}}))
    assert "train.lrr: unknown key. Did you mean 'lr'?" in str(exc.value)


def test_unknown_section_suggests(tmp_path):
    with pytest.raises(ParamsError, match="trian: unknown key. Did you mean 'train'"):
        load_params(write(tmp_path, {"trian": {}}))


def test_wrong_type_and_range_name_the_key(tmp_path):
    with pytest.raises(ParamsError) as exc:
        load_params(write(tmp_path, {"train": {"lr": -1, "batch_size": "big"}, "train_": None}))
    text = str(exc.value)
    assert "train.lr: Input should be greater than 0 (got -1)" in text
    assert "train.batch_size: Input should be a valid integer" in text


def test_cross_field_check(tmp_path):
    with pytest.raises(ParamsError, match=r"model: n_kv_heads \(3\) must divide n_heads \(4\)"):
        load_params(write(tmp_path, {"model": {"n_kv_heads": 3}}))


def test_overrides_are_yaml_values_checked_by_the_schema(tmp_path):
    path = write(tmp_path, {})
    params = load_params(path, ["train.lr=3e-4", "model.n_layers=2", "evaluate.prompts=[a, b]"])
    assert params.train.lr == 3e-4 and params.model.n_layers == 2 and params.evaluate.prompts == ["a", "b"]
    with pytest.raises(ParamsError, match="expected KEY=VALUE"):
        load_params(path, ["train.lr"])
    with pytest.raises(ParamsError, match="train.nope: unknown key"):
        load_params(path, ["train.nope=1"])


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ParamsError, match="not found"):
        load_params(tmp_path / "absent.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [unclosed")
    with pytest.raises(ParamsError, match="not valid YAML"):
        load_params(bad)


def test_schema_rows_cover_every_knob():
    keys = {row[0] for row in schema_rows()}
    assert {"train.lr", "model.d_model", "validate.min_rows", "train.init_from", "data.txt_unit", "paths.model_dir"} <= keys
    assert {"model.moe.top_k", "model.moe.groups.knowledge", "model.dre.path"} <= keys  # nested sections too
    assert len(keys) == count_leaves(Params().model_dump(by_alias=True))


def count_leaves(tree) -> int:
    """Knobs of a dump: a mapping's leaves, and an empty mapping (registry.task_guard's {}) is one knob itself."""
    return sum(count_leaves(v) for v in tree.values()) if isinstance(tree, dict) and tree else 1


def test_fingerprint_params_ignore_bookkeeping_only():
    p = Params()
    base = training_params_hash(p.model, p.train)
    for bookkeeping in ({"eval_every": 7}, {"select": "last"}, {"calibrate": False}, {"keep_configs": 9},
                        {"init_from": "artifacts/model"}):
        assert training_params_hash(p.model, p.train.model_copy(update=bookkeeping)) == base
    assert training_params_hash(p.model, p.train.model_copy(update={"lr": 1e-4})) != base
    assert training_params_hash(p.model, p.train.model_copy(update={"max_steps": 600})) != base
    assert training_params_hash(p.model.model_copy(update={"d_model": 64}), p.train) != base


def test_fingerprint_covers_data_code_and_parent():
    from ultrathink.train.checkpoint import Fingerprint

    base = Fingerprint("params", "data", "code")
    assert base.id == Fingerprint("params", "data", "code", "none").id
    for other, part in ((Fingerprint("params", "data", "code2"), "code"), (Fingerprint("params", "d2", "code"), "data"),
                        (Fingerprint("params", "data", "code", "parent"), "parent")):
        assert other.id != base.id and base.differences(vars(other)) == [part]


def test_init_optimizer_without_a_parent_is_refused(tmp_path):
    with pytest.raises(ParamsError, match="train: init_optimizer needs init_from"):
        load_params(write(tmp_path, {"train": {"init_optimizer": True}}))


def test_removed_registry_metric_key_is_named(tmp_path):
    with pytest.raises(ParamsError, match="registry.metric: unknown key"):
        load_params(write(tmp_path, {"registry": {"metric": "val_loss"}}))
