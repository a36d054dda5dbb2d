"""Helpers for tests that talk to a kvmanager over gRPC: a tiny real tokenizer, and an admin stub with a token."""

from __future__ import annotations

from pathlib import Path

from kvserve.v1 import kvmanager_pb2_grpc

TOKEN = "s3cret-admin-token"
WORDS = "the cat sat on a mat and dog ran far".split()  # ids 1.. in the tiny word-level tokenizer


def write_word_tokenizer(folder: Path) -> Path:
    """A real tokenizer.json (word level, whitespace split): 'the cat sat on' -> [1, 2, 3, 4]."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, **{w: i + 1 for i, w in enumerate(WORDS)}}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return folder


class Admin:
    """KVAdminService stub that sends the admin token (or ``token``) on every call."""

    def __init__(self, channel, token: str | None = TOKEN):
        self._stub = kvmanager_pb2_grpc.KVAdminServiceStub(channel)
        self._metadata = [("authorization", f"Bearer {token}")] if token is not None else []

    def __getattr__(self, name):
        return lambda request: getattr(self._stub, name)(request, metadata=self._metadata, timeout=10)
