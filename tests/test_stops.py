"""Stop strings (rheo_engine/runtime/stops.py) on the default SentencePiece tokenizer (byte
fallback, 4096 pieces) and, with ../shared, Llama-3's tiktoken file.

The reference decodes whole prefixes ids[:k] from the start (never a window, never the
StreamDecoder): a stop string is completed by the first k whose text contains it, k moved past
tokens that end in half a UTF-8 character (their text is not final yet). Property tests draw
random text (unicode that needs byte tokens, whitespace, punctuation), stop sets from its
substrings plus absent ones, and every kind of step split; a naive matcher must fail them.
"""

from __future__ import annotations

import random

import pytest
from conftest import shared_file

from rheo_engine.io.tokenizer import Tokenizer
from rheo_engine.runtime.engine import DEFAULT_PAIR
from rheo_engine.runtime.stops import StopOutput, StopStrings, check_stop

ALPHABET = [*"abcXy  ..,!?:\n\t-", "é", "ß", "中", "文", "🙂", "ё", " the", " and", "</s>", "\n\n"]
ABSENT = ["@@", "zzz", "Qq", "\u00e9\u00e9\u00e9\u00e9x"]


@pytest.fixture(scope="module")
def default_tok() -> Tokenizer:
    return Tokenizer.from_dir(DEFAULT_PAIR / "target")


@pytest.fixture(scope="module", params=["default", "llama3"])
def tok(request, default_tok) -> Tokenizer:
    if request.param == "default":
        return default_tok
    return Tokenizer.from_file(shared_file("fixtures/llama2c/llama3_tokenizer.model"))


# ---- helpers ----------------------------------------------------------------------------------


def _random_text(rng: random.Random) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 40)))


def _random_stops(rng: random.Random, text: str) -> list[str]:
    stops = []
    for _ in range(rng.randint(1, 4)):
        if text and rng.random() < 0.8:
            start = rng.randrange(len(text))
            stops.append(text[start : start + rng.randint(1, 6)])
        else:
            stops.append(rng.choice(ABSENT))
    return stops


def _splits(rng: random.Random, ids: list[int], mode: str) -> list[list[int]]:
    if mode == "one":
        return [[t] for t in ids]
    if mode == "all":
        return [ids]
    steps, i = [], 0
    while i < len(ids):  # a step emits 1..9 tokens, as a speculative step does
        n = rng.randint(1, 9)
        steps.append(ids[i : i + n])
        i += n
    return steps


def _reference(
    tok: Tokenizer, ids: list[int], stops: list[str], min_new_tokens: int = 0
) -> tuple[str, int, str | None]:
    """(text, used ids, stop string) from decoding whole prefixes; see the module docstring."""
    full = tok.decode(ids)
    final = ""  # text of the last prefix that did not end in half a character
    for k in range(1, len(ids) + 1):
        text = tok.decode(ids[:k])
        if text.endswith("\ufffd") or len(text) <= len(final):
            continue  # not final yet, or no new text
        assert full.startswith(text), (ids[:k], text, full)  # prefixes decode as in the full text
        if k >= min_new_tokens:
            # New occurrences end in the new text; the earliest start wins, then the shorter.
            hits = [(text.find(s, max(0, len(final) - len(s) + 1)), len(s), s) for s in stops]
            hits = [hit for hit in hits if hit[0] >= 0]
            if hits:
                start, _, stop = min(hits)
                return text[:start], k, stop
        final = text
    if len(ids) >= min_new_tokens and len(full) > len(final):  # the flushed tail
        hits = [(full.find(s, max(0, len(final) - len(s) + 1)), len(s), s) for s in stops]
        hits = [hit for hit in hits if hit[0] >= 0]
        if hits:
            start, _, stop = min(hits)
            return full[:start], len(ids), stop
    return full, len(ids), None


def _run(stopper, steps: list[list[int]], max_hold: int) -> tuple[str, int, str | None, list]:
    """Stream steps through a stopper as Engine.stream would; (text, used ids, stop string).
    Also returns each step's emitted-so-far text, to check that nothing is taken back."""
    texts, used, seen = [], 0, []
    for step in steps:
        out = stopper.feed(step)
        texts.append(out.text)
        used += out.used
        seen.append("".join(texts))
        assert len(stopper.pending) <= max_hold
        if out.stop_string is not None:
            assert out.used <= len(step)
            return "".join(texts), used, out.stop_string, seen
        assert out.used == len(step)
    out = stopper.finish()
    texts.append(out.text)
    return "".join(texts), used, out.stop_string, seen


def _check_case(tok, ids, stops, steps, min_new_tokens=0, make=StopStrings) -> None:
    want_text, want_used, want_stop = _reference(tok, ids, stops, min_new_tokens)
    stopper = make(tok, stops, min_new_tokens=min_new_tokens)
    max_hold = max((len(s) for s in stops), default=1) - 1
    text, used, stop, seen = _run(stopper, steps, max_hold)
    # Streaming never emits a character that later turns out to be part of a stop string.
    assert all(want_text.startswith(prefix) for prefix in seen), (stops, seen, want_text)
    assert (text, used, stop) == (want_text, want_used, want_stop), (stops, ids)


# ---- validation -------------------------------------------------------------------------------


def test_stop_argument_is_checked(default_tok):
    assert check_stop(None) == () and check_stop([]) == () and check_stop(()) == ()
    assert check_stop("\n") == ("\n",)
    assert check_stop(["b", "a", "b", "a"]) == ("b", "a")  # deduplicated, order kept
    # The fix is spelled as a Python caller types it: stop=None, not a bare None.
    with pytest.raises(ValueError, match=r'^stop="" would match before any text; pass '
                       r"stop=None for no stop strings, or a non-empty str$"):  # fmt: skip
        StopStrings(default_tok, "")
    with pytest.raises(ValueError, match=r'stop\[1\] is the empty string "".*; remove it '
                       r"\(stop=None or \[\] means no stop strings\)$"):  # fmt: skip
        StopStrings(default_tok, ["a", ""])
    with pytest.raises(ValueError, match=r"stop\[2\]=3 is a int, not a str"):
        StopStrings(default_tok, ["a", "b", 3])
    with pytest.raises(ValueError, match=r"stop\[0\]=b'x' is a bytes"):
        StopStrings(default_tok, (b"x",))
    for bad in (5, {"a"}, b"ab"):
        with pytest.raises(ValueError, match=r"must be None, a str or a list of str"):
            StopStrings(default_tok, bad)
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match=r"min_new_tokens=.* must be"):
            StopStrings(default_tok, "a", min_new_tokens=bad)


# ---- hand-drawn cases (default tokenizer; pieces in comments) ---------------------------------


def test_stop_across_tokens_and_inside_a_step(default_tok):
    # 'H' 'el' 'lo' '▁w' 'or' 'ld' ',' '▁stop' '▁here' '.'
    ids = default_tok.encode("Hello world, stop here.", bos=False)
    s = StopStrings(default_tok, ["o wor", "never"])
    assert s.feed(ids[:3]) == StopOutput("Hell", 3, None)  # "o" may start "o wor": held back
    assert s.pending == "o"
    out = s.feed(ids[3:])  # completed by 'or' (the 5th id), in the middle of the step
    assert out == StopOutput("", 2, "o wor") and s.stopped and s.used_tokens == 5
    assert s.feed(ids) == StopOutput("", 0, "o wor") and s.finish() == StopOutput("", 0, "o wor")
    # A stop that starts inside one token and ends inside a later one: "lo w" in 'lo' '▁w' 'or'.
    s = StopStrings(default_tok, "o wo")
    assert s.feed(ids) == StopOutput("Hell", 5, "o wo")


def test_stop_made_of_byte_tokens(default_tok):
    # '<0xE4>' '<0xB8>' '<0xAD>' (中) '<0xE6>' '<0x96>' '<0x87>' (文) '▁o' 'k'
    ids = default_tok.encode("中文 ok", bos=False)
    s = StopStrings(default_tok, "文")
    assert [s.feed([t]) for t in ids[:5]] == [StopOutput("", 1, None)] * 2 + [
        StopOutput("中", 1, None)
    ] + [StopOutput("", 1, None)] * 2
    assert s.feed(ids[5:]) == StopOutput("", 1, "文")  # the last byte completes it
    s = StopStrings(default_tok, ["文 o"])
    assert s.feed(ids) == StopOutput("中", 7, "文 o")


def test_overlapping_stop_strings(default_tok):
    # 'a' 'X' 'b' '▁ab'
    ids = default_tok.encode("aXb ab", bos=False)
    # "X" completes first, so "aXb" (starting earlier, ending later) never matches.
    assert StopStrings(default_tok, ["aXb", "X"]).feed(ids) == StopOutput("a", 2, "X")
    # Completed by the same token: the earliest start wins, then the shorter one.
    assert StopStrings(default_tok, ["b", "Xb"]).feed(ids) == StopOutput("a", 3, "Xb")
    assert StopStrings(default_tok, ["Xb a", "Xb"]).feed(ids) == StopOutput("a", 3, "Xb")
    assert StopStrings(default_tok, [" ab", "ab"]).feed(ids) == StopOutput("aXb", 4, " ab")
    # A held-back prefix that fails to become a stop string is released, and can hold again.
    s = StopStrings(default_tok, ["b a!"])
    assert s.feed(ids) == StopOutput("aXb a", 4, None) and s.pending == "b"
    assert s.finish() == StopOutput("b", 0, None)
    s = StopStrings(default_tok, ["Xb ab?"])
    assert s.feed(ids) == StopOutput("a", 4, None) and s.pending == "Xb ab"
    assert s.finish() == StopOutput("Xb ab", 0, None)


def test_min_new_tokens_skips_early_stops(default_tok):
    ids = default_tok.encode("aXb ab", bos=False)  # 'a' 'X' 'b' '▁ab'
    assert StopStrings(default_tok, "b", min_new_tokens=3).feed(ids) == StopOutput("aX", 3, "b")
    assert StopStrings(default_tok, "b", min_new_tokens=4).feed(ids) == StopOutput("aXb a", 4, "b")
    s = StopStrings(default_tok, "b", min_new_tokens=5)
    assert s.feed(ids) == StopOutput("aXb ab", 4, None) and s.finish() == StopOutput("", 0, None)


# ---- properties -------------------------------------------------------------------------------


def test_no_stops_is_the_stream_decoder(tok):
    rng = random.Random(1)
    vocab = tok.vocab_size if tok.kind == "sentencepiece" else 128000
    for case in range(150):
        if case % 3:
            ids = tok.encode(_random_text(rng), bos=False)
        else:  # what a model may emit: any ids, invalid UTF-8 included
            ids = [rng.randrange(vocab) for _ in range(rng.randint(0, 20))]
        for mode in ("one", "all", "random"):
            stopper, steps = StopStrings(tok, None if case % 2 else []), _splits(rng, ids, mode)
            outs = [stopper.feed(step) for step in steps]
            assert [out.used for out in outs] == [len(step) for step in steps]
            text = "".join(out.text for out in outs) + stopper.finish().text
            assert text == tok.decode(ids)
            assert stopper.stop_string is None and stopper.used_tokens == len(ids)


def test_stops_match_whole_prefix_decoding(tok):
    rng = random.Random(2)
    stopped = substring_free = 0
    for _ in range(300):
        text = _random_text(rng)
        ids = tok.encode(text, bos=False)
        stops = _random_stops(rng, text)
        for mode in ("one", "all", "random"):
            _check_case(tok, ids, stops, _splits(rng, ids, mode))
        want_text, want_used, want_stop = _reference(tok, ids, stops)
        stopped += want_stop is not None
        full = tok.decode(ids)
        if not any(a != b and a in b for a in stops for b in stops):
            # The brief form: the full text cut before the first occurrence of any stop string,
            # and the fewest ids whose decoded text holds one (moved past half characters).
            substring_free += 1
            found = [full.find(s) for s in stops if s in full]
            assert want_text == (full[: min(found)] if found else full)
            if found:
                k = next(
                    k for k in range(len(ids) + 1) if any(s in tok.decode(ids[:k]) for s in stops)
                )
                while k < len(ids) and tok.decode(ids[:k]).endswith("\ufffd"):
                    k += 1
                assert want_used == k
    assert stopped > 200 and substring_free > 100  # the draws exercise both kinds of case


def test_stops_with_min_new_tokens(tok):
    rng = random.Random(3)
    for _ in range(100):
        text = _random_text(rng)
        ids = tok.encode(text, bos=False)
        stops, min_new = _random_stops(rng, text), rng.randint(0, len(ids) + 1)
        _check_case(tok, ids, stops, _splits(rng, ids, "random"), min_new)


class _NaiveStops:
    """Negative control: matches each step's text on its own and holds nothing back."""

    def __init__(self, tokenizer: Tokenizer, stop, min_new_tokens: int = 0) -> None:
        self.stops, self._decoder, self.pending = check_stop(stop), tokenizer.stream_decoder(), ""

    def feed(self, ids: list[int]) -> StopOutput:
        text = self._decoder.feed(ids)
        hits = [text.find(s) for s in self.stops if s in text]
        if hits:
            return StopOutput(text[: min(hits)], len(ids), "?")
        return StopOutput(text, len(ids), None)

    def finish(self) -> StopOutput:
        return StopOutput(self._decoder.flush(), 0, None)


def test_naive_matcher_fails_the_properties(default_tok):
    rng = random.Random(2)
    failures = 0
    for _ in range(100):
        text = _random_text(rng)
        ids = default_tok.encode(text, bos=False)
        stops = _random_stops(rng, text)
        try:
            _check_case(default_tok, ids, stops, _splits(rng, ids, "random"), make=_NaiveStops)
        except AssertionError:
            failures += 1
    assert failures > 20


def test_hold_back_stays_a_short_window(default_tok):
    # 4000 ids one at a time; the pending text never exceeds max(len(stop)) - 1 characters, and
    # each step only searches that window plus the new piece.
    ids = default_tok.encode("once upon a time, a stop-like ston stoq sto " * 200, bos=False)
    s = StopStrings(default_tok, ["stop!", "ston?"])
    emitted = []
    for t in ids:
        emitted.append(s.feed([t]).text)
        assert len(s.pending) <= 4
    assert "".join(emitted) + s.finish().text == default_tok.decode(ids)


def test_stop_inside_a_token_that_ends_in_half_a_character():
    # Llama-3: b'ok' b' \xf0\x9f' b'\xa6' b'\x99' b'!'. The space is in the 2nd id, but that id's
    # text is final only once the 4th completes the llama, so the 4th is the completing token.
    tok = Tokenizer.from_file(shared_file("fixtures/llama2c/llama3_tokenizer.model"))
    ids = tok.encode("ok 🦙!", bos=False)
    assert ids == [564, 11410, 99, 247, 0]
    assert StopStrings(tok, " ").feed(ids) == StopOutput("ok", 4, " ")
    assert _reference(tok, ids, [" "]) == ("ok", 4, " ")
