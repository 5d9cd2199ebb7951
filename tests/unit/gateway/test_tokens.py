"""The gateway's own token count, with a tokenizer trained the way the tiny model's is."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer

from hpd_fleet.tiny_model import train_tokenizer
from hpd_gateway.tokens import CHAT_TOKENS_PER_MESSAGE, LocalTokenizers


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tok")
    train_tokenizer(out)
    return out


def test_a_string_prompt_counts_as_the_tokenizer_encodes_it(folder: Path) -> None:
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    text = "the quick brown fox jumps over the lazy dog " * 7
    local = LocalTokenizers({"tiny": str(folder)})
    assert "tiny" in local and "other" not in local
    assert local.count("tiny", {"prompt": text}) == len(tok.encode(text).ids) > 0
    assert local.count("tiny", {"prompt": [text]}) == len(tok.encode(text).ids)


def test_a_token_id_prompt_counts_its_ids(folder: Path) -> None:
    local = LocalTokenizers({"tiny": str(folder)})
    assert local.count("tiny", {"prompt": [5, 6, 7, 8]}) == 4


def test_chat_counts_each_messages_text_and_its_markers(folder: Path) -> None:
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    local = LocalTokenizers({"tiny": str(folder)})
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hello world"}]},
    ]
    want = sum(
        len(tok.encode(t, add_special_tokens=False).ids) for t in ("be brief", "hello world")
    )
    assert local.count("tiny", {"messages": messages}) == want + 2 * CHAT_TOKENS_PER_MESSAGE


def test_a_folder_without_a_tokenizer_fails_naming_the_model(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'tiny'"):
        LocalTokenizers({"tiny": str(tmp_path)})
