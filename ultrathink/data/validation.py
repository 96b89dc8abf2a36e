"""Great Expectations checks on the raw corpus, turned into a report a person can act on.

The suite runs in an ephemeral GX context (nothing written to disk, nothing fetched). Two checks need per-document
facts that GX has no expectation for, so they run on helper columns computed here: whether a text repeats an
earlier row, and the share of printable characters in each text. Every check names its rows, so failures can be
traced back to the documents that caused them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass

import great_expectations as gx
import great_expectations.expectations as gxe
import pandas as pd
from great_expectations.data_context.types.base import ProgressBarsConfig

from ultrathink.config import AlignConfig, FinetuneConfig, ValidateConfig
from ultrathink.data.cleaning import printable_ratio
from ultrathink.data.constitution import Principle, violation_column
from ultrathink.errors import StageError
from ultrathink.data.cleaning import SeenHashes

TEXT = "text"
REPEATS = "repeats_earlier_row"  # True/False per text (None for a null one), given or computed by SourceGate
_PRINTABLE = "printable_ratio"
_EXAMPLES = 3
_EXAMPLE_CHARS = 80


@dataclass
class ValidationReport:
    """The outcome of one suite run: one result dict per expectation, in suite order.

    Each result has: name, expectation (the GX type), success, observed (GX's observed value for table/aggregate
    expectations, the share of checked rows that failed, in %, for per-row ones), unexpected_count, checked_rows,
    message (one readable line) and examples (up to 3 failing rows as {"row": index, "text": first 80 chars}).
    """

    success: bool
    n_rows: int
    results: list[dict]
    title: str = "Corpus"  # what was checked: the source as loaded, or the cleaned corpus

    def to_dict(self) -> dict:
        """Plain JSON-serialisable data, for the stage's report file."""
        return asdict(self)

    def summary(self) -> str:
        """A few lines naming each failed expectation, how many rows failed it, and example rows."""
        if self.success:
            return f"{self.title} validation passed ({len(self.results)} expectations, {self.n_rows} rows)"
        failed = [r for r in self.results if not r["success"]]
        lines = [f"{self.title} validation FAILED ({len(failed)} of {len(self.results)} expectations, {self.n_rows} rows):"]
        for result in failed:
            lines.append(f" - {result['name']}: {result['message']}")
            if result["examples"]:
                shown = "; ".join(f"row {e['row']}: {e['text']!r}" for e in result["examples"])
                lines.append(f"   examples: {shown}")
        return "\n".join(lines)


class CorpusValidationError(StageError):
    """Raised by callers that refuse to go on with a corpus that failed validation; carries the report."""

    def __init__(self, report: ValidationReport):
        super().__init__(report.summary())
        self.report = report


def validate_corpus(df: pd.DataFrame, cfg: ValidateConfig) -> ValidationReport:
    """Run the corpus suite on `df` (a "text" column of str or None) and report every expectation's outcome."""
    gate = SourceGate(cfg)
    gate.add(df)
    return gate.report()


def validate_cleaned(df: pd.DataFrame, principles: list[Principle], min_rows: int) -> ValidationReport:
    """The gate on the cleaned corpus: per principle, the share of documents that still match it is at most its
    max_rate; and cleaning left at least `min_rows` documents."""
    gate = CleanedGate(principles, min_rows)
    gate.add(df)
    return gate.report()


class Gate(ABC):
    """A suite run batch by batch with its results summed over the whole corpus: per expectation the failing rows
    and the rows checked, the first failing examples (numbered by their row in the corpus), and the success that
    the totals give under the expectation's `mostly`. The row count is checked on the total at the end. One batch
    or many, the report is the same (the validate stage feeds batches of `validate.batch_rows`)."""

    title = "Corpus"

    def __init__(self, expectations: list[gxe.Expectation], messages: dict[str, str], min_rows: int):
        self.expectations, self.messages, self.min_rows = expectations, messages, min_rows
        self.suite: _Suite | None = None  # built when the first rows come (a gate that only absorbs needs none)
        self.reset()

    def reset(self) -> None:
        """Start counting anew (the suite is kept: building it is the expensive part)."""
        self.rows = 0
        self.totals = {e.meta["name"]: {"expectation": e.expectation_type, "mostly": _mostly(e),
                                        "unexpected": 0, "checked": 0, "examples": [], "error": None}
                       for e in self.expectations}

    def state(self) -> dict:
        """The counts so far, as JSON data: what a part of the corpus checked elsewhere hands to `absorb`."""
        return {"rows": self.rows, "totals": self.totals}

    def absorb(self, state: dict, rows_follow: bool = True) -> None:
        """Add the counts of a part checked by another gate of the same suite (or a subset of it). With
        `rows_follow`, the part's rows come after this gate's (its examples are renumbered and its rows counted);
        without, the part counted the same rows (another subset of the suite) and its numbering stands."""
        offset = self.rows if rows_follow else 0
        for name, theirs in state["totals"].items():
            total = self.totals[name]
            total["unexpected"] += theirs["unexpected"]
            total["checked"] += theirs["checked"]
            total["error"] = total["error"] or theirs["error"]
            room = _EXAMPLES - len(total["examples"])
            total["examples"] += [{**e, "row": e["row"] + offset} for e in theirs["examples"][: max(room, 0)]]
        if rows_follow:
            self.rows += state["rows"]

    @abstractmethod
    def frame(self, df: pd.DataFrame) -> tuple[pd.DataFrame, pd.Series]:
        """(the columns the suite checks, the text shown for a failing row)."""

    def add(self, df: pd.DataFrame) -> None:
        frame, shown = self.frame(df)
        if len(frame) and self.totals:
            self.suite = self.suite or _Suite(self.expectations)
            for run_result in self.suite.run(frame).results:
                self._count(run_result, shown)
        self.rows += len(frame)

    def _count(self, run_result, shown: pd.Series) -> None:
        raw = run_result.to_json_dict()
        total = self.totals[run_result.expectation_config.meta["name"]]
        if raw["exception_info"].get("raised_exception"):
            total["error"] = total["error"] or raw["exception_info"]["exception_message"]
            return
        res = raw["result"]
        total["unexpected"] += res.get("unexpected_count") or 0
        total["checked"] += res["element_count"] - res.get("missing_count", 0)
        room = _EXAMPLES - len(total["examples"])
        for row in res.get("partial_unexpected_index_list", [])[: max(room, 0)]:
            total["examples"].append({"row": self.rows + int(row), "text": clip_example(shown[row])})

    def report(self) -> ValidationReport:
        results = [self._result(name, total) for name, total in self.totals.items()]
        results.append({
            "name": "row count", "expectation": "expect_table_row_count_to_be_between",
            "success": self.rows >= self.min_rows, "observed": self.rows, "unexpected_count": None,
            "checked_rows": None, "message": self.messages["row count"].format(observed=self.rows), "examples": []})
        return ValidationReport(success=all(r["success"] for r in results), n_rows=self.rows, results=results,
                                title=self.title)

    def _result(self, name: str, total: dict) -> dict:
        checked, unexpected = total["checked"], total["unexpected"]
        percent = 100.0 * unexpected / checked if checked else 0.0
        if total["error"]:
            success, message = False, f"could not be evaluated: {total['error']}"
        else:
            # GX's rule for `mostly`, on the totals: the share of checked rows that pass is at least `mostly`.
            success = checked == 0 or (checked - unexpected) / checked >= total["mostly"] - 1e-12
            message = self.messages[name].format(count=unexpected, checked=checked, percent=percent, observed=None)
        return {"name": name, "expectation": total["expectation"], "success": bool(success), "observed": percent,
                "unexpected_count": unexpected, "checked_rows": checked, "message": message,
                "examples": total["examples"]}


def _mostly(expectation: gxe.Expectation) -> float:
    """The share of rows that must pass (GX: None means all; 0 means none need to)."""
    mostly = getattr(expectation, "mostly", None)
    return 1.0 if mostly is None else float(mostly)


class SourceGate(Gate):
    """The suite on the source as loaded (validate's first gate). A repeat is found across batches by a hash of
    each text (ultrathink.data.cleaning.SeenHashes: 8 bytes per distinct text, not the texts)."""

    def __init__(self, cfg: ValidateConfig, checks: set[str] | None = None):
        """`checks`: the names of the expectations to run (default: all). The validate stage's parts run all but
        "duplicates", which needs the whole corpus's order and is run where the parts are put together, on a
        `REPEATS` column."""

        chosen = [e for e in _expectations(cfg) if checks is None or e.meta["name"] in checks]
        if checks is not None and len(chosen) != len(checks):
            raise ValueError(f"unknown checks {sorted(checks - {e.meta['name'] for e in chosen})}")
        super().__init__(chosen, _messages(cfg), cfg.min_rows)
        self.seen = SeenHashes()

    def frame(self, df: pd.DataFrame) -> tuple[pd.DataFrame, pd.Series]:
        text = _text_column(df, first_row=self.rows)
        return _with_helper_columns(text, self.seen, df.get(REPEATS), helpers=set(self.totals)), text


def source_check_names(cfg: ValidateConfig) -> list[str]:
    """The source suite's expectations by name, in suite order (the row count comes after them)."""
    return [e.meta["name"] for e in _expectations(cfg)]


class CleanedGate(Gate):
    title = "Cleaned corpus"

    def __init__(self, principles: list[Principle], min_rows: int):
        self.principles = principles
        expectations = [
            gxe.ExpectColumnValuesToBeInSet(column=violation_column(p.name), value_set=[False], mostly=1 - p.max_rate,
                                            meta={"name": f"constitution: {p.name}"})
            for p in principles
        ]
        messages = {f"constitution: {p.name}": f"{{count}} of {{checked}} cleaned documents ({{percent:.1f}}%) still "
                    f"match principle {p.name!r} (action {p.action}); at most {p.max_rate:.1%} may" for p in principles}
        messages["row count"] = f"{{observed}} documents left after cleaning; at least {min_rows} are needed"
        super().__init__(expectations, messages, min_rows)

    def frame(self, df: pd.DataFrame) -> tuple[pd.DataFrame, pd.Series]:
        """Each principle's flag per text: the cleaner's (apply_constitution's violation columns, exact: it scanned
        every text as it finally is) where the corpus has them, else a scan here."""
        text = _text_column(df, first_row=self.rows)
        flags = {}
        for p in self.principles:
            column = violation_column(p.name)
            flags[column] = (df[column].reset_index(drop=True).astype(bool) if column in df
                             else text.map(p.matches).gt(0))
        return pd.DataFrame({TEXT: text, **flags}), text


def validate_pairs(pairs: pd.DataFrame, cfg: FinetuneConfig) -> ValidationReport:
    """The fine-tuning data's own suite: every row a well-formed pair, prompt and response present, answers not
    blank, both within their length bounds, and enough pairs. `pairs` comes from ultrathink.finetune.pairs."""
    gate = PairsGate(cfg)
    gate.add(pairs)
    return gate.report()


class PairsGate(Gate):
    title = "Fine-tuning pairs"

    def __init__(self, cfg: FinetuneConfig):
        bounds = {"prompt length": ("prompt", cfg.max_prompt_chars),
                  "response length": ("response", cfg.max_response_chars)}
        expectations = [
            gxe.ExpectColumnValuesToBeInSet(column="well_formed", value_set=[True], meta={"name": "well-formed rows"}),
            gxe.ExpectColumnValuesToNotBeNull(column="prompt", meta={"name": "prompt present"}),
            gxe.ExpectColumnValuesToNotBeNull(column="response", meta={"name": "response present"}),
            gxe.ExpectColumnValuesToBeBetween(column="response_chars", min_value=1,
                                              meta={"name": "response not empty"}),
            # An empty answer fails "response not empty" only.
            *[gxe.ExpectColumnValueLengthsToBeBetween(column=column, min_value=int(column == "prompt"),
                                                      max_value=limit, meta={"name": name})
              for name, (column, limit) in bounds.items()],
        ]  # and the row count, checked on the total
        messages = {
            "well-formed rows": "{count} of {checked} rows are not a prompt/response pair or a chat ending with an "
            "assistant message",
            "prompt present": f"{{count}} of {{checked}} rows have no {cfg.prompt_field!r} (finetune.prompt_field)",
            "response present": f"{{count}} of {{checked}} rows have no {cfg.response_field!r} "
            "(finetune.response_field)",
            "response not empty": "{count} of {checked} responses are empty or blank",
            **{name: f"{{count}} of {{checked}} {column}s are longer than {limit} characters or empty "
               f"(finetune.max_{column}_chars)" for name, (column, limit) in bounds.items()},
            "row count": f"{{observed}} pairs; at least {cfg.min_pairs} are needed (finetune.min_pairs)",
        }
        super().__init__(expectations, messages, cfg.min_pairs)

    def frame(self, pairs: pd.DataFrame) -> tuple[pd.DataFrame, pd.Series]:
        def text(value):
            return value if isinstance(value, str) else None  # missing fields come back from pandas as NaN

        rows = [(text(problem), text(prompt), text(response)) for problem, prompt, response
                in zip(pairs["problem"], pairs["prompt"], pairs["response"])]
        # A malformed row fails "well-formed rows" only (its prompt and response are not counted again).
        frame = pd.DataFrame({
            "well_formed": [problem is None for problem, _, _ in rows],
            "prompt": ["x" if problem else prompt for problem, prompt, _ in rows],
            "response": ["x" if problem else response for problem, _, response in rows],
        }, dtype=object)
        frame["response_chars"] = frame["response"].map(lambda r: len(r.strip()), na_action="ignore").astype(float)
        where = [f"line {line}: " if isinstance(line, int) else "" for line in pairs.get("line", [None] * len(rows))]
        shown = pd.Series([w + (problem or f"{prompt!r} → {response!r}") for w, (problem, prompt, response)
                           in zip(where, rows)], dtype=object)
        return frame, shown


def validate_preferences(pairs: pd.DataFrame, cfg: AlignConfig) -> ValidationReport:
    """The preference data's own suite: every row a well-formed pair, prompt, chosen and rejected present, the
    answers not blank and not the same, all within their length bounds, and enough pairs. `pairs` comes from
    ultrathink.align.preferences."""
    gate = PreferencesGate(cfg)
    gate.add(pairs)
    return gate.report()


class PreferencesGate(Gate):
    title = "Preference pairs"

    def __init__(self, cfg: AlignConfig):
        fields = {"prompt": cfg.prompt_field, "chosen": cfg.chosen_field, "rejected": cfg.rejected_field}
        bounds = {"prompt length": ("prompt", cfg.max_prompt_chars, "align.max_prompt_chars"),
                  "chosen length": ("chosen", cfg.max_answer_chars, "align.max_answer_chars"),
                  "rejected length": ("rejected", cfg.max_answer_chars, "align.max_answer_chars")}
        expectations = [
            gxe.ExpectColumnValuesToBeInSet(column="well_formed", value_set=[True], meta={"name": "well-formed rows"}),
            *[gxe.ExpectColumnValuesToNotBeNull(column=column, meta={"name": f"{column} present"}) for column in fields],
            *[gxe.ExpectColumnValuesToBeBetween(column=f"{column}_chars", min_value=1,
                                                meta={"name": f"{column} not empty"}) for column in ("chosen", "rejected")],
            gxe.ExpectColumnValuesToBeInSet(column="answers_differ", value_set=[True],
                                            meta={"name": "chosen differs from rejected"}),
            # An empty answer fails "<answer> not empty" only.
            *[gxe.ExpectColumnValueLengthsToBeBetween(column=column, min_value=int(column == "prompt"),
                                                      max_value=limit, meta={"name": name})
              for name, (column, limit, _) in bounds.items()],
        ]  # and the row count, checked on the total
        messages = {
            "well-formed rows": "{count} of {checked} rows are not a prompt with a chosen and a rejected answer",
            **{f"{column} present": f"{{count}} of {{checked}} rows have no {field!r} (align.{column}_field)"
               for column, field in fields.items()},
            **{f"{column} not empty": f"{{count}} of {{checked}} {column} answers are empty or blank"
               for column in ("chosen", "rejected")},
            "chosen differs from rejected": "{count} of {checked} rows have the same chosen and rejected answer: "
            "they teach no preference",
            **{name: f"{{count}} of {{checked}} {column}s are longer than {limit} characters or empty ({knob})"
               for name, (column, limit, knob) in bounds.items()},
            "row count": f"{{observed}} pairs; at least {cfg.min_pairs} are needed (align.min_pairs)",
        }
        super().__init__(expectations, messages, cfg.min_pairs)

    def frame(self, pairs: pd.DataFrame) -> tuple[pd.DataFrame, pd.Series]:
        def text(value):
            return value if isinstance(value, str) else None  # missing fields come back from pandas as NaN

        def prompt_text(messages):  # what the length bound applies to: every message before the answer
            return "\n".join(m["content"] for m in messages) if isinstance(messages, list) else None

        rows = [(text(problem), prompt_text(prompt), text(chosen),
                 text(rejected)) for problem, prompt, chosen, rejected
                in zip(pairs["problem"], pairs["prompt"], pairs["chosen"], pairs["rejected"])]
        # A malformed row fails "well-formed rows" only (its fields are not counted again).
        frame = pd.DataFrame({
            "well_formed": [problem is None for problem, *_ in rows],
            "prompt": ["x" if row[0] else row[1] for row in rows],
            "chosen": ["x" if row[0] else row[2] for row in rows],
            "rejected": ["y" if row[0] else row[3] for row in rows],
        }, dtype=object)
        for column in ("chosen", "rejected"):
            frame[f"{column}_chars"] = frame[column].map(lambda r: len(r.strip()), na_action="ignore").astype(float)
        frame["answers_differ"] = [c is None or r is None or c.strip() != r.strip()
                                   for c, r in zip(frame["chosen"], frame["rejected"])]
        where = [f"line {line}: " if isinstance(line, int) else "" for line in pairs.get("line", [None] * len(rows))]
        shown = pd.Series([w + (problem or f"{prompt!r} → chosen {chosen!r}, rejected {rejected!r}")
                           for w, (problem, prompt, chosen, rejected) in zip(where, rows)], dtype=object)
        return frame, shown


def _expectations(cfg: ValidateConfig) -> list[gxe.Expectation]:
    """The suite. Each expectation carries its readable name in `meta`, which comes back with its result."""
    return [
        gxe.ExpectColumnValuesToNotBeNull(column=TEXT, meta={"name": "text not null"}),
        gxe.ExpectColumnValueLengthsToBeBetween(
            column=TEXT, min_value=cfg.min_length, max_value=cfg.max_length, mostly=cfg.length_mostly,
            meta={"name": "text length"}),
        # Rows flagged True repeat an earlier row, so the unexpected share is exactly the duplicate fraction.
        gxe.ExpectColumnValuesToBeInSet(
            column=REPEATS, value_set=[False], mostly=1 - cfg.max_duplicate_fraction, meta={"name": "duplicates"}),
        gxe.ExpectColumnValuesToBeBetween(
            column=_PRINTABLE, min_value=cfg.min_printable_ratio, meta={"name": "printable characters"}),
    ]  # and the row count, checked on the total (Gate.report)


def _messages(cfg: ValidateConfig) -> dict[str, str]:
    """One readable line per expectation, filled in with {count}, {checked}, {percent} and {observed}."""
    return {
        "text not null": "{count} of {checked} rows are null",
        "text length": f"{{count}} of {{checked}} documents ({{percent:.1f}}%) are not {cfg.min_length} to "
        f"{cfg.max_length} characters long; at most {1 - cfg.length_mostly:.1%} may be",
        "duplicates": f"{{count}} of {{checked}} documents ({{percent:.1f}}%) repeat an earlier document; "
        f"at most {cfg.max_duplicate_fraction:.1%} may",
        "printable characters": f"{{count}} of {{checked}} documents have less than {cfg.min_printable_ratio:.0%} "
        "printable characters",
        "row count": f"{{observed}} rows; at least {cfg.min_rows} are needed",
    }


def _text_column(df: pd.DataFrame, first_row: int = 0) -> pd.Series:
    """The text column as object dtype with None for nulls, indexed 0..n-1 so row numbers are positions (an error
    names the row in the corpus: `first_row` is the batch's first)."""
    if TEXT not in df.columns:
        if len(df):
            raise ValueError(f"corpus has no {TEXT!r} column; columns: {', '.join(map(str, df.columns))}")
        return pd.Series([], dtype=object)  # an empty frame is an empty corpus: the row count check reports it
    text = df[TEXT].reset_index(drop=True).astype(object)
    text = text.where(text.notna(), None)
    wrong = text.map(lambda v: v is not None and not isinstance(v, str))
    if wrong.any():
        row = int(wrong.idxmax())
        raise ValueError(f"column {TEXT!r} row {first_row + row}: expected str or null, got {type(text[row]).__name__}")
    return text


def _with_helper_columns(text: pd.Series, seen, repeats: pd.Series | None = None,
                         helpers: set[str] = frozenset({"duplicates", "printable characters"})) -> pd.DataFrame:
    """Add the per-row facts the suite checks (those of the expectations named in `helpers`); null texts get null
    helpers so only the not-null check fails them. `seen` (SeenHashes) holds the texts of earlier batches, so a repeat
    is found across the whole corpus, unless `repeats` already says which rows repeat an earlier one."""
    present = text.notna()
    frame = pd.DataFrame({TEXT: text})
    if "duplicates" in helpers:
        if repeats is None:
            repeats = pd.Series(False, index=text.index, dtype=object)
            repeats[present] = seen.add(text[present].tolist())
        else:
            repeats = repeats.reset_index(drop=True).astype(object)
        frame[REPEATS] = repeats.where(present, None)
    if "printable characters" in helpers:
        frame[_PRINTABLE] = text.map(printable_ratio, na_action="ignore").astype(float)
    return frame


class _Suite:
    """Expectations in a throwaway in-memory GX context (nothing written, nothing fetched), run on one DataFrame at
    a time, asking for up to 3 failing rows per expectation. The context is built once per gate, not per batch."""

    def __init__(self, expectations: list[gxe.Expectation]):
        context = gx.get_context(mode="ephemeral")
        context.variables.progress_bars = ProgressBarsConfig(globally=False)
        batch = (context.data_sources.add_pandas("corpus").add_dataframe_asset("documents")
                 .add_batch_definition_whole_dataframe("all rows"))
        # GX 1.x only runs suites and definitions that were added to the context first.
        suite = context.suites.add(gx.ExpectationSuite(name="corpus", expectations=expectations))
        self.definition = context.validation_definitions.add(gx.ValidationDefinition(name="corpus", data=batch,
                                                                                       suite=suite))

    def run(self, frame: pd.DataFrame):
        return self.definition.run(
            batch_parameters={"dataframe": frame},
            result_format={"result_format": "SUMMARY", "partial_unexpected_count": _EXAMPLES},
        )


def clip_example(value: str | None) -> str | None:
    """At most 80 characters, with an ellipsis when cut, so one huge document cannot flood the report."""
    if value is None or len(value) <= _EXAMPLE_CHARS:
        return value
    return value[: _EXAMPLE_CHARS - 1] + "…"
