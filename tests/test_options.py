"""GenerationOptions: one typed value for a generation's options, checked in one place, and the
keyword arguments of generate() that build it."""

import pytest

from specdec import generate
from specdec.options import GenerationOptions, parse_k
from specdec.sampling import Penalties

from .conftest import make_model, prompt_ids


@pytest.mark.parametrize("text, k", [("auto", "auto"), (" auto ", "auto"), ("0", 0), ("12", 12), (3, 3)])
def test_parse_k_takes_auto_and_whole_numbers(text, k):
    assert parse_k(text) == k


@pytest.mark.parametrize("bad", [-1, "-1", "x", "", True, 2.0, None, "4.0"])
def test_parse_k_refuses_the_rest_naming_the_value(bad):
    with pytest.raises(ValueError, match=r"k \(draft length\) must be >= 0.*got " + repr(repr(bad))[1:-1]):
        parse_k(bad)


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(k=-2), "k \\(draft length\\)"),
        (dict(k="4"), "the text '4'"),
        (dict(k_max=0), "k_max"),
        (dict(max_new_tokens=-1), "max_new_tokens"),
        (dict(max_new_tokens=2.5), "max_new_tokens"),
        (dict(temperature=-0.1), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(logprobs=21), "logprobs"),
        (dict(stop=("a", 3)), "stop must be strings"),
    ],
)
def test_bad_options_are_refused_when_made(fields, message):
    with pytest.raises(ValueError, match=message):
        GenerationOptions(**fields)


def test_options_normalise_stop_and_penalties_and_replace_checks_again():
    options = GenerationOptions(stop="END", penalties=None)
    assert options.stop == ("END",) and options.penalties == Penalties()
    assert GenerationOptions(stop=["a", "b"]).stop == ("a", "b")
    assert options.replace(seed=5).seed == 5 and options.seed is None  # a copy
    with pytest.raises(ValueError, match="k_max"):
        options.replace(k_max=0)
    assert options.sampling.greedy and not options.replace(temperature=0.7).sampling.greedy


def test_generate_takes_options_or_their_fields_not_both():
    target = make_model("llama", seed=3)
    prompt = prompt_ids()
    by_fields = generate(target, prompt, "prompt-lookup", k=2, max_new_tokens=10, temperature=0.9, seed=4)
    options = GenerationOptions(k=2, max_new_tokens=10, temperature=0.9, seed=4)
    by_options = generate(target, prompt, "prompt-lookup", options)
    assert by_options.tokens == by_fields.tokens and len(by_fields.tokens) == 10
    with pytest.raises(TypeError, match="not both"):
        generate(target, prompt, None, options, max_new_tokens=3)
    with pytest.raises(TypeError, match="unknown generation option.*max_tokens"):
        generate(target, prompt, None, max_tokens=3)
