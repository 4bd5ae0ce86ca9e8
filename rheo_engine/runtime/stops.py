"""Stop strings: end a generation when its text contains one of the request's `stop` strings.

Matching is on decoded text, so a stop string may be spread over several tokens and steps, start
or end inside a token, or arrive as byte tokens of a multi-byte character. Text that might still
become a stop string is held back while it streams, so no character of a stop string is emitted.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from rheo_engine.config import check_count
from rheo_engine.io.tokenizer import Tokenizer


@dataclass(frozen=True)
class StopOutput:
    """What one `StopStrings.feed` (or `finish`) call gives back."""

    text: str  # text that is final now and never part of a stop string; maybe ""
    used: int  # how many of the ids just fed belong to the output: all, unless this call stopped
    stop_string: str | None  # the stop string that ended the generation (vLLM's stop_reason)


class StopStrings:
    """A request's stop strings, fed each step's new token ids; says what text to emit and when
    (and on which token) the generation stops.

    stop: None, a str, or a list/tuple of str; duplicates are dropped. With no stop string the
    output is exactly the StreamDecoder's: "".join(texts) + finish().text == decode(all ids).

    Text: the ids go one at a time through the tokenizer's StreamDecoder, whose text T is final
    (T(k), after k ids, is a prefix of decode(any continuation)). A stop string is completed by
    the first token k whose T(k) contains it. The output is then T(k) cut right before the
    earliest occurrence of any stop string in T(k) (earliest start; on equal starts the shorter
    one, the one that ended first, is the stop_string). The stop string and everything after it
    are never emitted. Since generation stops at the first completion, a stop string that starts
    earlier but would end later ("aXb" around a completed "X") never matches: the output is
    decode(all ids) cut before its first stop occurrence whenever no stop string is a substring
    of another (and min_new_tokens=0). While streaming, the longest suffix of T that is a proper
    prefix of a stop string is held back (at most max(len(stop)) - 1 characters); `finish`
    releases it.

    Used tokens: `used` counts the ids up to and including token k; the rest of that step is not
    part of the output (as vLLM keeps the completing token and truncates only the text, and as
    HF's StopStringCriteria stops after it). So k is the smallest prefix whose decoded text
    contains a stop string, except that a token ending in half a UTF-8 character releases its
    text only with the token that completes the character (the StreamDecoder's hold-back; vLLM's
    detokenizer does the same), so k may be that later token.

    min_new_tokens: a stop string counts only when its completing token is at least the
    min_new_tokens-th one fed (vLLM's min_tokens); earlier occurrences stay in the text.
    EOS, ignore_eos and min_new_tokens for EOS are token-level and belong to the engine.
    """

    def __init__(
        self, tokenizer: Tokenizer, stop: str | Sequence[str] | None = None, min_new_tokens: int = 0
    ) -> None:
        self.stops: tuple[str, ...] = check_stop(stop)
        self.min_new_tokens = check_count("min_new_tokens", min_new_tokens)
        self._decoder = tokenizer.stream_decoder()
        self._hold = max((len(s) for s in self.stops), default=1) - 1  # longest possible hold
        # Every proper prefix of a stop string: a suffix of the text that is one is held back.
        self._prefixes = frozenset(s[:i] for s in self.stops for i in range(1, len(s)))
        self._pending = ""  # decoded but held back: a proper prefix of some stop string
        self._fed = 0  # ids fed to the decoder (with a stop: up to the completing one)
        self._finished = False
        self.stop_string: str | None = None

    @property
    def stopped(self) -> bool:
        """True once a stop string has matched: further feeds give "" and use no ids."""
        return self.stop_string is not None

    @property
    def used_tokens(self) -> int:
        """Ids of the output so far: all fed ids, or up to the one that completed the stop."""
        return self._fed

    @property
    def pending(self) -> str:
        """The decoded text held back as a possible start of a stop string."""
        return self._pending

    def feed(self, ids: Iterable[int]) -> StopOutput:
        """Take one step's new ids (list or 1-D tensor); see the class docstring."""
        ids = list(ids.tolist() if hasattr(ids, "tolist") else ids)
        if self.stopped or self._finished:
            return StopOutput("", 0, self.stop_string)
        if not self.stops:  # nothing to attribute to single tokens: decode the step at once
            text = self._decoder.feed(ids)
            self._fed += len(ids)
            return StopOutput(text, len(ids), None)
        out = []
        for index, token in enumerate(ids):
            # One id at a time, so the stop is found at its completing token and the match does
            # not depend on how the ids were grouped into steps.
            piece = self._decoder.feed([token])
            self._fed += 1
            if not piece:
                continue
            text, matched = self._scan(piece)
            out.append(text)
            if matched is not None:
                self.stop_string = matched
                return StopOutput("".join(out), index + 1, matched)
        return StopOutput("".join(out), len(ids), None)

    def finish(self) -> StopOutput:
        """At the end (EOS, max_new_tokens, context) without a stop: the held-back text, which
        was no stop string after all, plus the decoder's tail (e.g. invalid UTF-8). The tail can
        still complete a stop string (one ending in U+FFFD): then it is cut there. used is 0."""
        if self.stopped or self._finished:
            return StopOutput("", 0, self.stop_string)
        self._finished = True
        tail = self._decoder.flush()
        text, old = self._pending + tail, len(self._pending)
        self._pending = ""
        start, matched = self._earliest_match(text, old) if tail else (len(text), None)
        self.stop_string = matched
        return StopOutput(text[:start], 0, matched)

    def _scan(self, piece: str) -> tuple[str, str | None]:
        """Add final text; return what may be emitted and the stop string it completed, if any."""
        text, old = self._pending + piece, len(self._pending)
        start, matched = self._earliest_match(text, old)
        if matched is not None:
            self._pending = ""
            return text[:start], matched
        keep = self._held_suffix(text)
        self._pending = text[len(text) - keep :]
        return text[: len(text) - keep], None

    def _earliest_match(self, text: str, old: int) -> tuple[int, str | None]:
        """(start, stop) of the earliest stop occurrence in `text` that ends after text[:old],
        the part already scanned; (len(text), None) if none or still under min_new_tokens."""
        best = (len(text), 0, None)
        if self._fed < self.min_new_tokens:
            return len(text), None
        for stop in self.stops:
            # Only occurrences ending in the new part: text[:old] held none (or they were under
            # min_new_tokens), and this keeps the search to the short window.
            start = text.find(stop, max(0, old - len(stop) + 1))
            if start >= 0 and (start, len(stop)) < best[:2]:
                best = (start, len(stop), stop)
        return best[0], best[2]

    def _held_suffix(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        for length in range(min(len(text), self._hold), 0, -1):
            if text[-length:] in self._prefixes:
                return length
        return 0


def check_stop(stop: object) -> tuple[str, ...]:
    """The request's `stop` argument as a tuple of distinct non-empty strings, in given order.

    Errors are in the Python API's spelling (stop=None); the CLI and the server say them in
    their own (rheo_engine.generate checks --stop itself, rheo_engine.openai_api translates)."""
    if stop is None:
        return ()
    if isinstance(stop, str):
        if not stop:
            raise ValueError(
                'stop="" would match before any text; pass stop=None for no stop strings, or '
                "a non-empty str"
            )
        stop = [stop]
    elif not isinstance(stop, (list, tuple)):
        raise ValueError(
            f"stop={stop!r} ({type(stop).__name__}) must be None, a str or a list of str; "
            'pass e.g. stop="\\n\\n" or stop=["</answer>", "USER:"]'
        )
    for index, item in enumerate(stop):
        if not isinstance(item, str):
            raise ValueError(
                f"stop[{index}]={item!r} is a {type(item).__name__}, not a str; stop strings are "
                "matched on the decoded text: pass text (for a token id, decode it first)"
            )
        if not item:
            raise ValueError(
                f'stop[{index}] is the empty string "", which would match before any text; '
                "remove it (stop=None or [] means no stop strings)"
            )
    return tuple(dict.fromkeys(stop))
