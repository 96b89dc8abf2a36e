"""The one typed schema behind params.yaml: a section class per params.yaml section, with the checks that span its
keys. Every knob of the pipeline is defined here, once (loading.py reads and checks a file against it, budget.py
parses train.budget, fingerprint.py says which knobs name a checkpoint)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ultrathink.config.budget import Budget


MAX_VOCAB = 2**32 - 1  # token ids are packed as uint16, or uint32 above 65,535 (ultrathink/data/packing.py)


class Section(BaseModel):
    """Strict base: unknown keys are errors, values are immutable once loaded."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class PathsConfig(Section):
    """Where each stage writes. dvc.yaml reads these same values through `${paths.*}` templating."""

    validated_corpus: str = "data/validated/corpus"  # Parquet shards + index.json (ultrathink.data.shards)
    validate_report: str = "reports/validate.json"
    tokenizer_dir: str = "artifacts/tokenizer"
    prepared_dir: str = "data/prepared"
    checkpoint_dir: str = "artifacts/checkpoints"
    model_dir: str = "artifacts/model"
    train_plan: str = "plans/train.json"  # the recorded plan per configuration and machine class (train/plan.py)
    train_run: str = "reports/train_run.json"  # this run's facts: MLflow run id, seconds, tokens/s, resumed from
    metrics: str = "reports/metrics.json"
    loss_curve: str = "reports/loss_curve.csv"
    logs_dir: str = "reports/logs"  # one log file per stage (<stage>.log), appended to by every run
    tensorboard_dir: str = "reports/tensorboard"  # train.tensorboard: one folder per MLflow run
    val_curve: str = "reports/val_curve.csv"
    samples: str = "reports/samples.json"
    tasks_dir: str = "reports/tasks"  # the built-in task (lm-eval YAML + its data), written by evaluate
    task_results: str = "reports/lm_eval.json"  # lm-eval's results of evaluate.tasks
    report: str = "reports/report.md"  # the run's report card (model, data, plan, metrics, samples, plots)
    plots_dir: str = "reports/plots"  # the report card's PNGs
    promotion: str = "reports/promotion.json"
    finetuned_dir: str = "artifacts/finetuned"  # model/ (LoRA merged), tokenizer/ (with the chat template), held-out pairs
    finetune_checkpoint_dir: str = "artifacts/finetune_checkpoints"
    finetune_plan: str = "plans/finetune.json"  # fine-tuning's recorded precision and attention kernel (plan.py)
    finetune_report: str = "reports/finetune.json"  # the pairs' gate, response-only loss before/after, sample answers
    finetune_promotion: str = "reports/finetune_promotion.json"
    aligned_dir: str = "artifacts/aligned"  # model/ (LoRA merged), tokenizer/, held-out preference pairs
    align_checkpoint_dir: str = "artifacts/align_checkpoints"
    align_plan: str = "plans/align.json"  # alignment's recorded precision and attention kernel (plan.py)
    align_report: str = "reports/align.json"  # the pairs' gate, preference accuracy and margins before/after, samples
    align_promotion: str = "reports/align_promotion.json"

    @model_validator(mode="after")
    def _plots_beside_the_report(self) -> "PathsConfig":
        if not Path(self.plots_dir).resolve().is_relative_to(Path(self.report).resolve().parent):
            raise ValueError(f"plots_dir ({self.plots_dir}) must lie in the folder of report ({self.report}): the "
                             f"report card links its plots by relative paths")
        return self


class MixtureSource(Section):
    """One component of `data.mixture`; unset keys take the value of the same key under `data`."""

    source: str = Field(..., min_length=1, description="a source, as for data.source")
    weight: float = Field(..., gt=0, description="relative share of the mixture's documents")
    text_column: str | None = Field(None, min_length=1, description="default: data.text_column")
    hf_config: str | None = Field(None, description="default: none")
    split: str | None = Field(None, min_length=1, description="default: data.split")


class DataConfig(Section):
    source: str = Field(
        "embedded",
        description="'embedded' (the Python language reference, a snapshot shipped with the code), 'hf:NAME' (a "
        "Hugging Face dataset, from the local cache when offline), a directory written by save_to_disk, or a file or glob of "
        ".txt, .json, .jsonl, .parquet or .csv files (relative to the project root)",
    )
    text_column: str = Field("text", min_length=1, description="column holding the text in dataset sources")
    hf_config: str | None = Field(None, description="hub dataset configuration (hf: sources)")
    split: str = Field("train", min_length=1, description="split of a hf: source or of a saved DatasetDict")
    streaming: bool = Field(
        False, description="read hub, json/jsonl/parquet/csv and save_to_disk sources lazily as an IterableDataset "
        "(datasets' streaming mode: no Arrow cache, max_samples stops reading early)")
    mixture: list[MixtureSource] = Field(
        default_factory=list, description="weighted mixture of sources, e.g. [{source: a.jsonl, weight: 3}, "
        "{source: embedded, weight: 1}]; when set, data.source is not read")
    seed: int = Field(0, description="seed of the mixture's document order")
    max_samples: int | None = Field(
        None, gt=0, description="keep only N documents: the first ones of a source, a weighted draw of a mixture")
    normalize: Literal["none", "NFC", "NFKC"] = Field("NFC", description="Unicode normalization while cleaning")
    min_chars: int = Field(1, ge=0, description="cleaning drops documents shorter than this (characters)")
    max_chars: int = Field(100_000, ge=1, description="cleaning drops documents longer than this (characters)")
    min_printable_ratio: float = Field(
        0.95, ge=0, le=1, description="cleaning drops documents with a lower share of printable characters")
    dedup: bool = Field(True, description="drop exact duplicate documents after the validation gate")
    txt_unit: Literal["paragraph", "line", "file"] = Field(
        "paragraph", description="what one document is in a .txt source (and in `ultrathink eval --text-file`): a "
        "blank-line separated paragraph, one line (wikitext style), or the whole file")

    @model_validator(mode="after")
    def _clean_bounds_ordered(self) -> "DataConfig":
        if self.min_chars > self.max_chars:
            raise ValueError(f"min_chars ({self.min_chars}) must not exceed max_chars ({self.max_chars})")
        return self


class ValidateConfig(Section):
    min_rows: int = Field(100, ge=1, description="fewest documents the corpus may have")
    min_length: int = Field(1, ge=0, description="shortest document, in characters")
    max_length: int = Field(100_000, ge=1, description="longest document, in characters")
    length_mostly: float = Field(0.99, gt=0, le=1, description="share of documents that must respect the length bounds")
    max_duplicate_fraction: float = Field(
        0.3, ge=0, le=1, description="largest share of documents that repeat an earlier one, in the source as loaded")
    min_printable_ratio: float = Field(0.95, ge=0, le=1, description="least share of printable characters per document")
    batch_rows: int = Field(10_000, ge=1, description="documents read, checked, cleaned and written at a time: the "
                            "stage's memory follows this, not the corpus size")
    shard_mb: float = Field(128.0, gt=0, description="megabytes of text per shard of the validated corpus")
    executor: Literal["local", "ray"] = Field(
        "local", description="datatrove executor of the gate-and-clean tasks: local processes on this machine, or a "
        "Ray cluster (pip install ray; RAY_ADDRESS names the cluster, else a local one is started)")
    tasks: int | None = Field(None, ge=1, description="tasks the corpus's parts (one per file of a glob) are dealt "
                              "to (at most one per part); null: four per worker")
    workers: int | None = Field(None, ge=1, description="tasks run at once; null: all cores (local) or all tasks (ray)")

    @model_validator(mode="after")
    def _bounds_ordered(self) -> "ValidateConfig":
        if self.min_length > self.max_length:
            raise ValueError(f"min_length ({self.min_length}) must not exceed max_length ({self.max_length})")
        return self


class TokenizerConfig(Section):
    pretrained: str | None = Field(
        None, min_length=1, description="a Hugging Face model or tokenizer directory (tokenizer.json, "
        "tokenizer_config.json): its tokenizer is taken as it is (vocabulary, special tokens, BOS/EOS convention, "
        "chat template) instead of training one; the other tokenizer keys are then unused. null: train a BPE")
    vocab_size: int | Literal["auto"] = Field(
        4096, description="BPE vocabulary size, special tokens included (at least 300; above 65,535 the token "
        "files hold uint32 ids); auto: from the corpus size and train.budget, about half the square root of its "
        "bytes, the whole root for a budget of a minute or 1.5M tokens or more, 1.5 times it for a time budget "
        "of a minute or more that trains in fp32 (ultrathink/tokenizer.py: auto_vocab_size)")
    min_frequency: int = Field(2, ge=1, description="least count for a merge to be learned")

    @model_validator(mode="after")
    def _vocab_in_range(self) -> "TokenizerConfig":
        if self.vocab_size != "auto" and not 300 <= self.vocab_size <= MAX_VOCAB:
            raise ValueError(f"vocab_size ({self.vocab_size}) must be between 300 and {MAX_VOCAB:,}, or auto")
        return self


class PrepareConfig(Section):
    val_fraction: float = Field(0.1, gt=0, lt=1, description="share of documents held out for validation")
    batch_size: int = Field(1000, ge=1, description="documents tokenized per batch")
    split: Literal["hash", "tail"] = Field(
        "hash", description="hash: a document's split follows from a hash of its text; tail: the last val_fraction "
        "of the corpus (by characters, cut at a line start inside the straddling document) is val")
    workers: int | None = Field(None, ge=1, description="tokenizer processes (default: all cores; 1: in-process)")
    shard_tokens: int = Field(1 << 28, ge=1, description="tokens per file of a split (train-00000.bin, ...); a file "
                              "ends at a document's end, so it may hold a little more")
    report_dir: str = Field("reports/prepare", min_length=1,
                            description="token-level checks of the packed files: token_report.json and .html")


class ConstitutionConfig(Section):
    path: str | None = Field(
        "constitution.yaml", description="YAML file of principles (detectors + redact/drop/flag action) applied "
        "while cleaning and checked on the cleaned corpus; null: none")


class MoEGroups(Section):
    """Experts per named group. One router chooses among all experts; a group is a contiguous range of expert ids
    (in this order) whose routing health is reported together. What each group specialises in is learned, not forced."""

    knowledge: int = Field(3, ge=0)
    skill: int = Field(3, ge=0)
    meta: int = Field(1, ge=0)
    safety: int = Field(1, ge=0)


class VariantConfig(Section):
    """A model variant's section (model.moe, model.dre, ...): the RoutingModule class registered for it
    (ultrathink/model/routing.py: implements) builds it into the blocks it `applies_to`. A new variant is its own
    file plus a section like these in ModelConfig."""

    def applies_to(self, layer: int) -> bool:
        return self.enabled and (layer + 1) % self.every == 0


class MoEConfig(VariantConfig):
    enabled: bool = Field(False, description="replace the MLP of every `every`-th block with a sparse MoE layer")
    every: int = Field(2, ge=1, description="MoE in blocks every, 2·every, ... (counting from 1); 1: every block")
    top_k: int = Field(2, ge=1, description="experts each token is routed to")
    groups: MoEGroups = MoEGroups()
    expert_hidden: int | None = Field(None, ge=1, description="each expert's SwiGLU width; default model's hidden")
    capacity_factor: float | None = Field(
        1.25, gt=0, description="training only: an expert takes at most factor·tokens·top_k/experts tokens, the "
        "rest of its tokens keep only the residual (earlier positions first); null: dropless. Eval is dropless")
    aux_loss_weight: float = Field(0.01, ge=0, description="weight of the Switch load-balancing loss")
    z_loss_weight: float = Field(0.001, ge=0, description="weight of the router z-loss (mean logsumexp²)")
    bias_balancing: bool = Field(
        False, description="aux-loss-free balancing (DeepSeek-V3): a per-expert bias added to the scores that "
        "choose experts (not to their weights), nudged after each optimizer step toward equal load")
    bias_update_rate: float = Field(0.001, gt=0, description="bias change per optimizer step")

    @property
    def n_experts(self) -> int:
        return sum(self.groups.model_dump().values())

    @model_validator(mode="after")
    def _top_k_fits(self) -> "MoEConfig":
        if self.enabled and not self.top_k <= self.n_experts:
            raise ValueError(f"top_k ({self.top_k}) must not exceed the number of experts ({self.n_experts})")
        return self


class DREConfig(VariantConfig):
    """Dynamic Reasoning Engine: Mixture-of-Depths routing (ultrathink/model/dre.py)."""

    enabled: bool = Field(False, description="route tokens around every `every`-th block (Mixture-of-Depths)")
    every: int = Field(2, ge=1, description="routed blocks: every, 2·every, ... (counting from 1)")
    path: Literal["fast", "standard", "deep"] = Field(
        "standard", description="share of tokens a routed block processes: fast 25%, standard 50%, deep 75%")
    force_path: Literal["fast", "standard", "deep"] | None = Field(
        None, description="at inference (eval mode) use this path instead of `path`; null: `path`")
    warmup_steps: int = Field(30, ge=0, description="optimizer steps at full capacity before routing starts")
    aux_loss_weight: float = Field(
        0.1, ge=0, description="weight of the router's BCE toward top-capacity membership (keeps the threshold "
        "at its share of tokens)")


class RopeScaling(Section):
    """Rotary frequencies stretched for a longer context, as an imported model was trained (Hugging Face's
    rope_scaling): llama3 (Llama 3.1+: low frequencies divided by `factor`, high ones kept, a smooth ramp between)
    or linear (every frequency divided by `factor`)."""

    type: Literal["llama3", "linear"]
    factor: float = Field(..., gt=0)
    low_freq_factor: float = Field(1.0, gt=0, description="llama3 only")
    high_freq_factor: float = Field(4.0, gt=0, description="llama3 only")
    original_max_position_embeddings: int = Field(8192, ge=1, description="llama3 only: the context before scaling")


MANUAL_SHAPE = {"d_model": 192, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "seq_len": 128}
# What else fixes the computation a set of weights was trained for (a parent's config must agree on these).
ARCHITECTURE_KEYS = ("rope_theta", "rope_scaling", "qkv_bias", "qk_norm", "tie_embeddings", "norm_eps")


class ModelConfig(Section):
    size: Literal["manual", "auto"] = Field(
        "manual", description="who sets the shape keys left null (d_model, n_layers, n_heads, n_kv_heads, seq_len, "
        "and train.batch_size): manual = 192, 4, 4, 2, 128 and 16; auto = the rule of ultrathink/train/sizing.py "
        "from train.budget and the corpus. Keys set to a number always win")
    d_model: int | None = Field(None, ge=8, description="residual stream width")
    n_layers: int | None = Field(None, ge=1)
    n_heads: int | None = Field(None, ge=1)
    n_kv_heads: int | None = Field(None, ge=1, description="key/value heads (grouped-query attention); must divide "
                                   "n_heads")
    ffn_hidden: int | None = Field(None, ge=1, description="SwiGLU hidden width; default 8/3·d_model rounded up to 64")
    seq_len: int | None = Field(None, ge=8, description="context length")
    rope_theta: float = Field(10000.0, gt=0)
    rope_scaling: RopeScaling | None = Field(None, description="null: plain RoPE (see RopeScaling)")
    qkv_bias: bool = Field(False, description="biases on the query, key and value projections (Qwen2's layout)")
    tie_embeddings: bool = Field(True, description="the output projection is the token embedding (false: a "
                                 "separate lm_head matrix, as Llama 2/3 8B and TinyLlama have)")
    norm_eps: float = Field(1e-5, gt=0)
    qk_norm: bool = Field(True, description="RMSNorm on every head's queries and keys before RoPE (Qwen3's "
                          "layout; exported as Qwen3): measured better at equal wall-clock on every corpus "
                          "(benchmarks/README.md); false: Llama's attention")
    dropout: float | None = Field(None, ge=0, lt=1, description="dropout on attention and on each block's two "
                                  "outputs. null: 0 with size manual; with size auto, 0.1 where the sizing's loss "
                                  "law predicts it pays at the chosen shape (ultrathink/train/sizing.py: "
                                  "with_dropout): off for a few passes over the corpus, where it only costs steps, "
                                  "on for many, where the model overfits without it. Beside a weight decay of 1.0 "
                                  "or more (train.weight_decay null plans it for many passes), which regularises "
                                  "better, 0.2 only for a model of many parameters per token (30 or more), else "
                                  "none, however many passes (benchmarks/README.md)")
    init_std: float = Field(0.02, gt=0)
    moe: MoEConfig = MoEConfig()
    dre: DREConfig = DREConfig()

    @model_validator(mode="before")
    @classmethod
    def _manual_shape(cls, data):
        if isinstance(data, dict) and data.get("size", "manual") == "manual":
            manual = {**MANUAL_SHAPE, "dropout": 0.0}
            data = {**data, **{k: v for k, v in manual.items() if data.get(k) is None}}
        return data

    def set_by_user(self) -> dict[str, object]:
        """The architecture keys whose value is not their default (the manual shape's for the shape keys): what a
        warm start from an open model must find in the parent's config (the keys at their defaults follow it)."""
        fields = type(self).model_fields
        defaults = {k: MANUAL_SHAPE.get(k, fields[k].default) for k in (*MANUAL_SHAPE, "ffn_hidden", *ARCHITECTURE_KEYS)}
        return {k: getattr(self, k) for k, default in defaults.items() if getattr(self, k) != default}

    @property
    def resolved(self) -> bool:
        """Every shape key and dropout have a value (size manual, or size auto after ultrathink/train/sizing.py
        chose)."""
        return all(getattr(self, k) is not None for k in (*MANUAL_SHAPE, "dropout"))

    @model_validator(mode="after")
    def _heads_fit(self) -> "ModelConfig":
        if any(getattr(self, k) is None for k in MANUAL_SHAPE):
            return self  # sizing checks the shapes it chooses (with the keys that are set)
        if self.d_model % self.n_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must divide d_model ({self.d_model})")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_kv_heads ({self.n_kv_heads}) must divide n_heads ({self.n_heads})")
        if (self.d_model // self.n_heads) % 2:
            raise ValueError("head size d_model/n_heads must be even for rotary embeddings")
        if any(self.moe.applies_to(i) and self.dre.applies_to(i) for i in range(self.n_layers)):
            # A routed block pads its rows of selected tokens; an MoE layer inside would route the padding too.
            raise ValueError("moe and dre must not apply to the same block (change moe.every or dre.every)")
        return self

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def variants(self) -> list[VariantConfig]:
        """The enabled variant sections (model.moe, model.dre, ...), in field order."""
        sections = (getattr(self, name) for name in type(self).model_fields)
        return [s for s in sections if isinstance(s, VariantConfig) and s.enabled]

    @property
    def hidden(self) -> int:
        return self.ffn_hidden or 64 * -(-(8 * self.d_model // 3) // 64)


class DeepSpeedConfig(Section):
    """train.backend: deepspeed. The DeepSpeed JSON config is generated from these and the other train.* keys
    (micro batch, accumulation, clipping, precision): nothing to keep in step by hand."""

    zero_stage: int = Field(2, ge=1, le=3, description="ZeRO stage: 1 shards optimizer state, 2 also gradients, "
                            "3 also parameters")
    offload_optimizer: bool = Field(False, description="keep optimizer state (and its step) in CPU memory")
    offload_params: bool = Field(False, description="ZeRO-3 only: keep parameters in CPU memory between uses")

    @model_validator(mode="after")
    def _offload_params_needs_stage_3(self) -> "DeepSpeedConfig":
        if self.offload_params and self.zero_stage != 3:
            raise ValueError(f"offload_params needs zero_stage 3 (got {self.zero_stage})")
        return self


SHARDED_BACKENDS = ("fsdp", "deepspeed")  # their ranks hold parameters in shards: no rank has each whole tensor


class TrainConfig(Section):
    seed: int = 1337
    batch_size: int | None = Field(16, ge=1, description="sequences per micro-batch; null: 16, or chosen by "
                                   "model.size auto")
    grad_accum: int = Field(1, ge=1, description="micro-batches per optimizer step")
    max_steps: int = Field(300, ge=1, description="optimizer steps (unless train.budget is set)")
    budget: str | None = Field(
        None, description="what the run may spend, instead of max_steps: wall-clock time (90s, 2min, 1.5h: the "
        "steps follow from a throughput probe at the start), tokens (2e7tokens) or FLOPs (1e15flops); resolved "
        "once per configuration and recorded (plan.json beside its checkpoints, MLflow plan.* params)")
    lr: float = Field(2e-3, gt=0, le=1, description="peak learning rate")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="final learning rate as a share of lr")
    warmup_steps: int = Field(30, ge=0)
    warmup_fraction: float | None = Field(
        None, ge=0, le=0.5, description="warmup as a share of the run's steps, replacing warmup_steps (so it "
        "follows a budget)")
    seq_len_warmup: float | None = Field(
        None, ge=0, lt=1, description="short contexts first: over this share of the planned steps each window of "
        "model.seq_len is read as 4 windows of a quarter of it (the first half), then 2 of half (the same tokens "
        "per step, in cheaper steps); 0: whole windows from the start. null: decided by the run's plan from the "
        "epochs it trains (ultrathink/train/sizing.py: seq_len_warmup_for): 0.3 for a run that sees its corpus about "
        "8 times or more, where it measured better, else 0 (it measured worse on corpora read 2 to 7.7 times: "
        "benchmarks/README.md), and 0 when the run compiles (each context length is another compile). "
        "Pretraining only")
    weight_decay: float | None = Field(
        None, ge=0, description="AdamW's (and Lion's, Muon's) decoupled decay on the hidden matrices, not on norms "
        "or embeddings. null: decided by the run's plan from the epochs it trains (ultrathink/train/sizing.py: "
        "weight_decay_for): 0.1, or 1.0 for a run that sees its corpus about 5 times or more, where the stronger "
        "decay measured better at no cost per step, and better than dropout (benchmarks/README.md)")
    beta1: float = Field(
        0.8, ge=0, lt=1, description="AdamW's (and Lion's) first-moment decay in pretraining (fine-tuning and "
        "alignment have their own: finetune.beta1, align.beta1). 0.8 (modded-nanogpt's) measured better "
        "than 0.9 at equal steps in 9 of 9 pairs on three corpora and through the 2-minute plans by 0.010 on average "
        "(13 pairs, 9 better; benchmarks/README.md)")
    beta2: float = Field(0.95, ge=0, lt=1)
    grad_clip: float = Field(1.0, ge=0, description="clip the global gradient norm to this; 0 turns clipping off")
    optimizer: Literal["adamw", "lion", "muon"] = Field(
        "adamw", description="muon: Muon on 2-D hidden matrices, AdamW on embeddings and norms")
    schedule: Literal["cosine", "linear", "constant", "wsd"] = Field(
        "wsd", description="after warmup; wsd = warmup-stable-decay (the default: it beat cosine for AdamW, Muon and "
        "Lion at equal wall-clock on both corpora measured, benchmarks/README.md)")
    decay_fraction: float = Field(0.2, gt=0, le=1, description="wsd: share of steps spent decaying at the end")
    max_bad_steps: int = Field(
        5, ge=1, description="consecutive non-finite loss/gradient steps (each skipped) before the run stops")
    decay_patience: int | None = Field(
        2, ge=1, description="wsd: once this many validation passes in a row have not improved on the best, "
        "while the run reads its corpus a second time or more, go back to the best pass's checkpoint (weights, "
        "optimizer, data position) and begin the decay there; the decay takes decay_fraction of the steps up to "
        "there and the run ends after it (its log line and train_summary.json's decay_began say where). It measured "
        "0.08-0.14 bits/byte better (means over 3 seeds) on 50 KB corpora planned for 19 epochs, and does not act "
        "on runs whose validation keeps improving (benchmarks/README.md). 2, not 1: with beta1 0.8 the validation "
        "at the peak rate wanders more, and one pass without gain began the decay early in 3 of 6 runs on tiny "
        "Shakespeare. null: the decay begins where max_steps puts it. Pretraining only")
    early_stopping_patience: int | None = Field(
        None, ge=1, description="stop after this many validations without improvement; the best model is kept")
    gradient_checkpointing: bool = Field(
        False, description="recompute each block's activations in backward: less memory, ~1/3 more compute")
    compile: bool | Literal["auto"] = Field(
        "auto", description="torch.compile the model for training (the first steps pay the compile); auto: only "
        "with a train.budget whose measured eager run takes 10 minutes or more (2 on a GPU), for a model without "
        "routing variants, and on a CPU only where Inductor can build the step (a C++ compiler, $CXX or g++, and "
        "the Python headers); true without them is refused before training (ultrathink/train/budget.py: "
        "compile_pays)")
    backend: Literal["auto", "ddp", "fsdp", "deepspeed"] = Field(
        "auto", description="under torchrun: ddp (DistributedDataParallel), fsdp (FSDP2 fully_shard) or deepspeed "
        "(ZeRO, see train.deepspeed; also in one process); auto = ddp under torchrun, plain in one process")
    deepspeed: DeepSpeedConfig = DeepSpeedConfig()
    precision: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto", description="auto: bf16 autocast where this hardware runs it faster than fp32 (measured), else fp32; "
        "fp16: autocast with loss scaling (for GPUs without bf16)")
    attention: Literal["auto", "torch", "flash", "math", "matmul"] = Field(
        "auto", description="the attention kernel: auto = the fastest for this run's shape, measured at the start "
        "on a CPU (flash or math, in the autocast dtype or fp32, or matmul under autocast), torch's own choice on "
        "a GPU; torch = "
        "torch's choice; flash or math = that kernel of torch's; matmul = two matmuls and a softmax in the "
        "autocast dtype (bf16 matmuls on a CPU, where torch's kernels compute in fp32)")
    eval_every: int = Field(100, ge=1, description="steps between validation passes")
    eval_batches: int = Field(10, ge=1, description="validation micro-batches per pass")
    checkpoint_every: int = Field(100, ge=1)
    keep_checkpoints: int = Field(2, ge=1, description="how many of the latest checkpoints to keep")
    log_every: int = Field(10, ge=1, description="steps between step lines and MLflow metric points")
    keep_configs: int = Field(
        5, ge=1, description="checkpoint folders kept under paths.checkpoint_dir, one per configuration (params, "
        "data, code, parent): the least recently used beyond this many are removed, never the current one")
    resume: bool = Field(True, description="resume from the latest checkpoint of this exact configuration "
                         "(false: start over in it; checkpoints of other configurations are always kept)")
    threads: int | None = Field(None, ge=1, description="torch CPU threads (default: all cores)")
    init_from: str | None = Field(
        None, description="warm start: the weights to begin from: a model dir (artifacts/model), a checkpoint dir "
        "(artifacts/checkpoints/<config>/step_N or best), or an MLflow model URI (models:/ultrathink@champion, "
        "models:/ultrathink/3, runs:/ID/model); null: random init. Architecture and tokenizer must match")
    init_optimizer: bool = Field(
        False, description="warm start from a checkpoint: also load its optimizer state (same optimizer and "
        "shapes); the learning-rate schedule is always this run's")
    embedding_init: Literal["corpus", "normal"] = Field(
        "corpus", description="a fresh model's token embedding (and a tied output): corpus = its rows from the "
        "training split's statistics, the leading singular directions of the positive PMI of neighbouring tokens "
        "at model.init_std (ultrathink/train/embedding_init.py; 0.002-0.021 bits/byte better held out through the "
        "2-minute plans on three corpora, at every seed: benchmarks/README.md); normal = drawn at random like every "
        "other weight. A warm start (init_from) keeps its parent's")
    deterministic: bool = Field(
        False, description="torch.use_deterministic_algorithms(True) (and CUBLAS_WORKSPACE_CONFIG=:4096:8, cuDNN "
        "autotuning off): bitwise repeatable runs on a GPU, at some speed; CPU kernels are deterministic already")
    tensorboard: bool = Field(
        False, description="also write every step's metrics (loss, lr, gradient norm, throughput, routing health) "
        "as TensorBoard scalars, to paths.tensorboard_dir/<MLflow run id>")
    select: Literal["best", "last"] = Field(
        "best", description="which weights become paths.model_dir: best = the checkpoint with the lowest "
        "validation loss (validation runs every eval_every steps and at the last step), last = the final step's")
    ema_horizon: float | None = Field(
        None, ge=0, lt=1, description="keep an exponential moving average of the weights over about this share of "
        "the run's last steps, validate it once at the end and make it the model where it validates better than "
        "the weights train.select picked; 0: off. null: 0.08 on one process and under DDP (it measured 0.004-0.05 "
        "bits/byte better on three corpora: benchmarks/README.md), off under FSDP and DeepSpeed, whose ranks hold "
        "the weights in shards (ultrathink/train/averaging.py). Pretraining only")
    calibrate: bool = Field(
        True, description="after pretraining, fit the output's temperature to the logits of one validation pass "
        "and fold it into the final norm's gain in paths.model_dir (up to 0.0073 bits/byte better held out, never "
        "worse, through the 2-minute plans on three corpora: benchmarks/README.md; ultrathink/train/calibration.py). "
        "Pretraining only")


    @field_validator("budget", mode="before")
    @classmethod
    def _budget_parses(cls, budget):
        if budget is not None:
            Budget.parse(str(budget))  # a bare number (YAML reads 120 as one) is refused: it has no unit
        return budget

    @model_validator(mode="after")
    def _warmup_fits(self) -> "TrainConfig":
        if self.budget is None and self.warmup_fraction is None and self.warmup_steps > self.max_steps:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) must not exceed max_steps ({self.max_steps})")
        return self

    @model_validator(mode="after")
    def _init_optimizer_needs_parent(self) -> "TrainConfig":
        if self.init_optimizer and not self.init_from:
            raise ValueError("init_optimizer needs init_from (a checkpoint dir to take the optimizer state from)")
        return self

    @model_validator(mode="after")
    def _deepspeed_supports(self) -> "TrainConfig":
        if self.backend != "deepspeed":
            return self
        if self.init_optimizer:
            raise ValueError("init_optimizer is not supported with backend deepspeed (its optimizer state is "
                             "sharded per rank); warm start the weights only")
        if self.optimizer == "muon":
            raise ValueError("optimizer muon needs whole 2-D matrices, which DeepSpeed's ZeRO flattens and shards; "
                             "use adamw or lion with backend deepspeed")
        if self.compile is True:
            raise ValueError("compile is not supported with backend deepspeed (DeepSpeed wraps the model itself)")
        return self

    @model_validator(mode="after")
    def _average_needs_whole_weights(self) -> "TrainConfig":
        if self.ema_horizon and self.backend in SHARDED_BACKENDS:
            raise ValueError(f"ema_horizon is not supported with backend {self.backend} (its ranks hold the weights "
                             "in shards); set it to null or 0")
        return self


class EvaluateConfig(Section):
    batch_size: int = Field(16, ge=1)
    max_val_bytes: int | None = Field(
        None, ge=1, description="score only the first validation documents up to this many UTF-8 bytes (whole "
        "documents, at least one); null: the whole val split. The same text is promotion's yardstick")
    prompts: list[str] = Field(default_factory=lambda: ["The", "A class"], description="prompts for sample generations")
    max_new_tokens: int = Field(48, ge=1)
    temperature: float = Field(0.8, ge=0, description="0 means greedy")
    top_k: int | None = Field(50, ge=1)
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling: sample among the most likely tokens that "
                         "hold this share of the probability; 1 = no cut")
    seed: int = 0
    tasks: list[str] = Field(
        default_factory=lambda: ["heldout_continuation"], description="downstream tasks run through "
        "lm-evaluation-harness: registered lm-eval names (their datasets must be in the Hugging Face cache: runs "
        "are offline), or paths of task YAML files in lm-eval's format under eval_tasks/ (local data files); "
        "heldout_continuation is built from the val documents (ultrathink/downstream.py); [] runs none")
    task_limit: int | None = Field(None, ge=1, description="at most this many examples per task (quick runs); "
                                   "null: all")

    @field_validator("tasks")
    @classmethod
    def _tasks_unique(cls, tasks: list[str]) -> list[str]:
        repeated = sorted({t for t in tasks if tasks.count(t) > 1})
        if repeated:
            raise ValueError(f"listed more than once: {', '.join(repeated)}")
        return tasks


class LoraSettings(Section):
    """Low-rank adapters (PEFT's LoRA) on the named linear layers; merged into the weights for export."""

    r: int = Field(8, ge=1, description="rank of each adapter")
    alpha: float = Field(16.0, gt=0, description="scale: the adapter's update is multiplied by alpha / r")
    dropout: float = Field(0.05, ge=0, lt=1, description="dropout on the adapter's input while training")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        min_length=1, description="linear layers that get an adapter, by name (attention: q_proj k_proj v_proj "
        "o_proj; MLP and experts: gate_proj up_proj down_proj)")


class FinetuneConfig(Section):
    """Supervised fine-tuning on prompt/response pairs, after pretraining (stages finetune and promote_finetuned)."""

    enabled: bool = Field(False, description="run the finetune and promote_finetuned stages (off: they record "
                          "that they are off and do nothing)")
    init_from: str = Field(
        "champion", min_length=1, description="the pretrained model: champion (registry.model_name's champion, "
        "pinned to its version when the stage runs), an MLflow model URI, or a model dir (artifacts/model)")
    data: str = Field(
        "embedded", min_length=1, description="embedded (question/answer pairs from the Python language reference "
        "that pretraining reads) or a .jsonl file of pairs, relative to the project root (data/finetune/ is a "
        "dependency of the stage)")
    prompt_field: str = Field("prompt", min_length=1, description="field of a JSONL row holding the prompt")
    response_field: str = Field("response", min_length=1, description="field of a JSONL row holding the answer")
    messages_field: str = Field(
        "messages", min_length=1, description="field holding a chat instead: a list of {role, content} with roles "
        "system, user, assistant, ending with an assistant message (every assistant turn is trained)")
    val_fraction: float = Field(0.1, gt=0, lt=1, description="share of pairs held out (by a hash of the prompt) "
                                "for the response-only loss and promotion")
    min_pairs: int = Field(20, ge=2, description="fewest pairs the data may have")
    max_prompt_chars: int = Field(2000, ge=1, description="longest prompt (all turns before the last answer)")
    max_response_chars: int = Field(2000, ge=1, description="longest answer")
    method: Literal["lora", "full"] = Field("lora", description="lora: train adapters only (PEFT); full: every weight")
    lora: LoraSettings = LoraSettings()
    quantize: Literal["int8", "nf4"] | None = Field(
        None, description="LoRA on a quantized frozen base (QLoRA): int8 (8-bit weights, a quarter of fp32's memory) "
        "or nf4 (4-bit NormalFloat, an eighth), through torchao, on a CPU or a GPU; the adapters are merged into "
        "the dequantized weights, so the result is a plain model. null: the base as it is")
    max_steps: int = Field(60, ge=1, description="optimizer steps (embedded pairs on the default model: the held-out "
                           "answer loss is lowest near 60 at lr 2e-3; 150 overfits, the best checkpoint is kept)")
    batch_size: int = Field(16, ge=1, description="pairs per step (each padded to model.seq_len)")
    lr: float = Field(2e-3, gt=0, le=1, description="peak learning rate")
    warmup_steps: int = Field(10, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    beta1: float = Field(0.9, ge=0, lt=1, description="AdamW's first-moment decay here (fine-tuning's own; its other "
                         "optimizer settings are train.*'s). Pretraining's train.beta1 of 0.8 scored the held-out "
                         "answers 0.0045 nats worse than 0.9, on 3 of 3 seeds (benchmarks/post_training_quality.py, "
                         "benchmarks/README.md)")
    schedule: Literal["cosine", "linear", "constant", "wsd"] = Field("cosine")
    eval_every: int = Field(20, ge=1, description="steps between validation passes on the held-out pairs (the best "
                            "pass's weights are the result)")
    seed: int = Field(0, description="seed of the pair order, the adapters' init and dropout")
    samples: int = Field(3, ge=0, description="held-out prompts answered (greedy) by the model before and after, "
                         "in the report")

    @model_validator(mode="after")
    def _quantize_needs_lora(self) -> "FinetuneConfig":
        if self.quantize and self.method != "lora":
            raise ValueError(f"quantize {self.quantize} freezes a quantized base under LoRA adapters: it needs "
                             "method lora (full fine-tuning trains every weight)")
        return self

    @model_validator(mode="after")
    def _bounds(self) -> "FinetuneConfig":
        if self.warmup_steps > self.max_steps:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) must not exceed max_steps ({self.max_steps})")
        return self


class AlignConfig(Section):
    """Preference alignment after fine-tuning: Direct Preference Optimization on (prompt, chosen, rejected) pairs
    (stages align and promote_aligned)."""

    enabled: bool = Field(False, description="run the align and promote_aligned stages (off: they record that they "
                          "are off and do nothing)")
    init_from: str = Field(
        "champion", min_length=1, description="the model to align, which is also the frozen reference: champion "
        "(registry.finetuned_name's champion, pinned to its version when the stage runs), an MLflow model URI, or a "
        "model dir holding model/ and tokenizer/ (artifacts/finetuned)")
    data: str = Field(
        "embedded", min_length=1, description="embedded (the fine-tuning questions, each with its own answer chosen "
        "over another section's answer) or a .jsonl file of pairs, relative to the project root (data/align/ is a "
        "dependency of the stage)")
    prompt_field: str = Field("prompt", min_length=1, description="field of a JSONL row holding the prompt: text, "
                              "or the chat's messages before the answer; absent when chosen and rejected are whole "
                              "chats that share everything but their last (assistant) message")
    chosen_field: str = Field("chosen", min_length=1, description="field holding the preferred answer: text, or a "
                              "chat ending with an assistant message")
    rejected_field: str = Field("rejected", min_length=1, description="field holding the dispreferred answer")
    loss: Literal["sigmoid", "hinge", "ipo"] = Field(
        "sigmoid", description="sigmoid: DPO (Rafailov et al. 2023); hinge: SLiC; ipo: IPO (Azar et al. 2023)")
    beta: float = Field(0.1, gt=0, description="strength of the pull toward the reference (DPO's β): smaller lets "
                        "the model move further from it")
    val_fraction: float = Field(0.15, gt=0, lt=1, description="share of pairs held out (by a hash of the chosen "
                                "answer, as fine-tuning splits) for preference accuracy and promotion")
    min_pairs: int = Field(20, ge=2, description="fewest pairs the data may have")
    max_prompt_chars: int = Field(2000, ge=1, description="longest prompt (all turns before the answer)")
    max_answer_chars: int = Field(2000, ge=1, description="longest chosen or rejected answer")
    method: Literal["lora", "full"] = Field("lora", description="lora: train adapters only (PEFT); full: every weight")
    lora: LoraSettings = LoraSettings()
    max_steps: int = Field(150, ge=1, description="optimizer steps (embedded pairs on the default model: at 150 and "
                           "lr 2e-3 the held-out implicit rewards rank 72% of pairs right; at 40 none moved)")
    batch_size: int = Field(8, ge=1, description="pairs per step (each answer padded to model.seq_len)")
    lr: float = Field(2e-3, gt=0, le=1, description="peak learning rate")
    warmup_steps: int = Field(10, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    beta1: float = Field(0.8, ge=0, lt=1, description="AdamW's first-moment decay here (alignment's own; its other "
                         "optimizer settings are train.*'s). 0.9 scored the held-out preference loss 0.47 bits worse "
                         "than 0.8, on 3 of 3 seeds (benchmarks/post_training_quality.py, benchmarks/README.md)")
    schedule: Literal["cosine", "linear", "constant", "wsd"] = Field("cosine")
    eval_every: int = Field(30, ge=1, description="steps between validation passes on the held-out pairs (the best "
                            "pass's weights, by preference loss, are the result)")
    seed: int = Field(0, description="seed of the pair order, the adapters' init and dropout")
    samples: int = Field(3, ge=0, description="held-out prompts answered (greedy) before and after, in the report")

    @model_validator(mode="after")
    def _bounds(self) -> "AlignConfig":
        if self.warmup_steps > self.max_steps:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) must not exceed max_steps ({self.max_steps})")
        return self


class RegistryConfig(Section):
    """Champion decisions compare bits per byte on one text (the challenger's validation text, each model under its
    own tokenizer): the only measure that stays comparable across tokenizers and data."""

    model_name: str = Field("ultrathink", min_length=1, description="registered model name in MLflow")
    finetuned_name: str = Field("ultrathink-chat", min_length=1, description="registered name of the fine-tuned "
                                "models (their champion is judged on held-out pairs, response tokens only)")
    aligned_name: str = Field("ultrathink-aligned", min_length=1, description="registered name of the aligned "
                              "models (their champion is judged on held-out preference pairs)")
    experiment: str = Field("ultrathink", min_length=1)
    task_guard: dict[str, float] = Field(
        default_factory=dict, description="{task: max_drop} or {task/metric: max_drop}: a challenger that beats the "
        "champion on bits per byte is still refused if its score on a listed task of evaluate.tasks (its first "
        "metric, or the one named) is worse than the champion's by more than max_drop, both scored on the "
        "challenger's task data under their own code; {}: bits per byte alone")

    @field_validator("task_guard")
    @classmethod
    def _drops_not_negative(cls, guard: dict[str, float]) -> dict[str, float]:
        negative = [k for k, v in guard.items() if not v >= 0]
        if negative:
            raise ValueError(f"max_drop must be 0 or more (got {', '.join(f'{k}: {guard[k]}' for k in negative)})")
        return guard


class LaunchConfig(Section):
    """How many processes the train stage runs on. It starts its own ranks through PyTorch's elastic launcher (the
    API behind torchrun), so `dvc repro`, `ultrathink run`, `ultrathink stage train` and the Prefect deployment use
    them with no edit of dvc.yaml. No fingerprint holds these: a checkpoint resumes on any number of ranks."""

    nproc_per_node: int = Field(1, ge=1, description="processes on this machine (one per GPU; on a CPU, gloo)")
    nnodes: int = Field(1, ge=1, description="machines; each runs the stage with its own launch.node_rank")
    node_rank: int | None = Field(None, ge=0, description="this machine's place among launch.nnodes (a static "
                                  "rendezvous at launch.rdzv_endpoint); null: assigned by the c10d rendezvous")
    rdzv_endpoint: str | None = Field(None, description="host:port that every machine reaches (launch.nnodes > 1); "
                                      "null on one machine: 127.0.0.1 on a free port")
    max_restarts: int = Field(0, ge=0, description="times the ranks are all restarted after one fails; each "
                              "restart resumes from the last checkpoint")

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    @model_validator(mode="after")
    def _nodes_meet(self):
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ValueError("launch.nnodes > 1 needs launch.rdzv_endpoint (host:port every machine reaches)")
        if self.node_rank is not None and self.node_rank >= self.nnodes:
            raise ValueError(f"launch.node_rank {self.node_rank} must be below launch.nnodes {self.nnodes}")
        return self


class LoggingConfig(Section):
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        "INFO", description="the least severe of our own log lines shown on stderr and written to the stage's log "
        "file (paths.logs_dir/<stage>.log)")


class Params(Section):
    paths: PathsConfig = PathsConfig()
    data: DataConfig = DataConfig()
    validate_: ValidateConfig = Field(ValidateConfig(), alias="validate")
    tokenizer: TokenizerConfig = TokenizerConfig()
    prepare: PrepareConfig = PrepareConfig()
    constitution: ConstitutionConfig = ConstitutionConfig()
    model: ModelConfig = ModelConfig()
    train: TrainConfig = TrainConfig()
    evaluate: EvaluateConfig = EvaluateConfig()
    finetune: FinetuneConfig = FinetuneConfig()
    align: AlignConfig = AlignConfig()
    registry: RegistryConfig = RegistryConfig()
    launch: LaunchConfig = LaunchConfig()
    logging: LoggingConfig = LoggingConfig()

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    @model_validator(mode="before")
    @classmethod
    def _manual_batch(cls, data):
        """train.batch_size null (or, under model.size auto, absent) is chosen by the sizing rule under model.size
        auto, else 16."""
        if not isinstance(data, dict):
            return data
        model, train = data.get("model") or {}, data.get("train") or {}
        size = model.get("size", "manual") if isinstance(model, dict) else model.size
        if isinstance(train, dict) and size == "auto" and "batch_size" not in train:
            return {**data, "train": {**train, "batch_size": None}}
        batch = train.get("batch_size", 16) if isinstance(train, dict) else train.batch_size
        if batch is None and size != "auto":
            data = {**data, "train": {**train, "batch_size": 16}}
        return data

    @model_validator(mode="after")
    def _auto_size_needs_budget(self) -> "Params":
        if self.model.size == "auto" and self.train.budget is None:
            raise ValueError("model.size auto sizes the model for a budget: set train.budget (e.g. 2min, 2e7tokens, "
                             "1e15flops)")
        return self

    @model_validator(mode="after")
    def _finetuned_name_differs(self) -> "Params":
        if self.registry.finetuned_name == self.registry.model_name:
            raise ValueError("registry.finetuned_name must differ from registry.model_name: fine-tuned models are "
                             "judged on other text (held-out pairs) than pretrained ones")
        return self

    @model_validator(mode="after")
    def _aligned_name_differs(self) -> "Params":
        if self.registry.aligned_name in (self.registry.model_name, self.registry.finetuned_name):
            raise ValueError("registry.aligned_name must differ from registry.model_name and registry.finetuned_name: "
                             "aligned models are judged on other text (held-out preference pairs)")
        return self

    @model_validator(mode="after")
    def _guarded_tasks_run(self) -> "Params":
        named = {t for t in self.evaluate.tasks if "/" not in t and not t.endswith((".yaml", ".yml"))}
        files = len(named) < len(self.evaluate.tasks)  # a task file's name is inside it: checked when it runs
        unknown = [k for k in self.registry.task_guard if k.partition("/")[0] not in named]
        if unknown and not files:
            raise ValueError(f"registry.task_guard names {', '.join(unknown)}, which evaluate.tasks does not run "
                             f"({', '.join(self.evaluate.tasks) or 'none'})")
        return self

    @property
    def validate_cfg(self) -> ValidateConfig:
        return self.validate_
