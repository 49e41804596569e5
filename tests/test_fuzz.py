"""Fuzzing every endpoint: 1,000 generated requests each (hypothesis, derandomized so CI sees the
same ones), shaped like the OpenAI schema with wrong types, out-of-range values, invalid Unicode,
hostile grammars and raw garbage mixed in. No request may get a 5xx, and a stream may never carry
a server error."""

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import minillm
from minillm.serving.server import create_app

pytestmark = pytest.mark.slow  # the default model

EXAMPLES = 1000
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])

SPECIAL_TEXT = ["\ud800", "a\udc00b", "\x00", "<|im_end|>", "{{ 7 * 7 }}", "{% for x in range(9**9) %}{% endfor %}",
                "\u202e", "\U0001f600" * 3, "", " ", "\n" * 50]
text = st.one_of(st.text(max_size=40), st.sampled_from(SPECIAL_TEXT))
junk = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True),
                 st.text(max_size=10), st.lists(st.integers(-5, 60_000), max_size=4),
                 st.dictionaries(st.text(max_size=5), st.integers(), max_size=3))
token_ids = st.lists(st.integers(0, 49_151), min_size=1, max_size=8)
SCHEMAS = [{"type": "object"}, {"$ref": "#"}, {"type": "string", "pattern": "^(a{1000}){1000}$"},
           {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, {"type": "objec"},
           {"type": "array", "minItems": 3, "maxItems": 2}, {"enum": []}, {"anyOf": []}, {"type": "string", "pattern": "("},
           {"type": "string", "minLength": 10**9}, {"$defs": {"x": {"$ref": "#/$defs/x"}}, "$ref": "#/$defs/x"}]
RESPONSE_FORMATS = ([{"type": "text"}, {"type": "json_object"}, {"type": "xml"}, {"type": "json_schema"}, {"type": "json_schema", "json_schema": {}}]
                    + [{"type": "json_schema", "json_schema": {"name": "x", "schema": s, "strict": strict}} for s in SCHEMAS for strict in (False, True)])
GRAMMARS = ['root ::= "yes" | "no"', "root ::= (", {"type": "regex", "grammar": "[0-9]{1,3}"}, {"type": "regex", "grammar": "(a{1000}){1000}"},
            {"type": "regex", "grammar": "\ud800"}, {"type": "lark", "grammar": "start: /[a-z]+/"}, {"type": "lark", "grammar": "start: (("},
            {"type": "gbnf"}, {"type": "nope", "grammar": "x"}, {"type": "regex", "grammar": "(?<=a)b"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
TOOLSETS = [[WEATHER], [], [{"type": "function"}], [{"type": "function", "function": {"name": "f", "parameters": "x"}}],
            [{"type": "function", "function": {"name": "g", "parameters": {"$ref": "#"}}}], [{"function": {"name": ""}}]]
TOOL_CHOICES = ["auto", "none", "required", "sometimes", {"type": "function", "function": {"name": "get_weather"}},
                {"type": "function", "function": {"name": "nope"}}, {"function": "x"}]


SAMPLING = {"temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "top_k": st.integers(-1, 50),
            "min_p": st.floats(0, 1), "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
            "repetition_penalty": st.floats(0.5, 2), "seed": st.integers(0, 2**63 - 1), "stop": st.one_of(text, st.lists(text, max_size=3)),
            "n": st.integers(1, 3), "stream": st.booleans(), "stream_options": st.just({"include_usage": True}),
            "logit_bias": st.dictionaries(st.integers(0, 49_151).map(str), st.floats(-100, 100), max_size=3),
            "response_format": st.sampled_from(RESPONSE_FORMATS), "grammar": st.sampled_from(GRAMMARS), "ignore_eos": st.booleans(),
            "model": text}
message = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "developer", "tool"]), "content": text}, optional={
    "tool_call_id": text, "name": text,
    "tool_calls": st.sampled_from([[{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}],
                                   [{"function": {"arguments": "not json"}}]])})


def fuzzed(required: dict, optional: dict):
    """Requests that are valid-shaped, then have 0-2 fields (any of the schema's, or unknown
    ones) replaced by junk: a third reach the model, the rest probe one bad field at a time."""
    names = sorted(set(required) | set(optional)) + ["unknown_field"]

    def mutate(args):
        body, changes = args
        return {**body, **dict(changes)}

    base = st.fixed_dictionaries(required, optional=optional)
    return st.tuples(base, st.lists(st.tuples(st.sampled_from(names), junk), max_size=2)).map(mutate)


completion = fuzzed({"prompt": st.one_of(text, token_ids, st.lists(text, min_size=1, max_size=3), st.lists(token_ids, min_size=1, max_size=3)),
                     "max_tokens": st.integers(0, 3)},
                    {**SAMPLING, "logprobs": st.integers(0, 5), "echo": st.booleans()})
chat = fuzzed({"messages": st.lists(message, min_size=1, max_size=4), "max_tokens": st.integers(1, 3)},
              {**SAMPLING, "tools": st.sampled_from(TOOLSETS), "tool_choice": st.sampled_from(TOOL_CHOICES), "logprobs": st.booleans(),
               "top_logprobs": st.integers(0, 5), "max_completion_tokens": st.integers(1, 3)})
embeddings = fuzzed({"input": st.one_of(text, st.lists(text, min_size=1, max_size=3), token_ids, st.lists(token_ids, min_size=1, max_size=3))},
                    {"encoding_format": st.sampled_from(["float", "base64"]), "dimensions": st.integers(-1, 1000), "model": text})
part = st.fixed_dictionaries({"type": st.sampled_from(["input_text", "output_text", "input_image", "refusal", "x"]), "text": text})
item = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "developer", "assistant", "tool"]),
                           "content": st.one_of(text, st.lists(part, max_size=3))},
                          optional={"type": st.sampled_from(["message", "function_call", "reasoning", "item_reference"])}),
    st.fixed_dictionaries({"type": st.just("function_call"), "call_id": text, "name": st.sampled_from(["get_weather", "nope"]),
                           "arguments": st.sampled_from(['{"city": "Oslo"}', "not json"])}),
    st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": text, "output": st.one_of(text, st.lists(part, max_size=2))}))
FLAT_TOOLS = [[dict(WEATHER["function"], type="function")], [], [{"type": "web_search"}], [{"type": "function", "name": "f", "parameters": "x"}],
              [{"type": "function"}]]
responses = fuzzed({"input": st.one_of(text, st.lists(item, min_size=1, max_size=4)), "max_output_tokens": st.integers(1, 3)},
                   {**{k: v for k, v in SAMPLING.items() if k not in ("n", "response_format")}, "instructions": text,
                    "tools": st.sampled_from(FLAT_TOOLS),
                    "tool_choice": st.sampled_from(["auto", "none", "required", {"type": "function", "name": "get_weather"}, {"type": "x"}]),
                    "text": st.sampled_from([{"format": f} for f in RESPONSE_FORMATS[:3]]
                                            + [{"format": dict(f["json_schema"], type="json_schema")} for f in RESPONSE_FORMATS[5:9]]),
                    "include": st.just(["message.output_text.logprobs"]), "top_logprobs": st.integers(0, 5), "store": st.booleans(),
                    "previous_response_id": text, "parallel_tool_calls": st.booleans(), "metadata": st.just({"k": "v"})})
block = st.one_of(st.fixed_dictionaries({"type": st.sampled_from(["text", "text", "text", "image", "thinking", "x"]), "text": text}),
                  st.fixed_dictionaries({"type": st.just("tool_use"), "id": text, "name": st.sampled_from(["get_weather", "nope"]),
                                         "input": st.sampled_from([{"city": "Oslo"}, {}, "x"])}),
                  st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": text, "content": st.one_of(text, st.lists(junk, max_size=2))}))
anthropic_message = st.fixed_dictionaries({"role": st.sampled_from(["user", "user", "assistant", "system"]),
                                           "content": st.one_of(text, text, st.lists(block, max_size=2))})
messages = fuzzed({"messages": st.lists(anthropic_message, min_size=1, max_size=4), "max_tokens": st.integers(1, 3)},
                  {**{k: v for k, v in SAMPLING.items() if k not in ("n", "response_format", "stop")},
                   "system": st.one_of(text, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text}), max_size=2)),
                   "stop_sequences": st.lists(text, max_size=3), "tools": st.sampled_from(
                       [[{"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}], [], [{"type": "bash_20250124", "name": "bash"}],
                        [{"name": "f", "input_schema": "x"}]]),
                   "tool_choice": st.sampled_from([{"type": "auto"}, {"type": "any"}, {"type": "none"}, {"type": "tool", "name": "get_weather"},
                                                   {"type": "tool", "name": "nope"}, {"type": "x"}]),
                   "output_config": st.sampled_from([{"format": {"type": "json_schema", "schema": sc}} for sc in SCHEMAS[:5]] + [{"format": 3}])})
tokenize = fuzzed({"content": text}, {"add_special": st.booleans(), "with_pieces": st.booleans()})
detokenize = fuzzed({"tokens": token_ids}, {})
ENDPOINTS = {"/v1/completions": completion, "/v1/chat/completions": chat, "/v1/responses": responses, "/v1/messages": messages,
             "/v1/embeddings": embeddings, "/tokenize": tokenize,
             "/detokenize": detokenize}
# bodies that are not an object of the schema at all: raw bytes, other JSON values
raw = st.one_of(st.binary(max_size=64), st.sampled_from([b"[]", b"null", b"1e999", b'"x"', b"[" * 5000, b'{"prompt": "\\ud800"']))


@pytest.fixture(scope="module")
def http(default_model_dir):
    from fastapi.testclient import TestClient

    with minillm.load(default_model_dir, ctx=512, max_batch=4, max_queue=64) as llm, \
            TestClient(create_app(llm, "fuzz"), base_url="http://localhost", raise_server_exceptions=False) as client:
        yield client


def _dumps(body) -> bytes:
    # NaN and Infinity written as Python writes them: the server must refuse them, not crash
    return json.dumps(body, allow_nan=True).encode()


STATUS: dict[str, dict[int, int]] = {}  # path -> status -> requests


def check(http, path: str, content: bytes) -> None:
    response = http.post(path, content=content, headers={"Content-Type": "application/json"})
    STATUS.setdefault(path, {}).setdefault(response.status_code, 0)
    STATUS[path][response.status_code] += 1
    assert response.status_code < 500, (path, content[:300], response.text[:300])
    if response.status_code >= 400:
        error = response.json()["error"]  # OpenAI's shape, or Anthropic's on /v1/messages: {"type": "error", "error": {...}}
        assert error["message"] and "<state>" not in error["message"], error
    elif response.headers.get("content-type", "").startswith("text/event-stream"):
        for line in response.text.splitlines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                assert event.get("error", {}).get("type") != "server_error", (path, content[:300], event)
                assert not (event.get("type") == "error" and "server_error" in (event.get("code"), event.get("error", {}).get("type"))), \
                    (path, content[:300], event)


@pytest.mark.parametrize("path", list(ENDPOINTS))
def test_no_5xx_from_any_request(http, path):
    @SETTINGS
    @given(ENDPOINTS[path])
    def run(body):
        check(http, path, _dumps(body))

    run()
    assert STATUS[path].get(200, 0) >= EXAMPLES // 10, STATUS[path]  # and a good share reached the model


def test_no_5xx_from_any_body(http):
    @SETTINGS
    @given(st.sampled_from(list(ENDPOINTS)), raw)
    def run(path, body):
        check(http, path, body)

    run()
