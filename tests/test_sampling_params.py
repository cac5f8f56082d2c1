import pytest

from pdserve.sampling_params import SamplingParams


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (1, 1.0, 1.0, 0, 0.0, None)
    assert (p.max_tokens, p.min_tokens, p.stop, p.stop_token_ids) == (16, 0, [], [])
    assert (p.ignore_eos, p.logprobs, p.include_stop_str_in_output) == (False, None, False)
    assert (p.skip_special_tokens, p.spaces_between_special_tokens) == (True, True)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.sampling_type == "random"


@pytest.mark.parametrize("field,value", [
    ("n", -1), ("n", 0), ("n", "1"),
    ("temperature", -1.0), ("temperature", "hot"), ("temperature", float("nan")), ("temperature", None),
    ("temperature", float("inf")), ("temperature", 10 ** 400), ("top_p", float("-inf")),
    ("repetition_penalty", float("inf")),
    ("top_p", 0.0), ("top_p", 1.5), ("top_p", -0.1), ("top_p", True),
    ("top_k", -2), ("top_k", 1.5), ("top_k", "5"),
    ("min_p", -0.1), ("min_p", 1.1),
    ("seed", 1.5), ("seed", "42"), ("seed", True),
    ("max_tokens", 0), ("max_tokens", -1), ("max_tokens", 1.5), ("max_tokens", True),
    ("min_tokens", -1), ("min_tokens", 17), ("min_tokens", 2.0),
    ("stop", [""]), ("stop", [1]), ("stop", 5), ("stop", ["ok", None]),
    ("stop_token_ids", [-1]), ("stop_token_ids", [1.0]), ("stop_token_ids", [True]), ("stop_token_ids", 3),
    ("logprobs", -1), ("logprobs", 21), ("logprobs", 1.0),
    ("presence_penalty", 2.5), ("presence_penalty", -2.1),
    ("frequency_penalty", 2.01), ("frequency_penalty", "x"),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0),
    ("ignore_eos", 1), ("include_stop_str_in_output", "yes"), ("skip_special_tokens", None),
    ("spaces_between_special_tokens", 0),
    ("logit_bias", [1, 2]), ("logit_bias", {"x": 1.0}), ("logit_bias", {-1: 1.0}), ("logit_bias", {"-3": 1.0}),
    ("logit_bias", {1.0: 2.0}), ("logit_bias", {True: 2.0}), ("logit_bias", {5: "2"}), ("logit_bias", {5: None}),
    ("logit_bias", {5: float("nan")}), ("logit_bias", {5: float("inf")}),
])
def test_invalid_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_messages():
    with pytest.raises(ValueError, match=r"temperature must be non-negative, got -1.0"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="n must be at least 1, got 0"):
        SamplingParams(n=0)
    p = SamplingParams(n=4, seed=2 ** 63 - 1)
    assert [p.child(i).seed for i in range(3)] == [2 ** 63 - 1, -2 ** 63, -2 ** 63 + 1] and p.child(2).n == 1
    assert SamplingParams(n=2).child(1).seed is None


def test_valid_edge_values():
    p = SamplingParams(temperature=0, top_p=1, top_k=-1, min_p=1, max_tokens=None, min_tokens=100,
                       logprobs=0, presence_penalty=-2, frequency_penalty=2, repetition_penalty=1e-3,
                       seed=0, stop="###", stop_token_ids=(0, 7))
    assert p.top_k == 0 and p.max_tokens is None and p.logprobs == 0
    assert p.stop == ["###"] and p.stop_token_ids == [0, 7]
    assert isinstance(p.temperature, float) and isinstance(p.presence_penalty, float)
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(top_k=50).top_k == 50
    assert SamplingParams(stop=None, stop_token_ids=None).stop == []
    assert SamplingParams(logprobs=20).logprobs == 20
    assert SamplingParams(max_tokens=5, min_tokens=5).min_tokens == 5


def test_logit_bias_keys_are_ids_and_values_are_clamped_as_vllm():
    p = SamplingParams(logit_bias={"5": 3, 7: -250.5, "11": 100.5, 0: 0.25})
    assert p.logit_bias == {5: 3.0, 7: -100.0, 11: 100.0, 0: 0.25}
    assert all(isinstance(v, float) for v in p.logit_bias.values())
    assert SamplingParams(logit_bias={}).logit_bias is None and SamplingParams().logit_bias is None
    q = p.clone()
    q.logit_bias[5] = 0.0
    assert p.logit_bias[5] == 3.0


def test_bad_words_tokenize_as_vllm_within_its_caps():
    class Tok:  # a word is one token per character; after a space, the space joins the first character's token
        def encode(self, text, add_special_tokens=False):
            return [1000 + ord(text[1])] + [ord(c) for c in text[2:]] if text.startswith(" ") else \
                [ord(c) for c in text]
    assert SamplingParams(bad_words=[" ab", "c"]).bad_words_token_ids(Tok()) == [
        [97, 98], [1097, 98], [99], [1099]]
    with pytest.raises(ValueError, match="tokenizes to no token"):
        SamplingParams(bad_words=["   "]).bad_words_token_ids(Tok())
    with pytest.raises(ValueError, match="at most 128 words"):  # two tokenizations each: 65 words are 130
        SamplingParams(bad_words=[chr(200 + i) for i in range(65)]).bad_words_token_ids(Tok())
    with pytest.raises(ValueError, match="1024 tokens"):
        SamplingParams(bad_words=["x" * 600, "y" * 600]).bad_words_token_ids(Tok())
    assert len(SamplingParams(bad_words=[chr(200 + i) for i in range(64)]).bad_words_token_ids(Tok())) == 128


def test_bad_words_are_sized_before_they_are_tokenized():
    """Issue 37: a few huge words were each tokenized (twice) before the token cap refused them; their characters
    are now capped first (32 per token of the cap), and tokenizing stops once the tokens are over it."""
    calls = []

    class Tok:
        def encode(self, text, add_special_tokens=False):
            calls.append(len(text))
            return [ord(c) for c in text.lstrip()]
    with pytest.raises(ValueError, match="bad_words takes at most 32768 characters in all, got 32769"):
        SamplingParams(bad_words=["x" * 16384, "y" * 16385])
    p = SamplingParams(bad_words=["x" * 16384, "y" * 16384])
    with pytest.raises(ValueError, match="1024 tokens"):
        p.bad_words_token_ids(Tok())
    assert len(calls) == 2  # the first word's two tokenizations were over the cap: the second word never ran


def test_sampling_type_and_greedy():
    assert SamplingParams(temperature=0.0).sampling_type == "greedy"
    assert SamplingParams(temperature=5e-6, seed=3).sampling_type == "greedy"
    assert SamplingParams(temperature=1e-5).sampling_type == "random"
    assert SamplingParams(temperature=0.7, seed=3).sampling_type == "random_seed"
    # greedy ignores truncation settings (still validated first)
    g = SamplingParams(temperature=0, top_k=5, top_p=0.5, min_p=0.2)
    assert (g.top_k, g.top_p, g.min_p) == (0, 1.0, 0.0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(temperature=0, top_p=2.0)


def test_clone_is_independent():
    p = SamplingParams(stop=["a"], stop_token_ids=[1], temperature=0.5)
    q = p.clone()
    assert q == p and q is not p
    q.stop.append("b")
    q.stop_token_ids.append(2)
    assert p.stop == ["a"] and p.stop_token_ids == [1]


def test_from_generation_config():
    cfg = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1,
           "max_new_tokens": 256, "do_sample": True, "eos_token_id": [1, 2], "bos_token_id": 0}
    p = SamplingParams.from_generation_config(cfg)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty, p.max_tokens) == (
        0.6, 0.9, 20, 0.05, 1.1, 256)
    assert p.stop_token_ids == []  # eos handling belongs to the engine
    q = SamplingParams.from_generation_config(cfg, temperature=0.0, max_tokens=8, stop="x")
    assert (q.temperature, q.max_tokens, q.stop, q.sampling_type) == (0.0, 8, ["x"], "greedy")
    assert q.repetition_penalty == 1.1
    # absent / None keys fall back to SamplingParams defaults
    r = SamplingParams.from_generation_config({"temperature": None, "top_k": -1})
    assert r == SamplingParams()
    assert SamplingParams.from_generation_config(None, seed=1) == SamplingParams(seed=1)


def test_from_generation_config_object_and_errors():
    class Cfg:
        def to_dict(self):
            return {"top_p": 0.8}

    assert SamplingParams.from_generation_config(Cfg()).top_p == 0.8
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams.from_generation_config({"top_p": 0.0})
    with pytest.raises(ValueError, match="temprature"):
        SamplingParams.from_generation_config({}, temprature=0.1)


@pytest.mark.parametrize("field, at_cap, over", [
    ("stop", [f"w{i}" for i in range(128)], [f"w{i}" for i in range(129)]),
    ("stop", ["x" * 16384], ["x" * 16383, "yy"]),
    ("stop_token_ids", list(range(1024)), list(range(1025))),
    ("logit_bias", {i: 1.0 for i in range(1024)}, {i: 1.0 for i in range(1025)}),
])
def test_request_lists_are_capped(field, at_cap, over):
    """Each is walked for every token or step of the request: at the cap it is taken, one past it is refused,
    the message naming the field first (the server's 400 names it from there)."""
    SamplingParams(**{field: at_cap})
    with pytest.raises(ValueError) as e:
        SamplingParams(**{field: over})
    assert str(e.value).startswith(f"{field} takes at most"), e.value


def test_first_token_key_covers_what_draws_the_first_token():
    """D takes P's first token only for params whose key matches its own (issue 35): what decides the draw is in
    it, what decides when to stop is not; vllm-router's P request (max_tokens 1, min_tokens 1) keeps the key when
    min_tokens masks nothing (ignore_eos, no stop ids)."""
    base = SamplingParams(temperature=0.9, seed=5, ignore_eos=True)
    key = base.first_token_key()
    assert SamplingParams(temperature=0.9, seed=5, ignore_eos=True, max_tokens=1, min_tokens=1,
                          stop=["x"]).first_token_key() == key
    for other in (dict(seed=6), dict(temperature=0.8), dict(top_k=5), dict(logprobs=2), dict(presence_penalty=0.1),
                  dict(logit_bias={3: 1.0}), dict(allowed_token_ids=[1, 2]), dict(bad_words=["a"])):
        assert SamplingParams(**{"temperature": 0.9, "seed": 5, "ignore_eos": True, **other}).first_token_key() != key
    # min_tokens masks EOS (no ignore_eos) or the stop ids: a first token drawn under it may differ
    assert SamplingParams(temperature=0.9, seed=5, min_tokens=1).first_token_key() != \
        SamplingParams(temperature=0.9, seed=5).first_token_key()
    assert SamplingParams(temperature=0.9, seed=5, ignore_eos=True, min_tokens=1,
                          stop_token_ids=[7]).first_token_key() != key
