"""Generated tokens -> text deltas for one request: never splits a UTF-8 character, holds back text that may
still become a stop string, and cuts the text at a stop string (which is not returned)."""

from __future__ import annotations

from kvserve.common.tokenizer import IncrementalDetokenizer, Tokenizer


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:k]):
                longest = k
                break
    return longest


class TextStream:
    def __init__(self, tokenizer: Tokenizer, stops: tuple[str, ...] = ()):
        self.detokenizer = IncrementalDetokenizer(tokenizer)  # never yields half a UTF-8 character
        self.stops = stops
        self.text = ""  # decoded so far (complete characters only)
        self.num_emitted = 0  # characters of self.text already returned

    def push(self, token_id: int) -> tuple[str, bool]:
        """Appends a token. Returns (new text safe to emit, whether a stop string was generated). After a
        stop the returned text ends right before the stop string."""
        self.detokenizer.push(token_id)
        self.text = self.detokenizer.emitted  # unchanged while a multi-byte character is incomplete
        cut = self._stop_at()
        if cut is not None:
            return self._emit(cut), True
        return self._emit(len(self.text) - held_back(self.text, self.stops)), False

    def flush(self) -> str:
        """The text held back, when the request ends for another reason than a stop string."""
        return self._emit(len(self.text))

    def _stop_at(self) -> int | None:
        found = [i for i in (self.text.find(s, max(0, self.num_emitted - len(s))) for s in self.stops) if i >= 0]
        return min(found) if found else None

    def _emit(self, end: int) -> str:
        if end <= self.num_emitted:
            return ""
        delta, self.num_emitted = self.text[self.num_emitted:end], end
        return delta
