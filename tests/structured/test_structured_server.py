"""Structured outputs through a real `llmopt serve` on loopback, driven by the official `openai`
client: `response_format` (json_object, json_schema), `client.beta.chat.completions.parse` with a
pydantic model, vLLM's `structured_outputs` body field on both routes, the same output as
offline, and a 400 naming the field for a constraint that does not compile, the server going on."""

import json
from typing import Literal

import jsonschema
import openai
import pydantic
import pytest

from llmopt import SamplingParams, StructuredOutputsParams
from llmopt.server.process import ServerProcess

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                           "population": {"type": "integer", "minimum": 0, "maximum": 99999999}},
          "required": ["city", "population"], "additionalProperties": False}
MESSAGES = [{"role": "user", "content": "Name a city and its population, as JSON."}]


class City(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=12)
    population: int = pydantic.Field(ge=0, le=99999999)
    kind: Literal["town", "city"]


@pytest.fixture(scope="module")
def server():
    s = ServerProcess(["--model", "tiny", "--device", "cpu", "--num-kv-blocks", "256"])
    with s:
        yield s
    assert s.returncode == 0, s.log()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)


def test_json_schema_equals_offline(client, tiny_llm):
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, response_format=fmt,
                                       temperature=0, max_tokens=64)
    text = r.choices[0].message.content
    jsonschema.validate(json.loads(text), SCHEMA)
    [ref] = tiny_llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=64, structured_outputs=
                                                   StructuredOutputsParams(json=SCHEMA)), use_tqdm=False)
    assert text == ref.outputs[0].text and r.choices[0].finish_reason == "stop"


def test_json_object_and_sampling(client):
    for seed in range(4):
        r = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=1, seed=seed,
                                           max_tokens=200, response_format={"type": "json_object"})
        if r.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_parse_with_a_pydantic_model(client):
    for seed in range(3):
        r = client.beta.chat.completions.parse(model="tiny", messages=MESSAGES, response_format=City,
                                               temperature=1, seed=seed, max_tokens=64)
        city = r.choices[0].message.parsed
        assert isinstance(city, City) and city.kind in ("town", "city")


def test_structured_outputs_field_on_both_routes(client):
    r = client.completions.create(model="tiny", prompt="Answer:", max_tokens=8, temperature=1, seed=1,
                                  extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert r.choices[0].text in ("yes", "no")
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=16, temperature=1,
                                       extra_body={"structured_outputs": {"regex": "[0-9]{4}"}})
    assert r.choices[0].message.content.isdigit() and len(r.choices[0].message.content) == 4


@pytest.mark.parametrize("body, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format", "does not compile"),
    ({"response_format": {"type": "xml"}}, "response_format", "'type' is one of"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format", "'name'"),
    ({"structured_outputs": {"regex": "(("}}, "structured_outputs", "does not compile"),
    ({"structured_outputs": {"regex": "(a{100}){100}"}}, "structured_outputs", "at most 1,000"),
    ({"structured_outputs": {"json": {"enum": list(range(5000))}}}, "structured_outputs", "at most 1,024"),
    ({"structured_outputs": {"grammar": "root ::= "}}, "structured_outputs", "does not compile"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"jsonn": {}}}, "structured_outputs", "unknown key"),
    ({"structured_outputs": {"choice": ["a"]}, "response_format": {"type": "json_object"}}, "response_format",
     "not both"),
    ({"structured_outputs": {"choice": ["a"]}, "ignore_eos": True}, "structured_outputs", "ignore_eos"),
], ids=["schema", "type", "name", "regex", "regex_explodes", "huge_enum", "grammar", "two_kinds", "unknown",
        "both_fields", "ignore_eos"])
def test_bad_constraints_are_400_and_the_server_goes_on(client, body, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, extra_body=body)
    err = e.value.body
    assert e.value.status_code == 400 and err["param"] == param and words in err["message"], err
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason == "length"
