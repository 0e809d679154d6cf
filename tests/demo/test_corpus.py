"""read_corpus: a user's corpus is UTF-8 text; the Lee files stay latin-1, as gensim reads
them."""

import os
from pathlib import Path

import pytest

from quantscope.demo import data


def test_a_corpus_is_read_as_utf8(tmp_path):
    docs = ["Café naïve résumé in Zürich", "東京の天気は晴れです"]
    f = tmp_path / "c.txt"
    f.write_bytes(("\ufeff" + "\n".join(docs) + "\r\n\n").encode("utf-8"))  # BOM, CRLF, blank
    assert data.read_corpus(str(f)) == docs


def test_a_corpus_that_is_not_utf8_names_the_byte(tmp_path):
    f = tmp_path / "latin1.txt"
    f.write_bytes("abc\ncafé\n".encode("latin-1"))  # é is 0xe9, at offset 7 on line 2
    with pytest.raises(ValueError, match=r"is not UTF-8 text: byte 0xe9 at offset 7 \(line 2\)"):
        data.read_corpus(str(f))
    assert data.read_corpus(str(f), "latin-1") == ["abc", "café"]


def test_the_lee_files_are_read_as_latin1():
    try:
        path = os.path.join(data.test_data_dir(), "lee.cor")
    except FileNotFoundError as e:
        pytest.skip(str(e))
    raw = Path(path).read_bytes()
    with pytest.raises(UnicodeDecodeError):
        raw.decode("utf-8")  # why the Lee files keep latin-1
    docs = data.lee_documents()
    assert len(docs) == 50 and any("\u00a3" in d for d in docs)  # 0xa3: the pound sign
