"""`tmx serve` with the api.openai plugin, through the official openai client and raw HTTP.

Two servers run for the module: `tiny` (muse-tiny, defaults) for the API surface, and `strict`
(the 30m preset, slow enough for a request to be caught running; an API key, one running request,
no queue, a small body limit and a short timeout) for authentication, 429, cancellation and
timeouts. Greedy decoding (temperature 0) makes outputs comparable between requests.
"""
import http.client
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from tmx_engine import BIN_DIR

openai = pytest.importorskip("openai", reason="the openai package is not installed "
                                              "(pip install -r tools/requirements.txt)")

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "../.."))
TMX = os.path.join(BIN_DIR, "tmx")
KEY = "sk-test-key"


def serve_available():
    if not os.path.exists(TMX) or not os.path.exists(
            os.path.join(BIN_DIR, "libtmx-api-openai.so")):
        return False
    r = subprocess.run([TMX, "serve", "--help"], capture_output=True, text=True)
    return r.returncode == 0


pytestmark = pytest.mark.skipif(not serve_available(),
                                reason=f"`tmx serve` or libtmx-api-openai.so is not in {BIN_DIR}")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A `tmx serve` process on a free port; stop() checks that it shuts down cleanly."""

    def __init__(self, model_dir, *settings):
        self.model_dir = model_dir
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = open(os.path.join(model_dir, f"serve-{self.port}.log"), "w+")
        args = [TMX, "serve", "--model", model_dir, "--port", str(self.port)]
        for s in settings:
            args += ["--set", s]
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tmx serve exited with {self.proc.returncode}: "
                                   f"{self.output()}")
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.1)
        self.proc.kill()
        raise RuntimeError("tmx serve did not answer /health within 60 s")

    def output(self):
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def client(self, **kw):
        kw.setdefault("api_key", "none")
        return openai.OpenAI(base_url=self.base + "/v1", max_retries=0, timeout=60, **kw)

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(timeout=60)
        assert rc == 0, self.output()
        self.log.close()


def make_model(tmp_path_factory, name, *args):
    out = tmp_path_factory.mktemp(name)
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", "make_tiny_model.py"), str(out),
                    *args], check=True, capture_output=True)
    return str(out)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    server = Server(make_model(tmp_path_factory, "api-tiny"), "api.openai.max_body=65536")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def strict(tmp_path_factory):
    server = Server(make_model(tmp_path_factory, "api-30m", "--preset", "30m"),
                    f"api.openai.api_key={KEY}", "max_running=1", "max_waiting=0",
                    "api.openai.timeout=1", "api.openai.cors_origin=*")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def hermes(tmp_path_factory):
    """muse-tiny whose tokenizer calls two unused special tokens <tool_call> and </tool_call>:
    to the server, a model that writes Hermes tool calls."""
    model = make_model(tmp_path_factory, "api-hermes")
    path = os.path.join(model, "tokenizer.json")
    with open(path) as f:
        tok = json.load(f)
    names = {"<|image|>": "<tool_call>", "<|video|>": "</tool_call>"}
    for t in tok["added_tokens"]:
        t["content"] = names.get(t["content"], t["content"])
    with open(path, "w") as f:
        json.dump(tok, f)
    server = Server(model)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def harmony(tmp_path_factory):
    """muse-tiny as a gpt-oss stand-in: the real harmony chat template, and three unused special
    tokens renamed to harmony's <|channel|>, <|message|> and <|call|> (<|start|> and <|end|>
    it has), which is what tells the server that the model writes harmony."""
    template = os.path.join(ROOT, "..", "shared", "data", "templates",
                            "openai-gpt-oss-120b.jinja")
    if not os.path.exists(template):
        pytest.skip(f"{template} is absent")
    model = make_model(tmp_path_factory, "api-harmony")
    path = os.path.join(model, "tokenizer.json")
    with open(path) as f:
        tok = json.load(f)
    names = {"<|image|>": "<|channel|>", "<|video|>": "<|message|>", "<|audio|>": "<|call|>"}
    for t in tok["added_tokens"]:
        t["content"] = names.get(t["content"], t["content"])
    with open(path, "w") as f:
        json.dump(tok, f)
    path = os.path.join(model, "tokenizer_config.json")
    with open(path) as f:
        cfg = json.load(f)
    with open(template) as f:
        cfg["chat_template"] = f.read()
    with open(path, "w") as f:
        json.dump(cfg, f)
    server = Server(model)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def configured(tmp_path_factory):
    """muse-tiny whose generation_config.json asks for greedy decoding and at most 5 new tokens
    (and top_k 50, transformers' default, which is not taken), served twice: as it says, and
    with config key generation_config off."""
    model = make_model(tmp_path_factory, "api-configured")
    path = os.path.join(model, "generation_config.json")
    with open(path) as f:
        gen = json.load(f)
    gen.update(temperature=0.0, top_k=50, max_new_tokens=5)
    with open(path, "w") as f:
        json.dump(gen, f)
    servers = Server(model), Server(model, "generation_config=false")
    yield servers
    for s in servers:
        s.stop()


def raw(server, method, path, body=None, headers=None):
    """(status, headers, body bytes) of one request on a fresh connection."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request(method, path, body=body, headers=headers or {})
    r = conn.getresponse()
    out = r.status, dict(r.getheaders()), r.read()
    conn.close()
    return out


def raw_bytes(server, data, timeout=10):
    """Everything the server sends back for `data` sent as is, until it closes."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=timeout) as s:
        s.sendall(data)
        chunks = []
        while True:
            b = s.recv(65536)
            if not b:
                return b"".join(chunks)
            chunks.append(b)


GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}
MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Four score and seven years ago"}]


# --- small endpoints --------------------------------------------------------------------------

def test_health_and_models(tiny):
    status, _, body = raw(tiny, "GET", "/health")
    assert status == 200 and json.loads(body) == {"status": "ok"}
    models = tiny.client().models.list()
    assert len(models.data) == 1
    m = models.data[0]
    assert m.id and m.owned_by == "tmx" and m.object == "model"
    assert m.model_extra["max_model_len"] > 0
    assert tiny.client().models.retrieve(m.id).id == m.id
    with pytest.raises(openai.NotFoundError) as e:
        tiny.client().models.retrieve("no-such-model")
    assert e.value.body["param"] == "model" and "no-such-model" in e.value.message
    status, headers, body = raw(tiny, "HEAD", "/health")
    assert status == 200 and body == b"" and int(headers["Content-Length"]) > 0


def test_tokenize_detokenize_round_trip(tiny):
    text = "Four score and seven years ago our fathers brought forth"
    status, _, body = raw(tiny, "POST", "/tokenize",
                          json.dumps({"prompt": text, "add_special_tokens": False}))
    assert status == 200
    tok = json.loads(body)
    assert tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] > 0
    status, _, body = raw(tiny, "POST", "/detokenize", json.dumps({"tokens": tok["tokens"]}))
    assert status == 200 and json.loads(body)["prompt"] == text
    # with the bos token (the tiny model has one) the count grows by one
    _, _, body = raw(tiny, "POST", "/tokenize", json.dumps({"prompt": text}))
    assert json.loads(body)["count"] == tok["count"] + 1


# --- chat -------------------------------------------------------------------------------------

def test_chat_usage_matches_tokenize(tiny):
    r = tiny.client().chat.completions.create(model="anything", messages=MESSAGES, max_tokens=6,
                                              **GREEDY)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.model != "anything"  # the server's model name is echoed
    c = r.choices[0]
    assert c.index == 0 and c.message.role == "assistant" and isinstance(c.message.content, str)
    assert c.finish_reason == "length"
    _, _, body = raw(tiny, "POST", "/tokenize", json.dumps({"messages": MESSAGES}))
    assert r.usage.prompt_tokens == json.loads(body)["count"]
    assert r.usage.completion_tokens == 6
    assert r.usage.total_tokens == r.usage.prompt_tokens + 6


def test_chat_stream_matches_whole(tiny):
    client = tiny.client()
    whole = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=12, **GREEDY)
    chunks = list(client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=12,
                                                 stream=True,
                                                 stream_options={"include_usage": True},
                                                 **GREEDY))
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_stream_wire_format(tiny):
    body = json.dumps({"messages": MESSAGES, "max_tokens": 3, "stream": True,
                       "temperature": 0})
    status, headers, data = raw(tiny, "POST", "/v1/chat/completions", body)
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    events = data.decode().split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    for e in events[:-2]:
        assert e.startswith("data: ")
        json.loads(e[len("data: "):])


def test_array_content_and_media_refused(tiny):
    client = tiny.client()
    parts = [{"role": "user", "content": [{"type": "text", "text": "Four score"},
                                          {"type": "text", "text": "and seven"}]}]
    r = client.chat.completions.create(model="m", messages=parts, max_tokens=2, **GREEDY)
    assert r.choices[0].finish_reason == "length"
    image = [{"role": "user", "content": [{"type": "image_url",
                                           "image_url": {"url": "data:image/png;base64,AA=="}}]}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=image, max_tokens=2)
    assert e.value.param == "messages" and "not supported" in e.value.message


def test_logprobs_chat(tiny):
    r = tiny.client().chat.completions.create(model="m", messages=MESSAGES, max_tokens=5,
                                              logprobs=True, top_logprobs=3, **GREEDY)
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    for e in content:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        tops = [t.logprob for t in e.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        assert e.top_logprobs[0].token == e.token  # greedy takes the most likely token
        assert abs(e.top_logprobs[0].logprob - e.logprob) < 1e-6


def test_n_and_seed(tiny):
    client = tiny.client()
    kw = dict(model="m", messages=MESSAGES, max_tokens=8, n=2, seed=1234, temperature=1.0,
              extra_body={"ignore_eos": True})
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert a.usage.completion_tokens == 16
    # a seed is the request's: the same prompt gives the same text wherever it sits in a batch
    kw = dict(model="m", max_tokens=8, seed=99, temperature=1.0, extra_body={"ignore_eos": True})
    one = client.completions.create(prompt="Hello there", **kw).choices[0].text
    two = client.completions.create(prompt=["Hi", "Hello there"], **kw).choices
    assert two[1].text == one


def test_generation_config_defaults(configured):
    served, plain = configured
    assert "sampling defaults from generation_config.json" in served.output()
    kw = dict(model="m", prompt="Four score and seven years ago", extra_body={"ignore_eos": True})
    greedy = served.client().completions.create(temperature=0, max_tokens=5, **kw)
    r = served.client().completions.create(**kw)  # greedy and 5 tokens, from the model's file
    assert r.usage.completion_tokens == 5 and r.choices[0].text == greedy.choices[0].text
    r = served.client().completions.create(max_tokens=7, seed=3, temperature=1.0, **kw)
    assert r.usage.completion_tokens == 7  # what a request sets wins
    r = plain.client().completions.create(max_tokens=40, seed=3, **kw)  # OpenAI's temperature 1
    again = plain.client().completions.create(max_tokens=40, seed=4, **kw)
    assert r.choices[0].text != again.choices[0].text
    assert "generation_config.json" not in plain.output()


def test_more_choices_than_the_server_holds(tiny):
    client = tiny.client()
    with pytest.raises(openai.BadRequestError) as e:  # 8 running + 64 waiting by default
        client.completions.create(model="m", prompt="Hi", max_tokens=1, n=73)
    assert e.value.param == "n" and "max_waiting" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="m", prompt=["Hi"] * 64, max_tokens=1, n=2)
    assert e.value.param == "n"
    assert len(client.completions.create(model="m", prompt="Hi", max_tokens=1, n=72).choices) == 72
    r = client.completions.create(model="m", prompt="Hi", max_tokens=1, n=2, best_of=2.0)
    assert len(r.choices) == 2
    ctx = client.models.list().data[0].model_extra["max_model_len"]
    with pytest.raises(openai.BadRequestError) as e:  # a batch's error says which prompt
        client.completions.create(model="m", prompt=[[5] * 10, [5] * ctx], max_tokens=1)
    assert e.value.param == "prompt" and f"your prompt[1] resulted in {ctx} tokens" in \
        e.value.message


def test_special_tokens_skipped_unless_asked(tiny):
    with open(os.path.join(tiny.model_dir, "tokenizer.json")) as f:
        special = {t["content"]: t["id"] for t in json.load(f)["added_tokens"] if t["special"]}
    image = special["<|image|>"]
    client = tiny.client()
    kw = dict(model="m", prompt="Hi", max_tokens=3, temperature=0, logit_bias={str(image): 100})
    r = client.completions.create(**kw, extra_body={"ignore_eos": True})
    assert r.choices[0].text == "" and r.usage.completion_tokens == 3
    r = client.completions.create(**kw, extra_body={"ignore_eos": True,
                                                    "skip_special_tokens": False})
    assert r.choices[0].text == "<|image|>" * 3


def test_bad_parameters_named(tiny):
    client = tiny.client()
    cases = [
        (dict(temperature="hot"), "temperature"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(n="two"), "n"),
        (dict(stop=5), "stop"),
        (dict(response_format={"type": "json_object"}), "response_format"),
        (dict(extra_body={"top_logprobs": 2}), "top_logprobs"),
        (dict(logit_bias={"not-a-token": 1}), "logit_bias"),
        (dict(extra_body={"tool_choice": "required"}), "tool_choice"),
        (dict(max_tokens=10 ** 6), "max_tokens"),
        (dict(max_completion_tokens=10 ** 6), "max_completion_tokens"),
        (dict(stream_options={"include_usage": True}), "stream_options"),
        (dict(extra_body={"skip_special_tokens": "no"}), "skip_special_tokens"),
    ]
    for kw, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="m", messages=MESSAGES, **kw)
        assert e.value.param == param, (kw, e.value.message)
    for messages in ([], "hello", [{"role": "wizard", "content": "x"}], [{"role": "user"}]):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="m", messages=messages)
        assert e.value.param == "messages"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "\0"}])
    assert "U+0000" in e.value.message
    # A number out of range fails in the JSON parser, which names no member: the server does.
    for extra, param in (({"max_tokens": 10**20}, "max_tokens"), ({"stop": [10**20]}, None)):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="m", messages=MESSAGES, extra_body=extra)
        assert e.value.param == param and "is out of range" in e.value.message, e.value.message
    status, _, body = raw(tiny, "POST", "/v1/completions",
                          '{"prompt": "x", "temperature" : 1e999}')
    assert status == 400 and json.loads(body)["error"]["param"] == "temperature", body


def test_assistant_message_without_content(tiny):
    client = tiny.client()
    for assistant in ({"role": "assistant"}, {"role": "assistant", "content": None}):
        r = client.chat.completions.create(model="m", max_tokens=2, temperature=0,
                                           messages=[MESSAGES[1], assistant, MESSAGES[1]])
        assert r.choices[0].finish_reason in ("length", "stop")


def test_tools_refused_without_a_tool_format(tiny):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with pytest.raises(openai.BadRequestError) as e:
        tiny.client().chat.completions.create(model="m", messages=MESSAGES, tools=tools)
    assert e.value.param == "tools" and "not supported" in e.value.message


def test_tool_markup_held_back(hermes):
    """The model writes <tool_call> (forced by logit_bias) but no valid call: a stream holds the
    markup back from the marker on, and at the end it comes back as plain content."""
    client = hermes.client()
    ids = json.loads(raw(hermes, "POST", "/tokenize", json.dumps(
        {"prompt": "<tool_call>", "add_special_tokens": False}))[2])["tokens"]
    assert len(ids) == 1
    tools = [{"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}]
    kw = dict(model="m", messages=MESSAGES, max_tokens=4, tools=tools,
              logit_bias={str(ids[0]): 100}, **GREEDY)
    whole = client.chat.completions.create(**kw).choices[0]
    assert whole.message.content == "<tool_call>" * 4 and not whole.message.tool_calls
    assert whole.finish_reason == "length"
    chunks = [c.choices[0] for c in client.chat.completions.create(stream=True, **kw)]
    contents = [c.delta.content for c in chunks if c.delta.content]
    assert contents == ["<tool_call>" * 4]  # nothing went out before the end
    kw.pop("tools")  # no tools: streamed as it comes (the stand-in's <tool_call> is special)
    kw["extra_body"] = {**kw["extra_body"], "skip_special_tokens": False}
    chunks = [c.choices[0] for c in client.chat.completions.create(stream=True, **kw)]
    assert [c.delta.content for c in chunks if c.delta.content] == ["<tool_call>"] * 4


WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather at a place.",
    "parameters": {"type": "object", "properties": {"location": {"type": "string"}},
                   "required": ["location"]}}}]


def token_id(server, text):
    ids = json.loads(raw(server, "POST", "/tokenize", json.dumps(
        {"prompt": text, "add_special_tokens": False}))[2])["tokens"]
    assert len(ids) == 1, (text, ids)
    return ids[0]


def test_harmony_prompt_with_tools(harmony):
    """Tools are accepted for a harmony model and rendered by its template, as are earlier
    calls and their results (arguments sent as a JSON string come back as an object)."""
    messages = MESSAGES + [
        {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"location": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    status, _, body = raw(harmony, "POST", "/tokenize", json.dumps(
        {"messages": messages, "tools": WEATHER}))
    assert status == 200, body
    ids = json.loads(body)["tokens"]
    text = json.loads(raw(harmony, "POST", "/detokenize", json.dumps({"tokens": ids}))[2])["prompt"]
    assert "<|start|>developer<|message|># Instructions\n\nYou are terse." in text
    assert "namespace functions {" in text and "type get_weather = (_: {" in text
    assert ("<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
            '{"location": "Paris"}<|call|>') in text
    assert text.endswith("<|start|>assistant")
    assert token_id(harmony, "<|channel|>") in ids and token_id(harmony, "<|message|>") in ids


def test_harmony_call_ends_generation(harmony):
    """<|call|> ends a harmony choice even where the model's config does not list it."""
    call = token_id(harmony, "<|call|>")
    kw = dict(model="m", messages=MESSAGES, max_tokens=8, tools=WEATHER,
              logit_bias={str(call): 100}, **GREEDY)
    r = harmony.client().chat.completions.create(**kw)
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 1
    assert r.choices[0].message.content == "" and not r.choices[0].message.tool_calls


def test_harmony_control_tokens_never_leak(harmony):
    """A model that writes only <|message|>: a message with no header, then control tokens that
    mean nothing there. No control token reaches content, streamed or whole."""
    kw = dict(model="m", messages=MESSAGES, max_tokens=4,
              logit_bias={str(token_id(harmony, "<|message|>")): 100}, **GREEDY)
    client = harmony.client()
    whole = client.chat.completions.create(**kw).choices[0]
    assert whole.message.content == "" and whole.finish_reason == "length"
    chunks = [c.choices[0] for c in client.chat.completions.create(stream=True, **kw)]
    assert not [c.delta.content for c in chunks if c.delta.content]
    assert chunks[-1].finish_reason == "length"
    # completions return the output as written, its special tokens only when asked (as vLLM)
    kw = dict(model="m", prompt="Hi", max_tokens=2, logit_bias=kw["logit_bias"], temperature=0)
    text = client.completions.create(**kw, extra_body={"ignore_eos": True}).choices[0].text
    assert text == ""
    text = client.completions.create(**kw, extra_body={"ignore_eos": True,
                                                       "skip_special_tokens": False})
    assert text.choices[0].text == "<|message|>" * 2


def test_harmony_malformed_header_held_back(harmony):
    """<|channel|> over and over is a header that never gets its <|message|>: a stream holds it
    back whole, and at the end it is content as the model wrote it."""
    kw = dict(model="m", messages=MESSAGES, max_tokens=4, tools=WEATHER,
              logit_bias={str(token_id(harmony, "<|channel|>")): 100}, **GREEDY)
    client = harmony.client()
    whole = client.chat.completions.create(**kw).choices[0]
    assert whole.message.content == "<|channel|>" * 4 and not whole.message.tool_calls
    assert whole.finish_reason == "length"
    chunks = [c.choices[0] for c in client.chat.completions.create(stream=True, **kw)]
    assert [c.delta.content for c in chunks if c.delta.content] == ["<|channel|>" * 4]


# --- completions ------------------------------------------------------------------------------

def test_completions_echo_batch_and_logprobs(tiny):
    client = tiny.client()
    r = client.completions.create(model="m", prompt="Four score", max_tokens=4, echo=True,
                                  **GREEDY)
    assert r.object == "text_completion" and r.choices[0].text.startswith("Four score")
    plain = client.completions.create(model="m", prompt="Four score", max_tokens=4, **GREEDY)
    assert r.choices[0].text == "Four score" + plain.choices[0].text
    batch = client.completions.create(model="m", prompt=["Four score", "We the People"], n=2,
                                      max_tokens=3, **GREEDY)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.choices[0].text == batch.choices[1].text  # greedy: both choices agree
    lp = client.completions.create(model="m", prompt="Four score", max_tokens=4, logprobs=2,
                                   **GREEDY).choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(len(t) <= 2 for t in lp.top_logprobs) and lp.text_offset[0] == 0
    ids = json.loads(raw(tiny, "POST", "/tokenize", json.dumps({"prompt": "Four score"}))[2])
    by_ids = client.completions.create(model="m", prompt=ids["tokens"], max_tokens=4, **GREEDY)
    assert by_ids.choices[0].text == plain.choices[0].text
    assert by_ids.usage.prompt_tokens == ids["count"]


def printable_stop(text):
    """A short ASCII-letter string from the middle of text, and where it first occurs."""
    for m in re.finditer(r"[A-Za-z]{2}", text):
        if m.start() >= 2:
            return m.group(), text.index(m.group())
    return None, None


def test_stop_strings(tiny):
    client = tiny.client()
    prompt = "It was the best of times, it was the worst of times, it was"
    full = client.completions.create(model="m", prompt=prompt, max_tokens=48,
                                     **GREEDY).choices[0].text
    stop, at = printable_stop(full)
    assert stop, f"no letters in the greedy output {full!r}"
    never = "#never#"
    assert never not in full
    r = client.completions.create(model="m", prompt=prompt, max_tokens=48, stop=[never, stop],
                                  **GREEDY)
    assert r.choices[0].text == full[:at] and r.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model="m", prompt=prompt, max_tokens=48, stop=stop,
                                         stream=True, **GREEDY)
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == full[:at]
    assert chunks[-1].choices[0].finish_reason == "stop"


# --- raw HTTP ---------------------------------------------------------------------------------

def test_http_errors(tiny):
    status, _, body = raw(tiny, "GET", "/nope")
    assert status == 404 and json.loads(body)["error"]["code"] == 404
    status, headers, body = raw(tiny, "GET", "/v1/chat/completions")
    assert status == 405 and "POST" in headers["Allow"]
    status, _, body = raw(tiny, "POST", "/v1/chat/completions", '{"messages": [1,}')
    err = json.loads(body)["error"]
    assert status == 400 and "line 1" in err["message"] and err["type"] == "invalid_request_error"
    status, _, body = raw(tiny, "POST", "/v1/chat/completions", b'{"messages": "\xff"}')
    assert status == 400
    status, _, body = raw(tiny, "POST", "/v1/completions", "[1, 2]")
    assert status == 400
    status, _, _ = raw(tiny, "POST", "/v1/completions", "x" * 100000)  # max_body is 65536
    assert status == 413
    reply = raw_bytes(tiny, b"\x00\xffGARBAGE\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 400")
    assert raw(tiny, "GET", "/health")[0] == 200  # still serving


def test_keep_alive_and_pipelining(tiny):
    conn = http.client.HTTPConnection("127.0.0.1", tiny.port, timeout=30)
    for _ in range(3):
        conn.request("POST", "/tokenize", json.dumps({"prompt": "Liberty"}))
        r = conn.getresponse()
        assert r.status == 200 and r.getheader("Connection") == "keep-alive"
        r.read()
    conn.close()
    req = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    reply = raw_bytes(tiny, req * 3 + b"GET /health HTTP/1.1\r\nConnection: close\r\n\r\n")
    assert reply.count(b"HTTP/1.1 200") == 4


def test_concurrent_streams(tiny):
    def one(seed):
        body = json.dumps({"prompt": "We the People", "max_tokens": 16, "stream": True,
                           "seed": seed, "ignore_eos": True})
        status, _, data = raw(tiny, "POST", "/v1/completions", body)
        events = data.decode().split("\n\n")
        assert status == 200 and events[-2:] == ["data: [DONE]", ""]
        return [json.loads(e[len("data: "):])["choices"][0]["finish_reason"]
                for e in events[:-2]][-1]

    with ThreadPoolExecutor(16) as pool:
        assert list(pool.map(one, range(32))) == ["length"] * 32


def test_fuzzed_requests_keep_the_server_up(tiny):
    rng = random.Random(7)
    values = [None, 0, -1, 1, 2.5, 1e308, "", "x", [], {}, [1, "a"], {"a": 1}, True, False,
              [{"role": "user"}], [{"role": "user", "content": [{"type": "text"}]}]]
    base = {"model": "m", "messages": MESSAGES, "prompt": "Four", "max_tokens": 2, "n": 1,
            "stop": ["a"], "logprobs": 1, "logit_bias": {"5": 1}, "stream": False,
            "stream_options": {"include_usage": True}, "temperature": 0.5, "seed": 1,
            "tools": [], "tool_choice": "none", "echo": False, "top_logprobs": 1}
    for i in range(200):
        req = dict(base)
        for _ in range(rng.randint(1, 3)):
            key = rng.choice(list(base))
            if rng.random() < 0.2:
                req.pop(key, None)
            else:
                req[key] = rng.choice(values)
        path = rng.choice(["/v1/chat/completions", "/v1/completions", "/tokenize",
                           "/detokenize"])
        status, headers, body = raw(tiny, "POST", path, json.dumps(req))
        assert status in (200, 400), (req, status, body)
        if headers.get("Content-Type", "").startswith("application/json"):
            json.loads(body)
    valid = (b"POST /v1/completions HTTP/1.1\r\nContent-Length: 40\r\n\r\n"
             b'{"prompt": "Four score", "max_tokens": 2}')
    for i in range(200):
        data = bytearray(valid)
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        with socket.create_connection(("127.0.0.1", tiny.port), timeout=10) as s:
            s.sendall(bytes(data[:rng.randint(1, len(data))]))
            s.shutdown(socket.SHUT_WR)  # EOF: the server must close, not wait
            while s.recv(65536):
                pass
    assert raw(tiny, "GET", "/health")[0] == 200
    r = tiny.client().completions.create(model="m", prompt="Four", max_tokens=2, **GREEDY)
    assert r.choices[0].finish_reason == "length"


def metric_values(server):
    status, headers, body = raw(server, "GET", "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    values = {}
    for line in body.decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def test_metrics(tiny):
    tiny.client().completions.create(model="m", prompt="We the People", max_tokens=3, **GREEDY)
    values = metric_values(tiny)
    model = tiny.client().models.list().data[0].id
    label = f'{{model_name="{model}"}}'
    assert values["tmx:prompt_tokens_total" + label] > 0
    assert values["tmx:generation_tokens_total" + label] >= 3
    length = f'tmx:request_success_total{{model_name="{model}",finished_reason="length"}}'
    assert values[length] >= 1
    assert values["tmx:num_requests_running" + label] == 0
    assert values["tmx:time_to_first_token_seconds_count" + label] >= 1
    inf = f'tmx:time_to_first_token_seconds_bucket{{model_name="{model}",le="+Inf"}}'
    assert values[inf] == values["tmx:time_to_first_token_seconds_count" + label]
    for name in ("kv_cache_usage_perc", "num_requests_waiting", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "inter_token_latency_seconds_sum"):
        assert "tmx:" + name + label in values
    # a stop string ends the request as stopped, not aborted (max_tokens far beyond it: the
    # scheduler runs ahead of the front end, and one that reached max_tokens first is counted
    # as finished by length)
    full = tiny.client().completions.create(model="m", prompt="We the People", max_tokens=16,
                                            **GREEDY).choices[0].text
    stop, _ = printable_stop(full)
    reason = f'tmx:request_success_total{{model_name="{model}",finished_reason="%s"}}'
    before = metric_values(tiny)
    r = tiny.client().completions.create(model="m", prompt="We the People", max_tokens=1000,
                                         stop=stop, **GREEDY)
    assert r.choices[0].finish_reason == "stop"
    deadline = time.monotonic() + 10  # the scheduler counts it within a step
    while metric_values(tiny)[reason % "stop"] == before[reason % "stop"]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert metric_values(tiny)[reason % "abort"] == before[reason % "abort"]


# --- the strict server: key, queue bound, cancellation, timeouts ------------------------------

def test_api_key(strict):
    with pytest.raises(openai.AuthenticationError):
        strict.client(api_key="wrong").models.list()
    status, _, _ = raw(strict, "GET", "/v1/models")
    assert status == 401
    assert raw(strict, "GET", "/health")[0] == 200  # open without the key
    assert strict.client(api_key=KEY).models.list().data


AUTH = {"Authorization": f"Bearer {KEY}"}


def test_cors(strict):
    status, headers, _ = raw(strict, "OPTIONS", "/v1/chat/completions",
                             headers={"Origin": "http://example.test",
                                      "Access-Control-Request-Method": "POST"})
    assert status == 204 and headers["Access-Control-Allow-Origin"] == "*"
    assert "POST" in headers["Access-Control-Allow-Methods"]
    assert "Authorization" in headers["Access-Control-Allow-Headers"]
    _, headers, _ = raw(strict, "GET", "/health")
    assert headers["Access-Control-Allow-Origin"] == "*"


def running(server):
    _, _, body = raw(server, "GET", "/metrics", headers=AUTH)
    for line in body.decode().splitlines():
        if line.startswith("tmx:num_requests_running"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no tmx:num_requests_running")


def aborted(server):
    _, _, body = raw(server, "GET", "/metrics", headers=AUTH)
    m = re.search(r'finished_reason="abort"\} (\S+)', body.decode())
    return float(m.group(1))


def test_busy_and_cancel_on_disconnect(strict):
    client = strict.client(api_key=KEY)
    before = aborted(strict)
    # one request runs (max_running=1) and none may wait (max_waiting=0)
    stream = client.completions.create(model="m", prompt="Four score", max_tokens=2000,
                                       stream=True, temperature=0,
                                       extra_body={"ignore_eos": True})
    it = iter(stream)
    next(it)
    next(it)
    with pytest.raises(openai.RateLimitError) as e:
        client.completions.create(model="m", prompt="x", max_tokens=1)
    assert e.value.response.headers["Retry-After"]
    stream.close()  # the client goes away: the scheduler must drop the request
    deadline = time.monotonic() + 30
    while (running(strict) or aborted(strict) == before) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert running(strict) == 0 and aborted(strict) == before + 1
    # the same for a request that does not stream: the closed socket is seen while it runs
    body = json.dumps({"prompt": "x", "max_tokens": 2000, "ignore_eos": True})
    s = socket.create_connection(("127.0.0.1", strict.port), timeout=30)
    s.sendall((f"POST /v1/completions HTTP/1.1\r\nAuthorization: Bearer {KEY}\r\n"
               f"Content-Length: {len(body)}\r\n\r\n{body}").encode())
    deadline = time.monotonic() + 30
    while not running(strict) and time.monotonic() < deadline:
        time.sleep(0.01)
    s.close()
    while (running(strict) or aborted(strict) == before + 1) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert running(strict) == 0 and aborted(strict) == before + 2
    r = client.completions.create(model="m", prompt="x", max_tokens=1)
    assert r.choices[0].finish_reason in ("length", "stop")


def test_request_timeout(strict):
    reply = raw_bytes(strict, b"POST /v1/completions HTTP/1.1\r\nContent-Length: 100\r\n\r\n{")
    assert reply.startswith(b"HTTP/1.1 408")
    assert raw_bytes(strict, b"") == b""  # an idle connection is closed quietly


def test_body_limit_checked_before_reading(strict):
    head = b"POST /v1/completions HTTP/1.1\r\nContent-Length: 999999999999\r\n\r\n"
    assert raw_bytes(strict, head).startswith(b"HTTP/1.1 413")


def test_shutdown_ends_streams(tmp_path_factory):
    server = Server(make_model(tmp_path_factory, "api-stop", "--preset", "30m"))
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({
        "prompt": "Four score", "max_tokens": 2000, "stream": True, "ignore_eos": True}))
    r = conn.getresponse()
    assert r.status == 200
    assert r.read(6) == b"data: "  # the first event is out: the request runs
    server.proc.send_signal(signal.SIGTERM)
    events = [e for e in r.read().decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][len("data: "):])["error"]["code"] == 503
    assert server.proc.wait(timeout=60) == 0


def test_bad_front_end_options_fail_before_the_model_loads(tmp_path_factory):
    model = make_model(tmp_path_factory, "api-options")
    config = tmp_path_factory.mktemp("api-options-config") / "tmx.json"
    config.write_text(json.dumps({"plugins": {"api.openai": {"max_body": 10}}}))
    for args, env, message in (
            (["--port", "99999"], {}, "command line: api.openai.port: 99999 is not a TCP port"),
            (["--host", "1.2.3.4.5"], {}, 'command line: api.openai.host: "1.2.3.4.5" is not an'),
            (["--set", "api.openai.timeout=0"], {}, "command line: api.openai.timeout: must be"),
            ([], {"TMX_API_OPENAI_TIMEOUT": "0"}, "TMX_API_OPENAI_TIMEOUT: api.openai.timeout: "),
            (["--config", str(config)], {}, f"{config}: plugins: api.openai.max_body: must be")):
        r = subprocess.run([TMX, "serve", "--model", model, *args], capture_output=True,
                           text=True, timeout=60, env={**os.environ, **env})
        assert r.returncode == 1 and r.stderr.startswith(f"tmx serve: {message}"), r.stderr
        assert "warm-up" not in r.stderr and r.stderr.count("\n") == 1
