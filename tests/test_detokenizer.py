import os
import random
import sysconfig

import pytest

from pdserve.detokenizer import IncrementalDetokenizer

EOT = "<|endoftext|>"
TEXTS = [
    "def foo(self):\n    return 42\n\nclass Bar(object):\n    pass\n",
    "héllo wörld, café crème brûlée — naïve façade",
    "日本語のテキストと中文文本，한국어 텍스트",
    "emoji 😀🎉 ok 👩‍👩‍👧 flags 🇫🇷🇯🇵 end",
    "mixed: x = 'ü' + \"日\" + '🙂'  # ∑ ≠ ∞\n\tprint(x)\n",
]


@pytest.fixture(scope="session")
def tok():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    root = sysconfig.get_paths()["stdlib"]
    texts, n = [], 0
    for name in sorted(os.listdir(root)):
        if name.endswith(".py") and n < 300_000:
            with open(os.path.join(root, name), encoding="utf-8", errors="replace") as f:
                texts.append(f.read())
            n += len(texts[-1])
    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=2000, special_tokens=[EOT], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=raw, eos_token=EOT)


def enc(tok, text):
    return tok.encode(text, add_special_tokens=False)


def stream(tok, ids, chunks=None, **kw):
    """Feed ids in chunks (default one token at a time); return (detok, deltas, stop)."""
    d = IncrementalDetokenizer(tok, **kw)
    deltas, stop, i = [], None, 0
    chunks = chunks or [1] * len(ids)
    for c in chunks:
        stop = d.update(ids[i:i + c])
        i += c
        deltas.append(d.get_delta(finished=stop is not None or i >= len(ids)))
        if stop is not None or i >= len(ids):
            break
    return d, deltas, stop


def random_chunks(n, rng):
    out = []
    while sum(out) < n:
        out.append(rng.randint(1, 5))
    return out


def test_fixture_splits_multibyte_chars(tok):
    for text in TEXTS[1:4]:
        pieces = [tok.decode([i]) for i in enc(tok, text)]
        assert any("\ufffd" in p for p in pieces), text  # a char really is split across tokens


@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time(tok, text):
    ids = enc(tok, text)
    d, deltas, stop = stream(tok, ids)
    assert stop is None
    assert "".join(deltas) == tok.decode(ids) == text == d.output_text
    assert not any("\ufffd" in x for x in deltas)


@pytest.mark.parametrize("seed", range(5))
def test_random_chunks(tok, seed):
    rng = random.Random(seed)
    text = "".join(rng.sample(TEXTS, len(TEXTS)))
    ids = enc(tok, text)
    d, deltas, _ = stream(tok, ids, random_chunks(len(ids), rng))
    assert "".join(deltas) == tok.decode(ids) == d.output_text
    assert not any("\ufffd" in x for x in deltas)


def test_incomplete_char_held_then_flushed_at_finish(tok):
    ids = enc(tok, "ok 😀")
    d = IncrementalDetokenizer(tok)
    d.update(ids[:-1])  # last byte of the emoji missing
    assert d.get_delta(finished=False) == "ok "
    assert d.output_text.startswith("ok ")
    tail = d.get_delta(finished=True)
    assert "ok " + tail == tok.decode(ids[:-1]) == d.output_text
    assert tail.endswith("\ufffd")


class Spy:
    """Records the length of every decode call."""

    def __init__(self, tok):
        self.tok, self.calls = tok, []

    def decode(self, ids, skip_special_tokens=True):
        self.calls.append(len(ids))
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def test_decode_window_is_bounded(tok):
    ids = enc(tok, "".join(TEXTS) * 8)
    spy = Spy(tok)
    d, deltas, _ = stream(spy, ids)
    assert "".join(deltas) == tok.decode(ids)
    assert len(ids) > 300 and max(spy.calls) <= 10  # O(1) per token, not a full re-decode


def test_prompt_context(tok):
    prompt, out = enc(tok, "x = 1\n"), enc(tok, "y = 'é' 日本")
    d, deltas, _ = stream(tok, out, prompt_token_ids=prompt)
    assert "".join(deltas) == tok.decode(out) == d.output_text
    assert d.token_ids == out


def test_prompt_ending_mid_char(tok):
    ids = enc(tok, "ab 😀 cd")
    k = next(k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith("\ufffd"))
    d, deltas, _ = stream(tok, ids[k:], prompt_token_ids=ids[:k])
    assert "".join(deltas) == tok.decode(ids[k:]) == d.output_text


def spans_tokens(tok, ids, s):
    return not any(s in tok.decode([i]) for i in ids)


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("chunked", [False, True])
def test_stop_string_across_tokens(tok, include, chunked):
    text = "def foo(self):\n    return 42\n\nclass Bar: pass"
    stop = "return 4"
    ids = enc(tok, text)
    assert spans_tokens(tok, ids, stop)
    chunks = random_chunks(len(ids), random.Random(1)) if chunked else None
    d, deltas, got = stream(tok, ids, chunks, stop=[stop], include_stop_str_in_output=include)
    cut = text.index(stop) + (len(stop) if include else 0)
    assert got == stop == d.stop_reason and d.finished
    assert d.output_text == text[:cut] == "".join(deltas)
    for k in range(1, len(deltas) + 1):  # nothing released is ever taken back
        assert d.output_text.startswith("".join(deltas[:k]))
    assert tok.decode(d.token_ids).startswith(text[:cut])  # trailing tokens not consumed
    if not chunked:
        assert tok.decode(d.token_ids[:-1]).find(stop) < 0  # stopped on the completing token


def test_stop_holdback_never_releases_stop_prefix(tok):
    text = "abc éé 日本 STOP tail"
    ids = enc(tok, text)
    d = IncrementalDetokenizer(tok, stop=["STOP"])
    released = ""
    for i, t in enumerate(ids):
        stop = d.update([t])
        released += d.get_delta(finished=stop is not None)
        assert "S" not in released
        if stop is None:  # the last len("STOP")-1 chars stay held
            assert len(released) <= max(0, len(d.output_text) - 3)
        else:
            break
    assert stop == "STOP" and released == d.output_text == "abc éé 日本 "
    assert d.update(enc(tok, " more")) is None and d.output_text == "abc éé 日本 "
    assert d.get_delta(finished=True) == ""


def test_stop_after_multibyte_split(tok):
    text = "foo 🎉!! bar"
    ids = enc(tok, text)
    d, deltas, stop = stream(tok, ids, stop=["🎉!"])
    assert stop == "🎉!" and "".join(deltas) == d.output_text == "foo "


def test_multiple_stops_earliest_wins(tok):
    text = "Hello World and more"
    ids = enc(tok, text)
    for chunks in (None, [len(ids)]):
        d, deltas, stop = stream(tok, ids, chunks, stop=["World", "Hello"])
        assert stop == "Hello" and d.output_text == "".join(deltas) == ""
        d, deltas, stop = stream(tok, ids, chunks, stop=["and", "World"], include_stop_str_in_output=True)
        assert stop == "World" and d.output_text == "".join(deltas) == "Hello World"
        # same end position: the longer (earlier-starting) one wins
        d, _, stop = stream(tok, ids, chunks, stop=["rld", "o World"])
        assert stop == "o World" and d.output_text == "Hell"


def test_stop_completing_first_wins_regardless_of_chunking(tok):
    text = "xx abcdef yy"
    ids = enc(tok, text)
    outs = {stream(tok, ids, chunks, stop=["abcdef", "cd"])[0].output_text
            for chunks in (None, [len(ids)], [2] * len(ids))}
    assert outs == {"xx ab"}


def test_special_tokens(tok):
    eot = tok.convert_tokens_to_ids(EOT)
    ids = enc(tok, "hello") + [eot] + enc(tok, " wörld") + [eot, eot]
    d, deltas, _ = stream(tok, ids)
    assert "".join(deltas) == d.output_text == "hello wörld" == tok.decode(ids, skip_special_tokens=True)
    d, deltas, _ = stream(tok, ids, skip_special_tokens=False)
    assert "".join(deltas) == d.output_text == f"hello{EOT} wörld{EOT}{EOT}"


def test_many_skipped_specials_do_not_grow_window(tok):
    eot = tok.convert_tokens_to_ids(EOT)
    ids = enc(tok, "a") + [eot] * 100 + enc(tok, "b é")
    spy = Spy(tok)
    d, deltas, _ = stream(spy, ids)
    assert "".join(deltas) == d.output_text == "ab é"
    assert max(spy.calls) <= 40  # bounded, not ~100


def test_prompt_context_keeps_leading_space_for_metaspace():
    # SentencePiece-style decoders drop the first token's leading space; with the prompt
    # as context the output reads as it does after the prompt (like vLLM).
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer, raw.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    raw.train_from_iterator(["Hello world, the answer is yes. Hello there"] * 20,
                            trainers.BpeTrainer(vocab_size=200, show_progress=False))
    mtok = PreTrainedTokenizerFast(tokenizer_object=raw)
    prompt, out = enc(mtok, "the answer is"), enc(mtok, " yes. Hello world")
    d, deltas, _ = stream(mtok, out, prompt_token_ids=prompt)
    assert "".join(deltas) == d.output_text == " yes. Hello world"
    d, deltas, _ = stream(mtok, out)
    assert "".join(deltas) == d.output_text == mtok.decode(out) == "yes. Hello world"


class Pieces:
    """Token i decodes to PIECES[i] (bytes): exact control over where text and partial chars fall."""

    def __init__(self, *pieces):
        self.pieces = pieces

    def decode(self, ids, skip_special_tokens=True):
        return b"".join(self.pieces[i] for i in ids).decode("utf-8", errors="replace")


@pytest.mark.parametrize("stop,min_tokens,n_fed,text", [
    ("fic", 0, 2, " noti"),
    ("fic", 3, 4, " notificfic"),  # the text of the first 3 tokens is never searched
    ("cfi", 2, 3, " notifi"),  # as vLLM: a match must end after that text, but may start inside it
    ("notif", 2, 5, " notificficficx"),  # wholly inside it: never matched
])
def test_stop_strings_wait_for_min_tokens(stop, min_tokens, n_fed, text):
    ptok = Pieces(b" noti", b"fic", b"x")
    d = IncrementalDetokenizer(ptok, stop=[stop], min_tokens=min_tokens)
    got = None
    for n, t in enumerate([0, 1, 1, 1, 2], 1):
        if (got := d.update([t])) is not None:
            break
    assert (got, n, d.output_text) == (stop if n_fed < 5 else None, n_fed, text)


def test_final_token_commits_incomplete_tail_and_matches_stop():
    # The last token completes "ab" and starts a char that never completes: the match must be found while
    # the finish reason can still say so, not only by the flush when the output is built.
    ptok = Pieces(b"a", b"b\xc3")
    d = IncrementalDetokenizer(ptok, stop=["ab"])
    assert d.update([0]) is None and d.update([1]) is None  # not final: the tail waits for its char
    d = IncrementalDetokenizer(ptok, stop=["ab"])
    assert d.update([0]) is None and d.update([1], final=True) == "ab"
    assert d.output_text == d.get_delta(finished=True) == ""


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_backend_decode_equals_transformers_decode(tiny_models, arch):
    """The fast path (the Rust tokenizer's own decode) gives transformers' text, special tokens kept or skipped."""
    from transformers import AutoTokenizer

    from pdserve.detokenizer import backend_decoder
    t = AutoTokenizer.from_pretrained(tiny_models[arch])
    fast = backend_decoder(t)
    assert fast is not None
    rng = random.Random(0)
    specials = list(t.all_special_ids)
    for _ in range(300):
        ids = [rng.choice(specials) if rng.random() < 0.1 else rng.randrange(t.vocab_size)
               for _ in range(rng.randint(1, 12))]
        for skip in (True, False):
            assert fast(ids, skip_special_tokens=skip) == t.decode(ids, skip_special_tokens=skip)


def test_short_stop_inside_the_min_tokens_text_never_matches():
    """With several stop strings, a short one lying wholly in the text before min_tokens (within the longest one's
    reach of its end) is not matched later: a match must end in new text (found by the randomized engine test)."""
    ptok = Pieces(b"aZ", b"q", b"r")
    d = IncrementalDetokenizer(ptok, stop=["Z", "Z7E"], min_tokens=1)
    assert d.update([0]) is None and d.update([1]) is None and d.update([2]) is None
    assert d.get_delta(finished=True) == "aZqr"
