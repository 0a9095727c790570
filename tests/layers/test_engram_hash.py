"""Engram hashing (deepinfer.layers.engram_hash) against NeMo AutoModel's V4.1 implementation."""
from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, models

from deepinfer.layers.engram_hash import (EngramHashParams, compressed_token_map, ngram_rows,
                                          normalize_token_text, windows_from_sequence)
from deepinfer.tools.tiny_tokenizer import build_tokenizer

nemo_engram = pytest.importorskip("nemo_automodel.components.models.deepseek_v41.engram")
from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41TextConfig  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402


def _wordlevel_tokenizer() -> Tokenizer:
    words = ["<bos>", "<eos>", "<pad>"]
    for i in range(300):
        words.append(f"w{i}")
        if i % 7 == 0:
            words.append(f"W{i}")          # upper-case twin: merges with w{i}
    words += ["café", "cafe", "CAFÉ", "ﬁ", "fi", " ", "  ", "\t", "\n", " x ", "x", "\ue000", "\ufffd", "Ω", "ω",
              "Ａ", "a", "\u00a0", "\u3000y", "é"]
    vocab = {w: i for i, w in enumerate(dict.fromkeys(words))}
    return Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))


def _fast(tok: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=tok)


@pytest.fixture(scope="module")
def bpe():
    return build_tokenizer(1024)


@pytest.mark.parametrize("which", ["bpe", "wordlevel"])
def test_compressed_map_matches_nemo(which, bpe):
    tok = bpe if which == "bpe" else _wordlevel_tokenizer()
    ours, n = compressed_token_map(tok)
    theirs, m = nemo_engram._compressed_token_map(_fast(tok))
    assert n == m
    assert ours == list(theirs)
    assert len(ours) == tok.get_vocab_size(with_added_tokens=True)
    assert n < len(ours)                      # some ids merged
    # a PreTrainedTokenizerFast works as well
    assert compressed_token_map(_fast(tok)) == (ours, n)


def test_normalisation_rules():
    assert normalize_token_text("  CaFÉ\t\n") == "cafe"
    assert normalize_token_text(" ") == " "
    assert normalize_token_text("\t\n ") == " "
    assert normalize_token_text("ﬁ") == "fi"
    assert normalize_token_text("\u00a0") == " "      # NFKC turns NBSP into a space
    assert normalize_token_text("\u3000y") == "y"
    tok = _wordlevel_tokenizer()
    cmap, _ = compressed_token_map(tok)
    v = tok.get_vocab()
    assert cmap[v["w7"]] == cmap[v["W7"]] and cmap[v["w8"]] != cmap[v["w7"]]
    assert cmap[v["café"]] == cmap[v["cafe"]] == cmap[v["CAFÉ"]]
    assert cmap[v["Ａ"]] == cmap[v["a"]] and cmap[v["x"]] == cmap[v[" x "]]


def _text_config(cvocab: int, max_ngram: int, layer_ids=(1, 4), n_heads=2, evocab=1000) -> DeepseekV41TextConfig:
    rows = [200_000] * len(layer_ids)
    return DeepseekV41TextConfig(engram_layer_ids=list(layer_ids), engram_num_embeddings=rows,
                                 engram_max_ngram_size=max_ngram, engram_vocab_size=evocab,
                                 engram_n_heads=n_heads, engram_head_dim=32, engram_pad_token_id=2,
                                 engram_compressed_vocab_size=cvocab)


@pytest.mark.parametrize("which,max_ngram,layer_ids,n_heads", [
    ("bpe", 3, (1, 4), 2), ("bpe", 4, (1, 5, 14), 3), ("wordlevel", 4, (1, 14), 8), ("wordlevel", 2, (3,), 1)])
def test_rows_match_nemo(which, max_ngram, layer_ids, n_heads, bpe):
    tok = bpe if which == "bpe" else _wordlevel_tokenizer()
    cmap, n = compressed_token_map(tok)
    cfg = _text_config(n, max_ngram, layer_ids, n_heads)
    nemo = nemo_engram.DeepseekV41NgramHash(cfg, _fast(tok))
    params = EngramHashParams.from_text_config(cfg.to_dict(), cmap)
    assert params.primes == nemo._prime_values and params.multipliers == nemo._multiplier_values
    assert params.offsets == nemo._offset_values and params.pad_id == nemo.pad_id
    tmap = torch.tensor(cmap)
    vocab = len(cmap)
    g = torch.Generator().manual_seed(max_ngram * 10 + n_heads)
    b, s = 3, 23
    ids = torch.randint(0, vocab, (b, s), generator=g)
    ids[0, 5:9] = ids[0, 0]                   # repeats
    mask = torch.rand(b, s, generator=g) > 0.25
    for tmask in (None, mask):
        want = nemo(ids, token_mask=tmask)                                   # [B, S, L, heads]
        win, wmask = windows_from_sequence(ids, max_ngram, tmask)
        got = ngram_rows(win, params, token_map=tmap, mask=wmask)
        assert got.dtype == torch.int64 and got.shape == want.shape
        assert torch.equal(got, want)
        # flat batch of windows (what an engine sends) gives the same rows
        flat = ngram_rows(win.reshape(-1, max_ngram), params, token_map=tmap,
                          mask=None if wmask is None else wmask.reshape(-1, max_ngram))
        assert torch.equal(flat.view_as(want), want)
        # chunked prefill: the second chunk continues from the first one's tail
        cut = 11
        hist = ids[:, cut - (max_ngram - 1):cut]
        hmask = None if tmask is None else tmask[:, cut - (max_ngram - 1):cut]
        win2, wmask2 = windows_from_sequence(ids[:, cut:], max_ngram, None if tmask is None else tmask[:, cut:],
                                             history=hist, history_mask=hmask)
        assert torch.equal(ngram_rows(win2, params, token_map=tmap, mask=wmask2), want[:, cut:])
    rows = ngram_rows(win, params, token_map=tmap)
    for e in range(len(layer_ids)):
        assert int(rows[..., e, :].max()) < params.rows_needed[e]


def test_blocking_semantics():
    params = EngramHashParams.build([1], [10_000], 3, 2, 1000, 50, pad_id=7)
    # token 5 with no history == pad in every earlier column
    a = ngram_rows(torch.tensor([[5, -1, -1]]), params)
    b = ngram_rows(torch.tensor([[5, 7, 7]]), params)
    assert torch.equal(a, b)
    # a blocked column blocks everything behind it (cumulative)
    c = ngram_rows(torch.tensor([[5, 9, 11]]), params, mask=torch.tensor([[True, False, True]]))
    assert torch.equal(c, b)
    d = ngram_rows(torch.tensor([[5, 9, -1]]), params)
    e = ngram_rows(torch.tensor([[5, 9, 7]]), params)
    assert torch.equal(d, e) and not torch.equal(d, b)


def test_released_primes_and_table_rows():
    # the released Flash config: 2 layers x 3 sizes x 8 heads, primes above 16M
    params = EngramHashParams.build([1, 14], [384006168, 384016682], 4, 8, 16_000_000, 99092)
    assert len(params.primes[0]) == 24 and min(params.primes[0]) > 15_999_999
    assert max(params.primes[0]) < min(params.primes[1])
    assert params.rows_needed[0] <= 384006168 and params.rows_needed[1] <= 384016682
    assert all(m % 2 == 1 for m in params.multipliers[0])
    with pytest.raises(ValueError, match="table rows"):
        EngramHashParams.build([1], [1000], 3, 2, 1000, 50)
