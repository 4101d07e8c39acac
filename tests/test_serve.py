"""`specdec serve` end to end: uvicorn on loopback, spoken to with the real `openai` client (raw
HTTP where the client cannot send what is tested), on the tiny models the tests build."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import math
import os
import signal
import socket
import sys
import threading
import time
import types
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

import openai
import pytest
import torch
import uvicorn
from openai import AsyncOpenAI, OpenAI

from specdec import cli
from specdec import grammar as grammar_module
from specdec.cli import TextStreamer, main
from specdec.drafters import Draft, PromptLookup
from specdec.drafters.base import Drafter
from specdec.engine import generate
from specdec.errors import TokenizerMismatchError
from specdec.grammar import Constraint, Grammar
from specdec.models.load import load_model
from specdec.models.quantize import quantize_model
from specdec.sampling import Penalties
from specdec.serve import server as serve_server
from specdec.serve.app import create_app
from specdec.serve.config import ServeConfig

from .conftest import VOCAB, make_byte_tokenizer, make_model, make_tokenizer, remake

# A chat template for the tiny word-level tokenizer, whose words are w0..w60.
CHAT_TEMPLATE = (
    "{% for m in messages %}w1 {{ m['content'] }} w2 {% endfor %}{% if add_generation_prompt %}w3{% endif %}"
)


@contextlib.contextmanager
def running(app):
    """Serve app with uvicorn on a free loopback port in a thread; yields the base URL."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


def client(url: str) -> OpenAI:
    return OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)


def metrics(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


def wait_for(condition, timeout: float = 15.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def raw_post(url: str, path: str, body: bytes) -> tuple[int, dict]:
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    conn.request("POST", path, body, {"Content-Type": "application/json"})
    r = conn.getresponse()
    return r.status, json.loads(r.read())


def words(seed: int, n: int = 8) -> str:
    """A prompt of tiny-tokenizer words with a repeated phrase (prompt lookup finds matches)."""
    ids = torch.randint(3, VOCAB, (n // 2,), generator=torch.Generator().manual_seed(seed)).tolist()
    return " ".join(f"w{i - 3}" for i in ids + ids)


def chat_ids(model, messages) -> list[int]:
    ids = model.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@pytest.fixture(scope="module")
def tiny(model_dir):
    """The tiny Llama loaded the way `specdec generate --target DIR` loads it, with a chat template."""
    model = load_model(str(model_dir))
    model.tokenizer.chat_template = CHAT_TEMPLATE
    return model


@pytest.fixture(scope="module")
def served(tiny):
    app = create_app(tiny, ServeConfig(drafter="prompt-lookup", k=3, model_name="tiny", max_queue=64, max_tokens=16))
    with running(app) as url:
        yield url


def greedy(model, ids, max_new, k=3, drafter="lookup", stop=()):
    return generate(
        model,
        ids,
        PromptLookup(3) if drafter == "lookup" else None,
        k=k,
        max_new_tokens=max_new,
        temperature=0.0,
        stop=list(stop),
    )


# ---- completions and chat ---------------------------------------------------------------------


def test_completion_equals_specdec_generate(served, tiny, model_dir, capsys, monkeypatch):
    prompt = "w1 w2 w3 w4 w5 w1 w2 w3"
    r = client(served).completions.create(
        model="tiny", prompt=prompt, max_tokens=24, temperature=0, extra_body={"k": 3}
    )
    # TextStreamer's default `out` is the sys.stdout of import time; point it at capsys's.
    monkeypatch.setattr(cli, "TextStreamer", lambda tok, stop: TextStreamer(tok, stop, out=sys.stdout))
    assert main(["generate", prompt, "--target", str(model_dir), "-k", "3", "--max-new-tokens", "24"]) == 0
    assert r.choices[0].text == capsys.readouterr().out.split("\n\n--- ")[0]
    ref = greedy(tiny, tiny.encode(prompt), 24)
    assert r.choices[0].finish_reason == ("length" if ref.stats.stop_reason == "length" else "stop")
    assert r.object == "text_completion" and r.model == "tiny"
    u = r.usage
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (8, len(ref.tokens), 8 + len(ref.tokens))
    spec = u.model_extra["speculative"]
    assert spec["k"] == 3 and spec["drafter"] == "prompt-lookup"
    assert (spec["rounds"], spec["drafted"], spec["accepted"]) == (
        ref.stats.rounds,
        ref.stats.drafted,
        ref.stats.accepted,
    )
    assert spec["acceptance_per_position"] == pytest.approx(ref.stats.acceptance_per_position)
    assert spec["mean_accepted_length"] == pytest.approx(ref.stats.tau)
    assert spec["tokens_per_s"] > 0


def test_completion_stream_with_stop_string_and_usage(served, tiny):
    prompt = words(3)
    ids = tiny.encode(prompt)
    full = greedy(tiny, ids, 16).text.split()
    assert len(full) >= 6, "the tiny model should not stop this early"
    stop = full[4]  # cuts the output inside: the streamed text must hold it back
    ref = greedy(tiny, ids, 16, stop=[stop])
    chunks = list(
        client(served).completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=16,
            temperature=0,
            stop=stop,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == ref.text
    assert stop not in ref.text
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "stop"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert len({c.id for c in chunks}) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.tokens)
    assert chunks[-1].usage.model_extra["speculative"]["accepted"] == ref.stats.accepted


def test_chat_plain_and_stream(served, tiny):
    messages = [{"role": "system", "content": "w9 w8"}, {"role": "user", "content": "w4 w5 w6 w4 w5"}]
    ref = greedy(tiny, chat_ids(tiny, messages), 12)
    c = client(served)
    r = c.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == ref.text
    assert r.usage.prompt_tokens == len(chat_ids(tiny, messages)) and r.usage.completion_tokens == len(ref.tokens)
    chunks = list(c.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0, stream=True))
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason
    # Content given as parts reads the same as a string.
    parts = [messages[0], {"role": "user", "content": [{"type": "text", "text": "w4 w5 w6 w4 w5"}]}]
    assert (
        c.chat.completions.create(model="tiny", messages=parts, max_tokens=12, temperature=0).choices[0].message.content
        == ref.text
    )


def test_drafter_and_k_per_request(served, tiny):
    prompt = words(5)
    ref = greedy(tiny, tiny.encode(prompt), 16)
    c = client(served)
    plain = c.completions.create(
        model="tiny", prompt=prompt, max_tokens=16, temperature=0, extra_body={"drafter": "none"}
    )
    spec = plain.usage.model_extra["speculative"]
    assert plain.choices[0].text == ref.text  # speculation does not change greedy output
    assert spec["drafter"] == "none" and spec["k"] == 0 and spec["drafted"] == 0
    assert spec["rounds"] == plain.usage.completion_tokens
    k1 = c.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0, extra_body={"k": 1})
    assert k1.choices[0].text == ref.text
    assert k1.usage.model_extra["speculative"]["k"] == 1
    assert len(k1.usage.model_extra["speculative"]["acceptance_per_position"]) <= 1


def test_a_draft_model_per_request(tiny):
    draft = make_model("llama", seed=7)  # the same word-level vocabulary as the tiny target
    prompt = words(8)
    ref = greedy(tiny, tiny.encode(prompt), 12, drafter=None, k=0)
    with running(create_app(tiny, ServeConfig(drafter="none", k=2, model_name="tiny"), draft=draft)) as url:
        c = client(url)
        r = c.completions.create(
            model="tiny", prompt=prompt, max_tokens=12, temperature=0, extra_body={"drafter": "model"}
        )
        assert r.choices[0].text == ref.text
        spec = r.usage.model_extra["speculative"]
        assert spec["drafter"] == "model" and spec["drafted"] > 0
        default = c.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
        assert default.usage.model_extra["speculative"]["drafter"] == "none"
    other = make_model("llama", seed=7, tokenizer=make_tokenizer([f"x{i}" for i in range(VOCAB - 3)]))
    with pytest.raises(TokenizerMismatchError):
        create_app(tiny, ServeConfig(drafter="model"), draft=other)


def test_sampling_with_a_seed_is_the_librarys_run_with_that_seed(served, tiny):
    c = client(served)
    runs = [
        c.completions.create(
            model="tiny", prompt=words(6), max_tokens=12, temperature=1.0, top_p=0.9, seed=s, extra_body={"top_k": 20}
        )
        .choices[0]
        .text
        for s in (1, 1, 2)
    ]
    ids = tiny.encode(words(6))
    library = {  # generate with the server's drafter and k, and each seed
        s: generate(
            tiny, ids, PromptLookup(3), k=3, max_new_tokens=12, temperature=1.0, top_p=0.9, top_k=20, seed=s
        ).text
        for s in (1, 2)
    }
    assert runs[0] == runs[1] == library[1] and runs[2] == library[2]
    assert library[1] != library[2]  # another seed, another sample


def test_50_concurrent_streams_each_equal_their_solo_greedy_output(served, tiny):
    prompts = [words(100 + i, n=6 + i % 5) for i in range(50)]
    expected = [greedy(tiny, tiny.encode(p), 10) for p in prompts]
    assert len({e.text for e in expected}) > 10  # distinct outputs, so a mix-up would show

    async def one(c: AsyncOpenAI, prompt: str):
        stream = await c.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
        return "".join(ch.choices[0].text for ch in chunks if ch.choices), {ch.id for ch in chunks}, chunks[-1].usage

    async def all_of_them():
        async with AsyncOpenAI(base_url=served + "/v1", api_key="x", max_retries=0, timeout=120) as c:
            return await asyncio.gather(*(one(c, p) for p in prompts))

    results = asyncio.run(all_of_them())
    assert len(results) == 50
    for (text, ids, usage), ref in zip(results, expected):
        assert text == ref.text and usage.completion_tokens == len(ref.tokens)
        assert len(ids) == 1
    assert len({next(iter(ids)) for _, ids, _ in results}) == 50
    assert metrics(served)["specdec_queue_depth"] == 0


# ---- the queue: 429 and cancellation ----------------------------------------------------------


class GateDrafter(Drafter):
    """Blocks in propose() until released, so the worker stays busy for as long as a test needs."""

    def __init__(self):
        self.entered, self.release = threading.Event(), threading.Event()

    def prepare(self, target):
        pass

    def propose(self, context, k, sampler):
        self.entered.set()
        assert self.release.wait(30)
        return Draft([])


class SlowDrafter(Drafter):
    """Proposes nothing, slowly: a full 80-token run takes about 4 s."""

    def __init__(self):
        self.counter = [0]  # shared with its forks (Drafter.fork), one per sequence

    @property
    def calls(self) -> int:
        return self.counter[0]

    def prepare(self, target):
        pass

    def propose(self, context, k, sampler):
        self.counter[0] += 1
        time.sleep(0.05)
        return Draft([])


def test_full_queue_answers_429_and_the_queue_drains():
    gate = GateDrafter()
    model = make_model("llama", seed=1)  # never stops on EOS
    app = create_app(
        model,
        ServeConfig(drafter="gate", k=2, model_name="tiny", max_queue=2, max_tokens=4, max_batch=1),
        drafters={"gate": gate},
    )  # one sequence in the batch: the next two wait in the queue
    with running(app) as url, ThreadPoolExecutor(3) as pool:
        c = client(url)
        ask = lambda: c.completions.create(model="tiny", prompt="w1 w2 w3", max_tokens=4, temperature=0)  # noqa: E731
        first = pool.submit(ask)
        assert gate.entered.wait(15)
        queued = [pool.submit(ask), pool.submit(ask)]
        wait_for(lambda: metrics(url)["specdec_queue_depth"] == 2, what="two queued requests")
        with pytest.raises(openai.RateLimitError) as e:
            ask()
        assert e.value.status_code == 429 and "busy" in e.value.message
        assert metrics(url)['specdec_requests_total{outcome="rejected"}'] == 1
        gate.release.set()
        for f in [first, *queued]:
            assert f.result(timeout=30).usage.completion_tokens == 4
        m = metrics(url)
        assert m['specdec_requests_total{outcome="completed"}'] == 3 and m["specdec_queue_depth"] == 0


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_cancels_its_generation(stream):
    slow = SlowDrafter()
    model = make_model("llama", seed=1)
    app = create_app(model, ServeConfig(drafter="slow", k=1, model_name="tiny", max_tokens=80), drafters={"slow": slow})
    with running(app) as url:
        u = urlparse(url)
        body = json.dumps({"model": "tiny", "prompt": "w1 w2 w3", "max_tokens": 80, "temperature": 0, "stream": stream})
        sock = socket.create_connection((u.hostname, u.port), timeout=10)
        sock.sendall(
            f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n{body}".encode()
        )
        if stream:
            received = b""
            while b"data: " not in received:  # generation is under way
                chunk = sock.recv(65536)
                assert chunk, "the server closed the stream"
                received += chunk
        else:
            wait_for(lambda: slow.calls >= 3, what="generation to start")
        sock.close()
        wait_for(lambda: metrics(url)['specdec_requests_total{outcome="cancelled"}'] == 1, what="the cancellation")
        assert slow.calls < 60  # stopped long before its 80 tokens
        m = metrics(url)
        assert m['specdec_requests_total{outcome="completed"}'] == 0 and m["specdec_requests_running"] == 0
        # The worker is free again.
        r = client(url).completions.create(model="tiny", prompt="w1", max_tokens=3, temperature=0)
        assert r.usage.completion_tokens == 3


# ---- bad requests -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body, param, needle",
    [
        ({"max_tokens": -1}, "max_tokens", "greater than or equal to 0"),
        ({"max_tokens": "lots"}, "max_tokens", "integer"),
        ({"max_tokens": "12"}, "max_tokens", "integer"),  # a number as a string: refused, as OpenAI does
        ({"temperature": "0.5"}, "temperature", "number"),
        ({"stream": "true"}, "stream", "boolean"),
        ({"stop": ["s"] * 17}, "stop", "at most 16 stop strings, got 17"),
        ({"temperature": -0.5}, "temperature", "greater than or equal to 0"),
        ({"top_p": 1.5}, "top_p", "less than or equal to 1"),
        ({"top_p": 0}, "top_p", "greater than 0"),
        ({"k": -1}, "k", "k (draft length) must be >= 0"),
        ({"k": "bogus"}, "k", "'bogus'"),
        ({"k": 2.5}, "k", "expected an integer >= 0"),
        ({"stop": 3}, "stop", "expected a string or a list of strings"),
        ({"drafter": "nope"}, "drafter", "this server has: prompt-lookup"),
        ({"drafter": "model"}, "drafter", "--draft MODEL"),
        ({"n": 0}, "n", "n must be between 1 and 16"),
        ({"n": 17}, "n", "n must be between 1 and 16"),
        ({"logprobs": 21}, "logprobs", "logprobs must be between 0 and 20"),
        ({"logprobs": True}, "logprobs", "an integer 0..20"),
        ({"top_logprobs": 2}, "top_logprobs", "a chat field"),
        ({"prompt": ["w1", "w2"]}, "prompt", "one prompt per request"),
        ({"prompt": [1, 2, 10_000]}, "prompt", "outside the model's vocabulary"),
        ({"prompt": ""}, "prompt", "the prompt is empty"),
        ({"prompt": None}, "prompt", "prompt"),
        ({"seed": 2**70}, "seed", "seed"),
        ({"frequency_penalty": 2.5}, "frequency_penalty", "less than or equal to 2"),
        ({"presence_penalty": -3}, "presence_penalty", "greater than or equal to -2"),
        ({"repetition_penalty": 0}, "repetition_penalty", "greater than 0"),
        ({"logit_bias": {"5": 150}}, "logit_bias", "must be between -100 and 100, got 150"),
        ({"logit_bias": {"5": -100.5}}, "logit_bias", "must be between -100 and 100"),
        ({"logit_bias": {"w5": 1}}, "logit_bias", "'w5' is not a token id of tiny"),
        ({"logit_bias": {"5.0": 1}}, "logit_bias", "is not a token id"),
        ({"logit_bias": {"-1": 1}}, "logit_bias", "is not a token id"),
        ({"logit_bias": {str(VOCAB): 1}}, "logit_bias", f"a whole number 0..{VOCAB - 1}"),
        ({"logit_bias": {"5": "1"}}, "logit_bias", "valid number"),
        ({"logit_bias": [5]}, "logit_bias", "valid dictionary"),
        ({"min_p": 1.5}, "min_p", "less than or equal to 1"),
        ({"min_p": "0.1"}, "min_p", "valid number"),
        ({"stop_token_ids": [-1]}, "stop_token_ids", "greater than or equal to 0"),
        ({"stop_token_ids": ["5"]}, "stop_token_ids", "valid integer"),
        ({"ignore_eos": "yes"}, "ignore_eos", "valid boolean"),
        # the word-level toy tokenizer is one llguidance cannot read: structured output says so
        ({"response_format": {"type": "json_object"}}, "response_format", "llguidance cannot read its tokenizer"),
        ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend", "the fields it reads: model, max_tokens"),
    ],
)
def test_bad_parameters_get_400_with_a_clear_message(served, body, param, needle):
    status, err = raw_post(
        served, "/v1/completions", json.dumps({"model": "tiny", "prompt": "w1 w2", "max_tokens": 4, **body}).encode()
    )
    assert status == 400, err
    assert needle in err["error"]["message"]
    assert err["error"]["type"] == "invalid_request_error"
    if param:
        assert err["error"]["param"] == param


def test_neutral_penalties_are_accepted(served):
    body = {"model": "tiny", "prompt": "w1 w2", "max_tokens": 3, "temperature": 0}
    neutral = {
        **{"frequency_penalty": 0, "presence_penalty": 0.0, "repetition_penalty": 1, "logit_bias": {}},
        **{"min_p": 0, "stop_token_ids": [], "ignore_eos": False, "response_format": {"type": "text"}},
    }
    status, plain = raw_post(served, "/v1/completions", json.dumps(body).encode())
    status_n, with_neutral = raw_post(served, "/v1/completions", json.dumps({**body, **neutral}).encode())
    assert status == status_n == 200
    assert with_neutral["choices"][0]["text"] == plain["choices"][0]["text"]


def test_penalties_and_logprobs_equal_generates(served, tiny):
    prompt = "w1 w2 w3 w4 w5 w1 w2 w3 w4"
    body = dict(model="tiny", prompt=prompt, max_tokens=12, temperature=0, logprobs=3)
    penalties = dict(frequency_penalty=0.8, presence_penalty=0.3, repetition_penalty=1.2)
    r = client(served).completions.create(**body, extra_body={"k": 3, **penalties})
    want = generate(
        tiny, tiny.encode(prompt), PromptLookup(3), k=3, max_new_tokens=12, temperature=0,
        penalties=Penalties(0.8, 0.3, 1.2), logprobs=3,
    )  # fmt: skip
    plain = generate(tiny, tiny.encode(prompt), None, k=0, max_new_tokens=12, temperature=0)
    assert want.tokens != plain.tokens  # the penalties bite
    choice = r.choices[0]
    assert choice.text == want.text
    assert choice.logprobs.token_logprobs == [e.logprob for e in want.logprobs]  # exactly
    # each token's text as it adds to the output (an EOS shows as itself: it has a logprob too)
    assert "".join(choice.logprobs.tokens).startswith(choice.text) and len(choice.logprobs.tokens) == len(want.tokens)
    assert [list(top.values()) for top in choice.logprobs.top_logprobs] == [
        [lp for _, lp in e.top] for e in want.logprobs
    ]
    assert choice.logprobs.text_offset == [len("".join(choice.logprobs.tokens[:i])) for i in range(len(want.tokens))]
    # chat: logprobs = true with top_logprobs
    messages = [{"role": "user", "content": "w1 w2 w3 w1 w2"}]
    c = client(served).chat.completions.create(
        model="tiny", messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2
    )
    ids = chat_ids(tiny, messages)
    want = generate(tiny, ids, PromptLookup(3), k=3, max_new_tokens=6, temperature=0, logprobs=2)
    content = c.choices[0].logprobs.content
    assert [e.logprob for e in content] == [e.logprob for e in want.logprobs]
    assert [[t.logprob for t in e.top_logprobs] for e in content] == [[lp for _, lp in e.top] for e in want.logprobs]
    assert "".join(e.token for e in content) == c.choices[0].message.content


def test_n_choices_are_independent_sequences(served, tiny):
    prompt = "w1 w2 w3 w4 w1 w2"
    r = client(served).completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0.9, seed=5, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for i, c in enumerate(r.choices):  # choice i is the run with seed + i
        want = generate(tiny, tiny.encode(prompt), PromptLookup(3), k=3, max_new_tokens=8, temperature=0.9, seed=5 + i)
        assert c.text == want.text
    assert len({c.text for c in r.choices}) > 1
    assert r.usage.completion_tokens == 24 and r.usage.prompt_tokens == len(tiny.encode(prompt))
    stream = client(served).completions.create(
        model="tiny", prompt=prompt, max_tokens=8, temperature=0.9, seed=5, n=3, stream=True
    )
    texts = ["", "", ""]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [c.text for c in r.choices]


# ---- logit_bias, min_p, stop_token_ids, ignore_eos, structured output ---------------------------


def test_logit_bias_minus_100_never_produces_the_token(served, tiny):
    prompt = words(11)
    ids = tiny.encode(prompt)
    free = generate(tiny, ids, None, k=0, max_new_tokens=16, temperature=1.0, seed=4).tokens
    banned = sorted(set(free))[:4]
    bias = {str(t): -100 for t in banned}
    for extra in ({}, {"drafter": "none"}):
        r = client(served).completions.create(
            model="tiny", prompt=prompt, max_tokens=16, temperature=1.0, seed=4, n=4, logit_bias=bias, extra_body=extra
        )
        for choice in r.choices:
            out = tiny.encode(choice.text)
            assert out and not set(out) & set(banned), (out, banned)


@pytest.mark.parametrize("drafter, k", [("prompt-lookup", 3), ("none", 0)])
def test_logit_bias_and_min_p_equal_generates(served, tiny, drafter, k):
    """A greedy biased request and a seeded min-p one are specdec.generate's runs, speculative or not."""
    prompt = "w1 w2 w3 w4 w5 w1 w2 w3 w4"
    ids = tiny.encode(prompt)
    spec = (PromptLookup(3) if drafter != "none" else None, k)
    plain = generate(tiny, ids, *spec[:1], k=k, max_new_tokens=12, temperature=0)
    boost = plain.tokens[1]  # a token the model likes, pushed further: the output changes
    want = generate(tiny, ids, *spec[:1], k=k, max_new_tokens=12, temperature=0, logit_bias={boost: 5.0, 7: -100})
    assert want.tokens != plain.tokens and 7 not in want.tokens
    c = client(served)
    extra = {"drafter": drafter, "k": k}
    r = c.completions.create(
        model="tiny", prompt=prompt, max_tokens=12, temperature=0, logit_bias={str(boost): 5, "7": -100},
        extra_body=extra,
    )  # fmt: skip
    assert r.choices[0].text == want.text
    # min_p with sampling and a seed: the library's run with the same settings
    sample = dict(max_new_tokens=12, temperature=1.5, seed=2)
    want = generate(tiny, ids, *spec[:1], k=k, min_p=0.2, **sample)
    assert want.tokens != generate(tiny, ids, *spec[:1], k=k, **sample).tokens  # min-p bites
    r = c.completions.create(
        model="tiny", prompt=prompt, max_tokens=12, temperature=1.5, seed=2, extra_body={**extra, "min_p": 0.2}
    )
    assert r.choices[0].text == want.text


def test_stop_token_ids_and_ignore_eos(served, tiny):
    prompt = "w1 w2 w3 w4 w5 w1 w2 w3 w4"
    ids = tiny.encode(prompt)
    full = greedy(tiny, ids, 12)
    stop_id = full.tokens[4]
    want = generate(tiny, ids, PromptLookup(3), k=3, max_new_tokens=12, temperature=0, stop_token_ids=[stop_id])
    assert len(want.tokens) < 12 and want.stats.stop_reason == "stop" and want.tokens[-1] == stop_id
    c = client(served)
    r = c.completions.create(
        model="tiny", prompt=prompt, max_tokens=12, temperature=0, extra_body={"stop_token_ids": [stop_id]}
    )
    assert r.choices[0].text == want.text and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == len(want.tokens)
    # the end token pushed to the top ends the output at once, unless ignore_eos
    eos = sorted(tiny.eos_token_ids)[0]
    body = dict(model="tiny", prompt=prompt, max_tokens=6, temperature=0, logit_bias={str(eos): 100})
    ended = c.completions.create(**body)
    assert ended.choices[0].finish_reason == "stop" and ended.usage.completion_tokens <= 1
    kept = c.completions.create(**body, extra_body={"ignore_eos": True})
    want = generate(
        tiny, ids, PromptLookup(3), k=3, max_new_tokens=6, temperature=0, logit_bias={eos: 100}, ignore_eos=True
    )
    assert kept.choices[0].finish_reason == "length" and kept.usage.completion_tokens == 6 == len(want.tokens)
    assert kept.choices[0].text == want.text


BYTE_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}answer: "
ANSWER = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no", "maybe"]}},
    "required": ["answer"],
    "additionalProperties": False,
}

LARK = 'start: "a" ("b" | "c")+ "!"'


def byte_model():
    """A quantized (batch-invariant) toy model over the byte-level toy tokenizer llguidance reads
    (the word-level one it cannot), ending on </s>, with a chat template."""
    fp32 = make_model("llama", seed=3, tokenizer=make_byte_tokenizer())
    gguf = quantize_model(fp32.hf, "q8_0", "tiny")
    model = remake(fp32, hf=None, lean=None, gguf=gguf, config=fp32.hf.config, eos_token_ids=frozenset({2}))
    model.tokenizer.chat_template = BYTE_TEMPLATE
    return model


@pytest.fixture(scope="module")
def bytes_model():
    return byte_model()


@pytest.fixture(scope="module")
def bytes_served(bytes_model):
    app = create_app(bytes_model, ServeConfig(drafter="prompt-lookup", k=3, model_name="bytes", max_tokens=40))
    with running(app) as url:
        yield url


def test_the_grammar_tokenizer_is_built_at_startup():
    model = byte_model()
    assert model.tokenizer not in grammar_module._TOKENIZERS
    with running(create_app(model, ServeConfig(model_name="bytes"))):
        assert model.tokenizer in grammar_module._TOKENIZERS  # the first grammar request does not build it


@pytest.mark.parametrize("drafter, k", [("prompt-lookup", 3), ("none", 0)])
def test_response_format_json_schema_gives_valid_json(bytes_served, bytes_model, drafter, k):
    c = client(bytes_served)
    before = metrics(bytes_served)["specdec_forced_tokens_total"]
    messages = [{"role": "user", "content": "yes or no? answer: yes or no?"}]
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}}
    r = c.chat.completions.create(
        model="bytes", messages=messages, max_tokens=40, temperature=0, response_format=fmt,
        extra_body={"drafter": drafter, "k": k},
    )  # fmt: skip
    text = r.choices[0].message.content
    assert json.loads(text)["answer"] in ("yes", "no", "maybe") and set(json.loads(text)) == {"answer"}
    assert r.choices[0].finish_reason == "stop"
    ids = chat_ids(bytes_model, messages)
    spec = (PromptLookup(3),) if drafter != "none" else (None,)
    want = generate(bytes_model, ids, *spec, k=k, max_new_tokens=40, temperature=0, grammar=Grammar.json_schema(ANSWER))
    free = generate(bytes_model, ids, *spec, k=k, max_new_tokens=40, temperature=0)
    assert text == want.text != free.text  # the grammar bites, and the server's run is the library's
    forced = r.usage.model_extra["speculative"]["forced"]
    assert forced == want.stats.forced and (forced > 0) == (drafter != "none")  # keys and separators, free
    assert metrics(bytes_served)["specdec_forced_tokens_total"] == before + forced
    # a sampled, streamed one keeps to the schema too
    chunks = c.chat.completions.create(
        model="bytes", messages=messages, max_tokens=40, temperature=1.0, seed=3, response_format=fmt, stream=True
    )
    assert json.loads("".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices))["answer"] in (
        "yes", "no", "maybe",
    )  # fmt: skip


@pytest.mark.parametrize(
    "body, grammar",
    [
        ({"response_format": {"type": "json_object"}}, Grammar.json_object()),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, Grammar.choice(["yes", "no"])),
        ({"structured_outputs": {"json": json.dumps(ANSWER)}}, Grammar.json_schema(ANSWER)),
        ({"structured_outputs": {"regex": "(ab|cd)+x"}}, Grammar.regex("(ab|cd)+x")),
        ({"structured_outputs": {"grammar": LARK}}, Grammar.lark(LARK)),
        ({"structured_outputs": {"json_object": True}}, Grammar.json_object()),
        ({"guided_json": ANSWER}, Grammar.json_schema(ANSWER)),
        ({"guided_regex": "(ab|cd)+x"}, Grammar.regex("(ab|cd)+x")),
        ({"guided_choice": ["yes", "no"]}, Grammar.choice(["yes", "no"])),
        ({"guided_grammar": LARK}, Grammar.lark(LARK)),
    ],
)
def test_structured_output_aliases_equal_generates(bytes_served, bytes_model, body, grammar):
    prompt = "yes or no? answer: yes or no? answer: "
    r = client(bytes_served).completions.create(
        model="bytes", prompt=prompt, max_tokens=20, temperature=0, extra_body=body
    )
    ids = bytes_model.encode(prompt)
    want = generate(bytes_model, ids, PromptLookup(3), k=3, max_new_tokens=20, temperature=0, grammar=grammar)
    assert r.choices[0].text == want.text


@pytest.mark.parametrize(
    "body, param, needle",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "foo"}}}},
         "response_format", "Invalid type: foo"),
        ({"guided_json": {"enum": []}}, "guided_json", "guided_json: "),
        ({"guided_regex": "("}, "guided_regex", "unclosed group"),
        ({"structured_outputs": {"grammar": "start: x"}}, "structured_outputs", "unknown name"),
        ({"guided_choice": []}, "guided_choice", "non-empty list of strings"),
        ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "response_format",
         "response_format and guided_regex each ask for structured output"),
        ({"guided_json": ANSWER, "structured_outputs": {"regex": "a"}}, "structured_outputs",
         "structured_outputs and guided_json"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "got regex, choice"),
        ({"structured_outputs": {"json_object": False}}, "structured_outputs", "got none"),
        ({"response_format": {"type": "json_object", "schema": ANSWER}}, "response_format",
         "response_format.schema: not a key this server reads"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {}, "extra": 1}}},
         "response_format", "response_format.json_schema.extra: not a key"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": ANSWER}}}, "response_format",
         "response_format.json_schema.name: Field required"),
        ({"response_format": {"type": "json_schema"}}, "response_format", 'comes with "type": "json_schema"'),
        ({"response_format": {"type": "xml"}}, "response_format", "'text', 'json_object' or 'json_schema'"),
        ({"structured_outputs": {"json": ANSWER, "disable_any_whitespace": True}}, "structured_outputs",
         "structured_outputs.disable_any_whitespace: not a key"),
    ],
)  # fmt: skip
def test_bad_structured_output_gets_400_naming_the_field(bytes_served, body, param, needle):
    before = metrics(bytes_served)
    for path, base in [
        ("/v1/completions", {"prompt": "ab"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "ab"}]}),
    ]:
        status, err = raw_post(bytes_served, path, json.dumps({**base, "max_tokens": 4, **body}).encode())
        assert status == 400 and needle in err["error"]["message"], err
        assert err["error"]["param"] == param and err["error"]["type"] == "invalid_request_error"
    after = metrics(bytes_served)  # refused before the batch: nothing ran
    assert after['specdec_requests_total{outcome="invalid"}'] == before['specdec_requests_total{outcome="invalid"}'] + 2
    assert after["specdec_rounds_total"] == before["specdec_rounds_total"]


def test_a_grammar_is_compiled_once_per_server(bytes_model, monkeypatch):
    app = create_app(bytes_model, ServeConfig(model_name="bytes", max_tokens=20))
    built = []
    monkeypatch.setattr(serve_server, "Constraint", lambda g, m: built.append(g) or Constraint(g, m))
    with running(app) as url:
        body = dict(model="bytes", prompt="ab", max_tokens=20, temperature=0)
        texts = [
            client(url).completions.create(**body, extra_body={"guided_choice": ["yes", "no"]}).choices[0].text
            for _ in range(2)
        ]
        for _ in range(2):
            status, err = raw_post(url, "/v1/completions", json.dumps({**body, "guided_regex": "("}).encode())
            assert status == 400 and err["error"]["param"] == "guided_regex"
    assert texts[0] == texts[1] in ("yes", "no")
    assert built == [Grammar.choice(["yes", "no"]), Grammar.regex("(")]


def test_steps_are_reported_per_step(tiny):
    app = create_app(tiny, ServeConfig(drafter="prompt-lookup", k=3, model_name="tiny"))
    with running(app) as url, ThreadPoolExecutor(8) as pool:
        c = client(url)
        list(
            pool.map(
                lambda i: c.completions.create(model="tiny", prompt=words(i), max_tokens=12, temperature=0), range(8)
            )
        )
        m = metrics(url)
    steps = m["specdec_steps_total"]
    assert steps > 0 and m["specdec_forward_rows_count"] == steps
    assert m["specdec_batch_size_count"] > 0
    assert m["specdec_batch_size_sum"] / m["specdec_batch_size_count"] > 1  # requests shared forwards
    assert m["specdec_draft_length_count"] == m["specdec_rounds_total"]  # one draft length per round
    assert m['specdec_batch_size_bucket{le="+Inf"}'] == m["specdec_batch_size_count"]


def test_an_api_key_is_required_when_set_and_limits_are_kept(tiny):
    app = create_app(
        tiny,
        ServeConfig(
            drafter="prompt-lookup", k=3, model_name="tiny", max_tokens=8, api_key="s3cret", max_body_bytes=2000
        ),
    )
    with running(app) as url:
        with pytest.raises(openai.AuthenticationError, match="API key"):
            client(url).completions.create(model="tiny", prompt="w1 w2", max_tokens=2, temperature=0)
        good = OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0, timeout=60)
        r = good.completions.create(model="tiny", prompt="w1 w2", max_tokens=2, temperature=0)
        assert r.usage.completion_tokens == 2
        assert urllib.request.urlopen(url + "/health", timeout=10).status == 200  # not under /v1/: open
        with pytest.raises(openai.APIStatusError, match="limit of 2000 bytes") as e:
            good.completions.create(model="tiny", prompt="w1 " * 1000, max_tokens=2, temperature=0)
        assert e.value.status_code == 413
        with pytest.raises(openai.BadRequestError, match="ask for at most") as e:
            good.completions.create(model="tiny", prompt="w1 w2", max_tokens=tiny.n_ctx, temperature=0)
        assert e.value.body["param"] == "max_tokens"
    with pytest.raises(ValueError, match="api_key"):
        create_app(tiny, ServeConfig(api_key=" "))


@pytest.mark.parametrize(
    "message, needle",
    [
        ({"role": "wizard", "content": "w1"}, "messages.0.role: Input should be 'system', 'user', 'assistant'"),
        ({"role": "user", "content": None}, "a user message needs content"),
    ],
)
def test_bad_chat_messages_get_400_naming_the_field(served, message, needle):
    body = {"model": "tiny", "messages": [message], "max_tokens": 2}
    status, err = raw_post(served, "/v1/chat/completions", json.dumps(body).encode())
    assert status == 400 and needle in err["error"]["message"], err
    assert err["error"]["param"] == "messages"


def test_an_assistant_message_may_have_null_content(served):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "w1"}, {"role": "assistant", "content": None}]}
    status, out = raw_post(served, "/v1/chat/completions", json.dumps({**body, "max_tokens": 2}).encode())
    assert status == 200, out


def test_malformed_requests_never_crash_the_server(served, tiny):
    before = metrics(served)['specdec_requests_total{outcome="invalid"}']
    status, err = raw_post(served, "/v1/completions", b'{"model": "tiny", "prompt": ')
    assert status == 400 and "not valid JSON" in err["error"]["message"] and err["error"]["code"] == "invalid_json"
    status, err = raw_post(served, "/v1/chat/completions", b"[1, 2]")
    assert status == 400 and "JSON object" in err["error"]["message"]
    status, err = raw_post(served, "/v1/chat/completions", json.dumps({"model": "tiny", "messages": []}).encode())
    assert status == 400 and err["error"]["param"] == "messages"
    status, err = raw_post(served, "/v1/nothing", b"{}")
    assert status == 404 and "/v1/completions" in err["error"]["message"]
    c = client(served)
    with pytest.raises(openai.NotFoundError) as e:
        c.completions.create(model="gpt-4", prompt="w1", max_tokens=2)
    assert "'tiny'" in e.value.message and e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="tiny", prompt=" ".join(["w1"] * 200), max_tokens=2)
    assert e.value.body["code"] == "context_length_exceeded" and f"holds {tiny.n_ctx}" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": " ".join(["w1"] * 200)}])
    assert e.value.body["code"] == "context_length_exceeded"
    assert metrics(served)['specdec_requests_total{outcome="invalid"}'] >= before + 6
    # Still serving.
    assert json.loads(urllib.request.urlopen(served + "/health", timeout=10).read())["status"] == "ok"
    assert c.completions.create(model="tiny", prompt="w1 w2", max_tokens=2, temperature=0).usage.completion_tokens >= 1


@pytest.mark.parametrize(
    "body, param, needle",
    [
        ({"max_completion_tokens": "12"}, "max_completion_tokens", "integer"),
        ({"logprobs": 3}, "logprobs", "true or false in a chat request"),
        ({"tools": [{"type": "function"}]}, "tools", "tools are not supported"),
        ({"prompt": "w1"}, "prompt", "the fields it reads: model, max_tokens"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages.0.content", "only text"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages", "expected a string or a list of text parts"),
    ],
)
def test_bad_chat_parameters_get_400_naming_the_field(served, body, param, needle):
    messages = [{"role": "user", "content": "w1"}]
    status, err = raw_post(served, "/v1/chat/completions", json.dumps({"messages": messages, **body}).encode())
    assert status == 400 and needle in err["error"]["message"], err
    assert err["error"]["param"] == param


def test_a_body_not_sent_as_json_is_refused_saying_how_to_send_it(served):
    u = urlparse(served)
    body = json.dumps({"model": "tiny", "prompt": "w1", "max_tokens": 2}).encode()
    for headers, needle in [
        ({"Content-Type": "text/plain"}, "came with Content-Type: text/plain"),
        ({}, "came without a Content-Type"),
    ]:
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
        conn.request("POST", "/v1/completions", body, headers)
        r = conn.getresponse()
        err = json.loads(r.read())["error"]
        assert r.status == 400 and err["code"] == "invalid_json", err
        assert needle in err["message"] and "Content-Type: application/json" in err["message"]
    status, err = raw_post(served, "/v1/completions", b"")
    assert status == 400 and "the request body is empty" in err["error"]["message"]


def test_a_chunked_body_over_the_limit_gets_413(tiny):
    """Without a Content-Length the limit is checked on the body read."""
    app = create_app(tiny, ServeConfig(drafter="prompt-lookup", k=3, model_name="tiny", max_body_bytes=500))
    with running(app) as url:
        u = urlparse(url)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
        body = json.dumps({"model": "tiny", "prompt": "w1 " * 300, "max_tokens": 2}).encode()
        conn.request("POST", "/v1/completions", iter([body[:300], body[300:]]), {"Content-Type": "application/json"})
        r = conn.getresponse()
        err = json.loads(r.read())["error"]
        assert r.status == 413 and "limit of 500 bytes" in err["message"] and err["code"] == "request_too_large"
        assert metrics(url)['specdec_requests_total{outcome="invalid"}'] == 1


def test_a_model_without_a_chat_template_says_so():
    app = create_app(make_model("llama", seed=1), ServeConfig(model_name="plain"))
    with running(app) as url:
        with pytest.raises(openai.BadRequestError) as e:
            client(url).chat.completions.create(model="plain", messages=[{"role": "user", "content": "w1"}])
        assert "no chat template" in e.value.message and "/v1/completions" in e.value.message


def test_bad_server_options_are_refused(tiny, capsys):
    with pytest.raises(ValueError, match="unknown drafter 'model'.*--draft MODEL"):
        create_app(tiny, ServeConfig(drafter="model"))
    with pytest.raises(ValueError, match="max_queue"):
        create_app(tiny, ServeConfig(max_queue=0))
    with pytest.raises(ValueError, match="prefill_ratio must be >= 0"):
        create_app(tiny, ServeConfig(prefill_ratio=-1))
    assert main(["serve", "-k", "-1"]) == 2
    assert "k (draft length) must be >= 0" in capsys.readouterr().err


# ---- models, health, metrics ------------------------------------------------------------------


def test_models_and_health(served, tiny):
    models = client(served).models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert models.data[0].model_extra["max_model_len"] == tiny.n_ctx
    health = json.loads(urllib.request.urlopen(served + "/health", timeout=10).read())
    assert health == {"status": "ok", "model": "tiny", "queue_depth": 0, "running": 0}


def test_metrics_count_one_request_exactly(tiny):
    app = create_app(tiny, ServeConfig(drafter="prompt-lookup", k=3, model_name="tiny"))
    prompt = "w1 w2 w3 w4 w5 w1 w2 w3 w4"
    ref = greedy(tiny, tiny.encode(prompt), 20)
    with running(app) as url:
        r = client(url).completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0)
        text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
        m = metrics(url)
    for name in [
        "specdec_drafts_total",
        "specdec_draft_tokens_total",
        "specdec_accepted_tokens_total",
        "specdec_acceptance_rate_by_position",
        "specdec_request_latency_seconds",
        "specdec_queue_depth",
    ]:
        assert f"# TYPE {name} " in text
    s = ref.stats
    assert s.drafted > 0 and s.accepted > 0  # the prompt repeats: prompt lookup drafts and hits
    assert m["specdec_draft_tokens_total"] == s.drafted == r.usage.model_extra["speculative"]["drafted"]
    assert m["specdec_accepted_tokens_total"] == s.accepted
    assert m["specdec_drafts_total"] == s.drafted_at[0]
    assert m["specdec_rounds_total"] == s.rounds
    assert m["specdec_generation_tokens_total"] == r.usage.completion_tokens == len(ref.tokens)
    assert m["specdec_prompt_tokens_total"] == 9
    for i, (d, a) in enumerate(zip(s.drafted_at, s.accepted_at)):
        assert m[f'specdec_draft_tokens_by_position_total{{position="{i}"}}'] == d
        assert m[f'specdec_accepted_tokens_by_position_total{{position="{i}"}}'] == a
        assert m[f'specdec_acceptance_rate_by_position{{position="{i}"}}'] == pytest.approx(a / d)
    assert m['specdec_requests_total{outcome="completed"}'] == 1
    assert m["specdec_request_latency_seconds_count"] == 1
    assert m['specdec_request_latency_seconds_bucket{le="+Inf"}'] == 1
    assert 0 < m["specdec_request_latency_seconds_sum"] < 60
    assert m["specdec_queue_depth"] == 0 and m["specdec_queue_capacity"] == 64


METRIC_FAMILIES = {  # what users scrape: each metric's name and type
    "specdec_requests_total": "counter",
    "specdec_rounds_total": "counter",
    "specdec_drafts_total": "counter",
    "specdec_draft_tokens_total": "counter",
    "specdec_accepted_tokens_total": "counter",
    "specdec_prompt_tokens_total": "counter",
    "specdec_generation_tokens_total": "counter",
    "specdec_draft_tokens_by_position_total": "counter",
    "specdec_accepted_tokens_by_position_total": "counter",
    "specdec_forced_tokens_total": "counter",
    "specdec_acceptance_rate": "gauge",
    "specdec_acceptance_rate_by_position": "gauge",
    "specdec_request_latency_seconds": "histogram",
    "specdec_steps_total": "counter",
    "specdec_forward_seconds_total": "counter",
    "specdec_batch_size": "histogram",
    "specdec_forward_rows": "histogram",
    "specdec_draft_length": "histogram",
    "specdec_queue_depth": "gauge",
    "specdec_queue_capacity": "gauge",
    "specdec_requests_running": "gauge",
    "specdec_batch_sequences": "gauge",
    "specdec_batch_capacity": "gauge",
}


def test_metric_families_are_kept_and_each_app_counts_apart(tiny):
    apps = [create_app(tiny, ServeConfig(model_name="tiny", max_queue=q)) for q in (5, 7)]
    apps[0].state.server.metrics.count("invalid")
    texts = [app.state.server.metrics.render().decode() for app in apps]
    for text, invalid, capacity in zip(texts, (1, 0), (5, 7)):
        types = dict(line.split()[2:4] for line in text.splitlines() if line.startswith("# TYPE "))
        assert types == METRIC_FAMILIES
        assert "_created" not in text  # no series beside the families above
        samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
        assert float(samples['specdec_requests_total{outcome="invalid"}']) == invalid
        assert float(samples["specdec_queue_capacity"]) == capacity
        assert samples["specdec_acceptance_rate"] == "NaN"  # nothing drafted yet


# ---- the load generator -----------------------------------------------------------------------


def test_loadtest_percentiles_and_table():
    from specdec.serve.loadtest import Answer, Level, _percentiles, report, table

    p = _percentiles([float(x) for x in range(1, 101)])
    assert (p["p50"], p["p90"], p["p99"], p["mean"]) == (50, 90, 99, 50.5)
    a = Answer(text="x y", tokens=5, ttft_s=0.1, gaps_s=[0.05, 0.05], latency_s=0.5)
    assert a.tpot_s == pytest.approx(0.1)
    levels = [Level(1, 2.0, [a, a]), Level(2, 1.0, [a, Answer(text="other", tokens=5, ttft_s=0.2, latency_s=0.6)])]
    rows = report("s", levels)
    assert [r["tokens_per_s"] for r in rows] == [5.0, 10.0] and [r["same_as_first"] for r in rows] == [2, 1]
    assert "| s | 2 | 2 | 10.0 | 2.00 |" in table(rows)


def test_loadtest_percentiles_are_nearest_rank_values():
    from specdec.serve.loadtest import _percentiles

    assert _percentiles([3.0, 1.0, 2.0]) == {"p50": 2.0, "p90": 3.0, "p99": 3.0, "mean": 2.0}
    assert _percentiles([20.0, 10.0])["p50"] == 10.0  # a value of the list, not an interpolation
    assert _percentiles([1.0] * 9 + [100.0])["p90"] == 1.0 and _percentiles([1.0] * 9 + [100.0])["p99"] == 100.0
    assert all(math.isnan(v) for v in _percentiles([]).values())


def test_64_concurrent_streams_of_real_smollm2_each_equal_their_solo_output():
    """The serving goal: 64 streaming requests at once through the openai client, none lost or
    mixed, each equal to the same request's generate() alone (the quantized kernels are
    batch-invariant), with TTFT percentiles reported."""
    from specdec.models.registry import REGISTRY
    from specdec.models.weights import cache_dir, is_pulled
    from specdec.serve.loadtest import Request, run_level

    spec = REGISTRY["smollm2-135m"]
    if not is_pulled(spec.name, cache_dir()):
        pytest.skip(f"{spec.name} is not pulled: run `specdec models pull {spec.name}`")
    target = load_model(spec.name)
    texts = ["Name three colours.", "Count to ten: one, two,", "Hi", "Write a haiku about the sea.",
             "What is 2 + 2?", "List the planets.", "Say hello in French.", "def fib(n):"]  # fmt: skip
    ids = [target.encode(f"{t} (request {i})", chat=True) for i, t in enumerate(texts * 8)]
    app = create_app(target, ServeConfig(drafter="prompt-lookup", k="auto", model_name="smol", max_tokens=24))
    with running(app) as url:
        level = asyncio.run(
            run_level(url, "smol", [Request(ids=i) for i in ids], 64, dict(max_tokens=24, temperature=0))
        )
        m = metrics(url)
    assert [a.error for a in level.answers] == [None] * 64
    for prompt, answer in zip(ids, level.answers):
        want = generate(target, prompt, "prompt-lookup", k="auto", max_new_tokens=24)
        assert answer.text == want.text and answer.tokens == len(want.tokens)
    s = level.summary()
    print(f"64 streams: TTFT p50 {s['ttft_ms']['p50']:.0f} ms, p99 {s['ttft_ms']['p99']:.0f} ms")
    assert 0 < s["ttft_ms"]["p50"] <= s["ttft_ms"]["p99"]  # TTFT's size is the bench's, not a unit test's
    assert m["specdec_batch_size_sum"] / m["specdec_batch_size_count"] > 8  # they really ran together


def test_run_server_steps_the_batch_in_the_thread_that_called_it(tiny, monkeypatch):
    """run_server answers HTTP in a thread and steps the batch in its caller's thread (the main one
    for `specdec serve`), which it gives back at Ctrl-C."""
    from specdec.batch import Batch
    from specdec.serve.app import run_server

    stepped, real = set(), Batch.step
    monkeypatch.setattr(Batch, "step", lambda self: stepped.add(threading.current_thread().name) or real(self))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    prompt, texts = words(3), []

    def user():  # waits for the server, asks twice, then presses Ctrl-C
        try:
            url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 120  # create_app may build a kernel first
            while time.monotonic() < deadline:
                with contextlib.suppress(OSError):
                    urllib.request.urlopen(url + "/health", timeout=1)
                    break
                time.sleep(0.05)
            for _ in range(2):
                r = client(url).completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
                texts.append(r.choices[0].text)
        finally:
            os.kill(os.getpid(), signal.SIGINT)

    # Ctrl-C raises KeyboardInterrupt even where the process was started with SIGINT ignored (a shell's
    # background job: Python then installs no handler of its own)
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    thread = threading.Thread(target=user)
    thread.start()
    try:
        run_server(
            create_app(tiny, ServeConfig(drafter="prompt-lookup", k=3, model_name="tiny")),
            port=port,
            log_level="warning",
        )
    finally:
        signal.signal(signal.SIGINT, handler)
    thread.join(30)
    assert stepped == {threading.current_thread().name} and threading.current_thread() is threading.main_thread()
    assert texts == [greedy(tiny, tiny.encode(prompt), 8).text] * 2


def test_specdec_serve_answers_as_the_library_does(model_dir, tiny):
    """`specdec serve` as users run it, in a process of its own: health, and a completion equal to
    the library's."""
    from specdec.bench.serving import specdec_server

    prompt = "w1 w2 w3 w4 w1 w2 w3"
    with specdec_server(["--target", str(model_dir), "--drafter", "prompt-lookup", "-k", "3"]) as url:
        health = json.loads(urllib.request.urlopen(url + "/health", timeout=10).read())
        r = client(url).completions.create(model=str(model_dir), prompt=prompt, max_tokens=10, temperature=0)
    assert health["status"] == "ok"
    assert r.choices[0].text == greedy(tiny, tiny.encode(prompt), 10).text


def test_loadtest_command_drives_a_running_server(served, tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["loadtest", "--url", served, "--concurrency", "1,3", "--requests", "3", "--max-tokens", "4"]
    assert main([*argv, "--workload", "humaneval", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| server | concurrent |" in printed and f"| {served} | 3 | 3 |" in printed
    run = json.loads((out / "serving.json").read_text())
    assert [r["concurrency"] for r in run["rows"]] == [1, 3]
    assert all(r["failed"] == 0 and r["tokens"] == 12 and r["same_as_first"] == 3 for r in run["rows"])
    assert "cpu" in run and run["max_tokens"] == 4
    assert main(["loadtest", "--url", served, "--concurrency", "0"]) != 0
    assert "--concurrency, --limit, --requests and --max-tokens must be >= 1" in capsys.readouterr().err


FAKE_LLAMA_SERVER = """
import json, os, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
args = sys.argv[1:]
with open(os.environ["FAKE_ARGV"], "w") as f:
    json.dump(args, f)

class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert self.path == "/v1/completions" and body["stream"] and isinstance(body["prompt"], list)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        n = min(3, body["max_tokens"])
        for i in range(n):
            choice = {"index": 0, "text": "ab"[i % 2], "finish_reason": None, "logprobs": None}
            chunk = {"id": "x", "object": "text_completion", "created": 0, "model": body["model"], "choices": [choice]}
            self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\\n\\n")
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n, "total_tokens": n}
        end = {"id": "x", "object": "text_completion", "created": 0, "model": body["model"], "choices": []}
        end["usage"] = usage
        self.wfile.write(b"data: " + json.dumps(end).encode() + b"\\n\\ndata: [DONE]\\n\\n")

ThreadingHTTPServer(("127.0.0.1", int(args[args.index("--port") + 1])), Handler).serve_forever()
"""


def test_loadtest_drives_llama_server_on_the_targets_gguf_file(tmp_path, monkeypatch, capsys, model_dir):
    from specdec.models.load import load_model
    from specdec.models.registry import REGISTRY
    from specdec.models.weights import cache_dir, is_pulled

    if not is_pulled("smollm2-135m", cache_dir()):
        pytest.skip("smollm2-135m is not pulled: run `specdec models pull smollm2-135m`")
    script = tmp_path / "llama-server"
    script.write_text(f"#!{sys.executable}\n{FAKE_LLAMA_SERVER}")
    script.chmod(0o755)
    monkeypatch.setenv("SPECDEC_LLAMA_SERVER", str(script))
    monkeypatch.setenv("FAKE_ARGV", str(tmp_path / "argv.json"))  # where the stand-in writes its arguments
    argv = ["loadtest", "--target", "smollm2-135m", "--drafter", "", "--peers", "llama-server-ngram"]
    argv += ["--concurrency", "1,2", "--requests", "2", "--max-tokens", "3", "--workload", "humaneval"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "| llama.cpp server ngram-simple | 2 | 2 |" in printed
    started = json.loads((tmp_path / "argv.json").read_text())
    assert started[started.index("-m") + 1] == str(load_model(REGISTRY["smollm2-135m"].name).gguf.path)
    assert started[started.index("-np") + 1] == "2" and started[started.index("--spec-type") + 1] == "ngram-simple"
    argv = ["loadtest", "--target", "smollm2-135m", "--drafter", "", "--peers", "llama-server-draft"]
    argv += ["--draft", "smollm2-135m", "--peer-k", "3", "--concurrency", "1", "--requests", "1", "--max-tokens", "3"]
    assert main(argv) == 0
    assert "| llama.cpp server draft k=3 | 1 | 1 |" in capsys.readouterr().out
    started = json.loads((tmp_path / "argv.json").read_text())
    draft = started[started.index("-md") + 1]
    assert draft == started[started.index("-m") + 1] and started[started.index("--spec-draft-n-max") + 1] == "3"
    assert started[started.index("--spec-type") + 1] == "draft-simple"
    assert main(["loadtest", "--target", "smollm2-135m", "--peers", "llama-server-draft"]) != 0  # no draft
    assert "--peers llama-server-draft runs a draft model's GGUF file: give --draft" in capsys.readouterr().err
    assert main(["loadtest", "--target", "smollm2-135m", "--peers", "llama-server-eagle"]) != 0
    assert (
        "--peers takes vllm, vllm-ngram, llama-server, llama-server-ngram, llama-server-draft"
        in capsys.readouterr().err
    )
    assert main(["loadtest", "--target", str(model_dir), "--peers", "llama-server"]) != 0  # no server started
    assert "--peers llama-server runs a GGUF file: give a GGUF target" in capsys.readouterr().err


def test_loadtest_with_a_draft_starts_plain_and_model_lookup_servers_with_it(model_dir, monkeypatch):
    import specdec.bench.serving as serving
    from specdec.commands import loadtest as command

    started = []

    @contextlib.contextmanager
    def server(args, log=None):
        started.append((args[args.index("--drafter") + 1], args[args.index("--draft") + 1]))
        yield "http://127.0.0.1:9"

    monkeypatch.setattr(serving, "specdec_server", server)
    from specdec.serve import loadtest

    monkeypatch.setattr(command, "_driver", lambda args, levels: lambda *a: [])
    monkeypatch.setattr(loadtest, "report", lambda name, levels: [])
    monkeypatch.setattr(loadtest, "table", lambda rows: "")
    stand_in = types.SimpleNamespace(gguf=None, encode=lambda text, chat=False: [1, 2, 3])  # no chat template needed
    monkeypatch.setattr(command, "load_model", lambda spec, **kwargs: stand_in)
    argv = ["loadtest", "--target", str(model_dir), "--draft", str(model_dir), "--requests", "1", "--concurrency", "1"]
    assert main(argv) == 0
    assert started == [("none", str(model_dir)), ("model-lookup", str(model_dir))]
    started.clear()
    assert main([*argv, "--drafter", "prompt-lookup"]) == 0
    assert started == [("prompt-lookup", str(model_dir))]
