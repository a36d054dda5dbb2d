"""Text deltas of the gateway: never a broken UTF-8 character, stop strings cut and never emitted."""

from __future__ import annotations

from kvserve.services.gateway.textstream import TextStream, held_back


def stream_all(tokenizer, text, stops=()):
    ts = TextStream(tokenizer, stops)
    deltas, stopped_at = [], None
    for i, t in enumerate(tokenizer.encode(text)):
        delta, stopped = ts.push(t)
        deltas.append(delta)
        if stopped:
            stopped_at = i
            break
    else:
        deltas.append(ts.flush())
    return deltas, stopped_at


def test_held_back_is_the_longest_suffix_that_may_start_a_stop_string():
    assert held_back("Hello wor", ("world",)) == 3
    assert held_back("Hello wor", ("xyz", "orb")) == 2
    assert held_back("Hello", ("world",)) == 0
    assert held_back("ab", ("abc",)) == 2


def test_multibyte_characters_are_never_split(tokenizer):
    text = "Grüße aus 東京 🙂 und ñandú"
    deltas, _ = stream_all(tokenizer, text)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tokenizer.decode(tokenizer.encode(text))
    assert sum(1 for d in deltas if d == "") > 0  # some tokens only completed a character later


def test_stop_string_ends_the_text_before_it_and_is_not_emitted(tokenizer):
    deltas, stopped_at = stream_all(tokenizer, "The answer is 42. Done here.", stops=("Done",))
    assert stopped_at is not None
    assert "".join(deltas) == "The answer is 42. "


def test_text_that_only_looks_like_a_stop_prefix_is_released(tokenizer):
    deltas, stopped_at = stream_all(tokenizer, "Do not stop. Do it", stops=("Done",))
    assert stopped_at is None
    assert "".join(deltas) == "Do not stop. Do it"
