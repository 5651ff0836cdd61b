"""Schema-driven fuzzing of `llmopt serve`: schemathesis reads the server's own /openapi.json and
sends a real server on loopback the requests it describes and the requests it forbids.

For every request: never a 5xx; a body that breaks the schema is refused with a 4xx (so the
published schema and the parser in protocol.py agree); a 4xx is OpenAI's error JSON; after it
the server still answers a normal request, and once idle it holds no KV blocks. Bounded in time:
a 64-token context keeps every generation short, and each operation gets a fixed number of cases.
"""

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import negative_data_rejection, not_a_server_error

from llmopt.server.process import ServerProcess
from test_server import wait_idle

EXAMPLES = {GenerationMode.POSITIVE: 30, GenerationMode.NEGATIVE: 40}
NORMAL = {"model": "tiny", "prompt": "def f(x):", "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def server():
    s = ServerProcess(["--model", "tiny", "--device", "cpu", "--max-model-len", "64", "--num-kv-blocks", "64",
                       "--max-num-seqs", "8"])
    with s:
        yield s
    assert s.returncode == 0, s.log()


@pytest.fixture(scope="module")
def schema(server):
    return schemathesis.openapi.from_url(f"{server.url}/openapi.json")


def test_the_schema_describes_both_endpoints(schema):
    body = schema["/v1/completions"]["POST"].definition.raw["requestBody"]["content"]["application/json"]["schema"]
    assert body["required"] == ["model", "prompt"] and not body["additionalProperties"]
    assert "messages" in schema["/v1/chat/completions"]["POST"].definition.raw["requestBody"]["content"][
        "application/json"]["schema"]["properties"]


RUNS = [("POST", path, mode) for path in ("/v1/completions", "/v1/chat/completions") for mode in EXAMPLES] + [
    ("GET", path, GenerationMode.POSITIVE) for path in ("/v1/models", "/health", "/metrics")]  # nothing to break


@pytest.mark.parametrize("method, path, mode", RUNS, ids=[f"{m} {p} {g.value}" for m, p, g in RUNS])
def test_fuzzed_requests_never_get_a_5xx_and_leave_nothing_behind(server, schema, method, path, mode):
    operation = schema[path][method]
    checks = [not_a_server_error] + ([negative_data_rejection] if mode is GenerationMode.NEGATIVE else [])

    @settings(max_examples=EXAMPLES[mode], deadline=None, suppress_health_check=list(HealthCheck),
              print_blob=True)
    @given(data=st.data())
    def one_case(data):
        case = data.draw(operation.as_strategy(generation_mode=mode))
        response = case.call(base_url=server.url, timeout=60)
        case.validate_response(response, checks=checks)
        if 400 <= response.status_code < 500:
            error = response.json()["error"]
            assert error["message"] and error["type"], error
        ok = httpx.post(f"{server.url}/v1/completions", json=NORMAL, timeout=60)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
        assert wait_idle(server)["llmopt:kv_cache_usage_perc"] == 0.0

    one_case()
