"""Reading Hugging Face checkpoints of the Llama family: logits parity with transformers per family (fp32, ≤ 1e-4),
sharded files, and clear refusals of what the model cannot compute."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from hf_models import FAMILIES, save_family
from ultrathink.model import UltraThink
from ultrathink.model.hf import UnsupportedModelError, is_hf_checkpoint

IDS = torch.tensor([[5, 17, 42, 300, 7, 99, 1, 250, 33, 64, 2, 3]])


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def checkpoint(request, tmp_path_factory):
    return request.param, save_family(request.param, tmp_path_factory.mktemp(request.param))


def reference_logits(directory, ids):
    hf = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(ids).logits


def test_logits_match_transformers(checkpoint):
    family, directory = checkpoint
    ours = UltraThink.from_pretrained(directory)
    with torch.no_grad():
        logits = ours(IDS).logits
    difference = (logits - reference_logits(directory, IDS)).abs().max().item()
    assert difference <= 1e-4, f"{family}: max |Δlogit| {difference:.2e}"
    assert logits.abs().max() > 0.1  # not a degenerate model
    cfg = ours.cfg
    assert cfg.qkv_bias == (family == "qwen2") and cfg.qk_norm == (family == "qwen3")
    assert cfg.tie_embeddings == (family in ("tied", "qwen3"))
    assert (cfg.rope_scaling is not None) == (family == "llama3_rope")


def test_a_forgotten_tensor_would_show(checkpoint):
    """The parity test can fail: zeroing any one imported norm or bias moves the logits past the tolerance."""
    family, directory = checkpoint
    ours = UltraThink.from_pretrained(directory)
    target = {"qwen2": "blocks.1.attn.k_proj.bias", "qwen3": "blocks.1.attn.k_norm.weight"}.get(
        family, "blocks.1.mlp_norm.weight")
    with torch.no_grad():
        base = ours(IDS).logits
        ours.get_parameter(target).fill_(0.0 if target.endswith("bias") else 1.0)
        assert (ours(IDS).logits - base).abs().max() > 1e-3


def test_long_positions_use_the_scaled_rope(tmp_path):
    """llama3 rope scaling matters beyond its original context (32 here): parity over 100 positions."""
    directory = save_family("llama3_rope", tmp_path / "m")
    ids = torch.randint(0, 384, (1, 100), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = UltraThink.from_pretrained(directory)(ids).logits
    assert (ours - reference_logits(directory, ids)).abs().max() <= 1e-4


def test_sharded_checkpoint_loads_shard_by_shard(tmp_path):
    directory = save_family("qwen2", tmp_path / "m", max_shard_size="100KB")
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    with torch.no_grad():
        logits = UltraThink.from_pretrained(directory)(IDS).logits
    assert (logits - reference_logits(directory, IDS)).abs().max() <= 1e-4


def test_weights_keep_their_stored_dtype(tmp_path):
    directory = save_family("llama", tmp_path / "m", dtype=torch.bfloat16)
    model = UltraThink.from_pretrained(directory)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in UltraThink.from_pretrained(directory, dtype=torch.float32).parameters()} == {
        torch.float32}


def test_mistral_context_is_its_sliding_window(tmp_path):
    directory = save_family("mistral", tmp_path / "m")
    assert UltraThink.from_pretrained(directory).cfg.seq_len == 128  # sliding_window, narrower than 256


@pytest.mark.parametrize("change, named", [
    ({"model_type": "gpt2"}, "model_type 'gpt2'"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"head_dim": 32}, "head_dim 32"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "rope_scaling type 'yarn'"),
])
def test_unsupported_configs_are_refused_by_name(tmp_path, change, named):
    directory = save_family("llama", tmp_path / "m")
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(UnsupportedModelError, match="supported: model_type llama, mistral, qwen2") as error:
        UltraThink.from_pretrained(directory)
    assert named in str(error.value)


def test_pickled_weights_are_refused(tmp_path):
    config = LlamaConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                         vocab_size=300)
    config.save_pretrained(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    assert is_hf_checkpoint(tmp_path)
    with pytest.raises(UnsupportedModelError, match="pytorch_model.bin would be unpickled"):
        UltraThink.from_pretrained(tmp_path)


# ---- everywhere a model is named: the CLI's --model, and the way back out ----------------------------------------
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end_of_text|>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def cli(*args: str):
    from typer.testing import CliRunner

    from ultrathink.cli import app

    return CliRunner().invoke(app, list(args))


def test_import_export_round_trip_through_the_cli(checkpoint, tmp_path):
    """`ultrathink export --model HF_DIR` writes a checkpoint of the same architecture that transformers loads
    with the same logits as the original, with its tokenizer."""
    family, directory = checkpoint
    result = cli("export", "--model", str(directory), "--out", str(tmp_path / "out"), "--params", str(tmp_path / "none"))
    assert result.exit_code == 0, result.output
    original = json.loads((directory / "config.json").read_text())
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    expected_type = family if family in ("qwen2", "qwen3") else "llama"  # Mistral without a narrower window is a Llama
    assert exported["model_type"] == expected_type, result.output
    assert exported["tie_word_embeddings"] == original["tie_word_embeddings"]
    again = reference_logits(tmp_path / "out", IDS)
    assert (again - reference_logits(directory, IDS)).abs().max() <= 1e-4
    from transformers import AutoTokenizer

    before, after = (AutoTokenizer.from_pretrained(d, local_files_only=True) for d in (directory, tmp_path / "out"))
    assert after("def f(x)").input_ids == before("def f(x)").input_ids
    assert after.bos_token == before.bos_token and after.eos_token == before.eos_token


def test_cli_eval_and_generate_take_a_hugging_face_dir(tmp_path):
    from hf_models import tokenizer

    directory = save_family("tied", tmp_path / "m", tok=tokenizer(chat_template=CHAT_TEMPLATE))
    text = tmp_path / "t.txt"
    text.write_text("The class statement defines a class.\n\nA list is a sequence of items.\n")
    none = str(tmp_path / "none")
    scored = cli("eval", "--model", str(directory), "--text-file", str(text), "--params", none, "--device", "cpu")
    assert scored.exit_code == 0 and "bits/byte" in scored.output, scored.output
    made = cli("generate", "--model", str(directory), "--prompt", "The class", "--max-new-tokens", "5",
               "--temperature", "0", "--params", none, "--device", "cpu")
    assert made.exit_code == 0 and made.output.strip(), made.output  # the continuation, printed as it comes
    talked = cli("chat", "--model", str(directory), "--message", "hi", "--max-new-tokens", "3", "--params", none,
                 "--device", "cpu")
    assert talked.exit_code == 0, talked.output  # its own chat template: a chat model as far as chat can tell


def test_cli_refuses_an_unsupported_checkpoint_by_name(tmp_path):
    directory = save_family("llama", tmp_path / "m")
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "model_type": "gemma"}))
    result = cli("eval", "--model", str(directory), "--text-file", __file__, "--params", str(tmp_path / "none"),
                 "--device", "cpu")
    assert result.exit_code == 1 and "model_type 'gemma'" in result.output, result.output


# ---- an open model's tokenizer through prepare and scoring -------------------------------------------------------
def test_a_large_vocabulary_with_bos_survives_prepare_and_scoring(tmp_path):
    """Ids above 65,535 (Llama 3's 128,256-token vocabulary) are packed as uint32, and each document is framed as
    the tokenizer frames a text: its BOS, the text, EOS. Scoring frames the documents the same way."""
    from hf_models import tokenizer

    from ultrathink.config import PrepareConfig
    from ultrathink.data.packing import prepare_splits
    from ultrathink.data.tokens import load_split, read_meta
    from ultrathink.scoring import encode_documents
    from ultrathink.tokenizer import copy_pretrained, load_tokenizer

    tokenizer(large=True).save_pretrained(tmp_path / "open")
    copy_pretrained(tmp_path / "open", tmp_path / "tok")
    tok = load_tokenizer(tmp_path / "tok")
    assert len(tok) > 65_536 and max(tok("The cat sat on the mat").input_ids) > 65_535
    docs = [f"The cat {i} sat on the mat." for i in range(60)]
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    meta = prepare_splits(tmp_path / "corpus.jsonl", tmp_path / "tok", PrepareConfig(val_fraction=0.2, workers=1),
                          tmp_path / "prep")
    assert meta["dtype"] == "uint32" and meta["vocab_size"] == len(tok)
    train = load_split(tmp_path / "prep", "train")[:]
    bos, eos = tok.bos_token_id, tok.eos_token_id
    starts = [0, *(i + 1 for i in range(len(train) - 1) if train[i] == eos)]
    assert all(train[i] == bos for i in starts) and len(starts) == read_meta(tmp_path / "prep")["train"]["documents"]
    assert train.max() > 65_535 and train.max() < len(tok)
    first = tok.decode(train[: list(train).index(eos) + 1].tolist())
    assert first.startswith("<|begin_of_text|>The cat") and first.endswith("<|end_of_text|>")
    stream = encode_documents(tok, docs[:2]).tolist()
    assert stream == [eos, *tok(docs[0]).input_ids, eos, *tok(docs[1]).input_ids, eos]


def test_copy_pretrained_needs_a_fast_tokenizer_with_an_eos(tmp_path):
    from hf_models import tokenizer

    from ultrathink.tokenizer import copy_pretrained

    with pytest.raises(FileNotFoundError, match="holds no tokenizer.json"):
        copy_pretrained(tmp_path, tmp_path / "out")
    no_eos = tokenizer()
    no_eos.eos_token = None
    no_eos.save_pretrained(tmp_path / "noeos")
    with pytest.raises(ValueError, match="has no eos_token"):
        copy_pretrained(tmp_path / "noeos", tmp_path / "out")
    assert not (tmp_path / "out").exists()


# ---- continued pretraining: the architecture is the parent's ------------------------------------------------------
@pytest.mark.parametrize("model, message", [
    ({"d_model": 32}, r"model.d_model: 32 \(the parent's: 64\)"),
    ({"rope_theta": 123.0}, r"model.rope_theta: 123.0 \(the parent's: 50000.0\)"),
    ({"seq_len": 4096}, "model.seq_len 4096 exceeds the parent's context 128"),
    ({"size": "auto"}, "model.size auto sizes a new model"),
    ({"moe": {"enabled": True}}, "model.moe enabled"),
])
def test_open_parent_settings_that_disagree_are_named(tmp_path, model, message):
    from ultrathink.config import ModelConfig
    from ultrathink.train.warm_start import WarmStartError, find_parent, open_model_config

    directory = save_family("llama", tmp_path / "m")
    parent = find_parent(directory, "models/m")
    assert parent.open_model and parent.tokenizer_dir == directory
    with pytest.raises(WarmStartError, match=message):
        open_model_config(parent, ModelConfig(**model), 300)


def test_an_open_parent_with_another_tokenizer_says_which_to_use(tmp_path):
    from ultrathink.config import ModelConfig, TokenizerConfig
    from ultrathink.tokenizer import tokenizer_hash, train_tokenizer
    from ultrathink.train.warm_start import WarmStartError, find_parent, load_parent_weights, open_model_config

    directory = save_family("llama", tmp_path / "m")
    train_tokenizer(["some other text to learn from"] * 50, TokenizerConfig(vocab_size=300), tmp_path / "ours")
    parent = find_parent(directory, "models/m")
    cfg, vocab = open_model_config(parent, ModelConfig(), 300)
    with pytest.raises(WarmStartError, match=r"another tokenizer.*tokenizer.pretrained: models/m"):
        load_parent_weights(parent, UltraThink(cfg, vocab), tokenizer_hash(tmp_path / "ours"), tmp_path / "ours")


def test_open_parent_config_takes_the_run_context_and_dropout(tmp_path):
    from ultrathink.config import ModelConfig
    from ultrathink.train.warm_start import find_parent, open_model_config

    directory = save_family("qwen2", tmp_path / "m")
    cfg, vocab = open_model_config(find_parent(directory, "m"), ModelConfig(seq_len=64, dropout=0.05), 384)
    assert (cfg.d_model, cfg.n_layers, cfg.n_kv_heads, cfg.hidden, cfg.seq_len, cfg.dropout) == (64, 2, 2, 96, 64, 0.05)
    assert cfg.qkv_bias and not cfg.tie_embeddings and cfg.rope_theta == 1e6 and vocab == 384


def test_a_sentencepiece_style_tokenizer_packs_each_document_as_it_encodes_it(tmp_path):
    """Llama 2's tokenizer (Metaspace: '▁' for spaces, one prepended to a text; <s> before it) is not cut at line
    starts like our byte-level BPE: every packed document is exactly tokenizer(document) followed by EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    from hf_models import TEXTS

    from ultrathink.config import PrepareConfig
    from ultrathink.data.packing import cuts_at_line_starts, prepare_splits
    from ultrathink.data.tokens import load_split

    docs = [f"Line one of {i}.\nLine two, indented:\n  x = {i}\nThe end." for i in range(40)]
    spm = Tokenizer(models.BPE(unk_token="<unk>"))
    spm.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    spm.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    spm.train_from_iterator(TEXTS + docs, trainers.BpeTrainer(  # every character seen: no <unk>
        vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False))
    spm.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok = PreTrainedTokenizerFast(tokenizer_object=spm, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    assert not cuts_at_line_starts(tok)
    tok.save_pretrained(tmp_path / "tok")
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    prepare_splits(tmp_path / "corpus.jsonl", tmp_path / "tok", PrepareConfig(val_fraction=0.2, workers=1),
                   tmp_path / "prep")
    packed = [load_split(tmp_path / "prep", split)[:].tolist() for split in ("train", "val")]
    expected = sorted(tuple(tok(d).input_ids + [tok.eos_token_id]) for d in docs)
    documents = []
    for ids in packed:
        start = 0
        for i, t in enumerate(ids):
            if t == tok.eos_token_id:
                documents.append(tuple(ids[start : i + 1]))
                start = i + 1
    assert sorted(documents) == expected and expected[0][0] == tok.bos_token_id
