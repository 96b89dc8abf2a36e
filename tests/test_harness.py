"""The lm-eval `LM` of ultrathink/harness.py against direct computations with the model: loglikelihoods (a context
that does not fit the window, a continuation longer than the window), rolling loglikelihoods, greedy generation
with stop strings, and batching that changes nothing."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from ultrathink.config import ModelConfig, TokenizerConfig
from ultrathink.downstream import frame
from ultrathink.harness import UltraThinkLM, cut, windows
from ultrathink.model import UltraThink
from ultrathink.tokenizer import load_tokenizer, train_tokenizer

WINDOW = 16
TEXT = ("The quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun by the door. "
        "A class body is executed in a new namespace and its local names become attributes of the class. ") * 4


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    train_tokenizer([TEXT] * 20, TokenizerConfig(vocab_size=300, min_frequency=1), out)
    return load_tokenizer(out)


@pytest.fixture(scope="module")
def model(tokenizer):
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, seq_len=WINDOW, dropout=0.0)
    return UltraThink(cfg, len(tokenizer)).eval()


def request(*args):
    return SimpleNamespace(args=args)


def direct_logprob(model, tokens: list[int], first: int) -> tuple[float, bool]:
    """log p(tokens[first:]) with one forward per predicted token on the WINDOW tokens before it, compared with a
    window per chunk of WINDOW targets taken from the end (the harness's windows), computed here from scratch."""
    total, greedy, end = 0.0, True, len(tokens)
    while end > first:
        start = max(first, end - WINDOW)
        inputs = tokens[max(0, end - 1 - WINDOW) : end - 1]
        with torch.no_grad():
            logprobs = F.log_softmax(model(torch.tensor([inputs]))[0][0].double(), dim=-1)
        for target_index in range(start, end):
            position = len(inputs) - (end - target_index)  # the input position that predicts this target
            total += logprobs[position, tokens[target_index]].item()
            greedy = greedy and int(logprobs[position].argmax()) == tokens[target_index]
        end = start
    return total, greedy


def test_windows_predict_every_token_once_with_a_full_window_where_there_is_one():
    tokens = list(range(40))
    got = list(windows(tokens, 5, 16))
    predicted = [t for _, targets in got for t in targets]
    assert sorted(predicted) == list(range(5, 40))
    for inputs, targets in got:
        assert len(inputs) <= 16 and inputs[-1] == targets[-1] - 1  # inputs end just before the last target
        assert inputs[0] == max(0, targets[-1] - 16)  # and hold the 16 tokens before it (fewer at the start)


def test_loglikelihood_equals_a_direct_computation_including_past_the_window(model, tokenizer):
    lm = UltraThinkLM(model, tokenizer, frame(tokenizer), batch_size=3)
    requests = [("The quick brown fox", " jumps over the lazy dog"),  # fits the window
                (TEXT[:300], " while the cat sleeps"),  # the context is cut to the window
                ("A class", TEXT[:200]),  # the continuation alone is longer than the window
                ("", "The quick brown fox"),  # no context: the frame alone
                ("The quick brown ", "fox")]  # a context's trailing space moves to the continuation
    got = lm.loglikelihood([request(c, x) for c, x in requests])
    for (context, continuation), (logprob, greedy) in zip(requests, got):
        ids, cont = lm.split(context, continuation)
        assert len(ids) + len(cont) > 0
        expected, expected_greedy = direct_logprob(model, ids + cont, len(ids))
        assert logprob == pytest.approx(expected, abs=1e-5)
        assert greedy == expected_greedy
    assert len(sum(lm.split(*requests[2]), [])) > 2 * WINDOW  # the crossing case crosses more than once
    lengths = [len(lm.split(*r)[1]) for r in requests]
    assert lengths[-1] == len(tokenizer(" fox", add_special_tokens=False)["input_ids"])


def test_a_request_is_framed_as_a_packed_document(model, tokenizer):
    lm = UltraThinkLM(model, tokenizer, frame(tokenizer))
    context, continuation = lm.split("The quick", " brown fox")
    assert context == [tokenizer.eos_token_id] + tokenizer("The quick", add_special_tokens=False)["input_ids"]
    assert context + continuation == [tokenizer.eos_token_id] + tokenizer("The quick brown fox",
                                                                          add_special_tokens=False)["input_ids"]


def test_batching_and_order_change_no_score(model, tokenizer):
    requests = [request(TEXT[i : i + 40], TEXT[i + 40 : i + 70]) for i in range(0, 200, 25)]
    one = UltraThinkLM(model, tokenizer, frame(tokenizer), batch_size=1).loglikelihood(requests)
    many = UltraThinkLM(model, tokenizer, frame(tokenizer), batch_size=8).loglikelihood(requests[::-1])[::-1]
    for (a, ga), (b, gb) in zip(one, many):
        assert a == pytest.approx(b, abs=1e-5) and ga == gb


def test_rolling_loglikelihood_scores_every_token_of_the_text_once(model, tokenizer):
    lm = UltraThinkLM(model, tokenizer, frame(tokenizer), batch_size=4)
    texts = ["The quick brown fox", TEXT[:250]]
    got = lm.loglikelihood_rolling([request(t) for t in texts])
    for text, logprob in zip(texts, got):
        tokens = frame(tokenizer) + tokenizer(text, add_special_tokens=False)["input_ids"]
        assert logprob == pytest.approx(direct_logprob(model, tokens, len(frame(tokenizer)))[0], abs=1e-5)
    assert got[1] < got[0] < 0


def test_generate_until_is_greedy_and_stops_at_the_first_stop_string(model, tokenizer):
    lm = UltraThinkLM(model, tokenizer, frame(tokenizer), batch_size=2)
    prompts = ["The quick brown", TEXT[:120]]  # the second runs past the window: the window slides
    free = lm.generate_until([request(p, {"until": ["\x00never"], "max_gen_toks": 20}) for p in prompts])
    for prompt, text in zip(prompts, free):
        ids = frame(tokenizer) + tokenizer(prompt, add_special_tokens=False)["input_ids"]
        made = []
        for _ in range(20):
            with torch.no_grad():
                following = int(model(torch.tensor([ids[-WINDOW:]]))[0][0, -1].argmax())
            if following == tokenizer.eos_token_id:
                break
            ids.append(following)
            made.append(following)
        assert text == tokenizer.decode(made)
    stop = free[0][len(free[0]) // 2 :][:2]  # a string the free run produces: the stopped run ends before it
    stopped = lm.generate_until([request(prompts[0], {"until": [stop], "max_gen_toks": 20})])[0]
    assert stopped == cut(free[0], [stop]) and stop not in stopped
    with pytest.raises(ValueError, match="greedily"):
        lm.generate_until([request("The", {"do_sample": True, "temperature": 0.7})])
