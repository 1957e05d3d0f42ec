"""`edgeinfer serve` as something left running: start-up, API keys, rate limits, CORS, the
waiting-queue bound, priorities and a graceful shutdown, each on its own short-lived server."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import openai
import pytest
from server_proc import ServerProcess, wait_for

HI = [{"role": "user", "content": "Say hello."}]
KEY, FILE_KEY = "sk-test-one", "sk-test-two"
ORIGIN = "http://ui.example"


@pytest.fixture(scope="module")
def model(real_model):
    return real_model("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def keyed(model, tmp_path_factory):
    key_file = tmp_path_factory.mktemp("keys") / "keys.txt"
    key_file.write_text(f"# one key a line\n{FILE_KEY}\n\n")
    proc = ServerProcess(
        model, "--ctx", "256", "--api-key", KEY, "--api-key-file", str(key_file),
        "--rate-limit", "4/min", "--cors-origin", ORIGIN,
        headers={"Authorization": f"Bearer {KEY}"},
    )  # fmt: skip
    yield proc
    assert proc.stop() == 0
    proc.close()


def test_health_is_503_while_loading(keyed):
    assert 503 in keyed.health_statuses and keyed.health_statuses[-1] == 200
    resp = keyed.loading_response
    assert int(resp.headers["retry-after"]) >= 1
    assert resp.json()["error"]["type"] == "server_error"


@pytest.mark.parametrize(
    "method, path",
    [
        ("GET", "/v1/models"),
        ("GET", "/metrics"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/completions"),
        ("POST", "/tokenize"),
        ("POST", "/detokenize"),
    ],
)
@pytest.mark.parametrize("auth", [None, "Bearer wrong", f"Basic {KEY}", f"Bearer {KEY}x", KEY])
def test_missing_or_wrong_key_is_401(keyed, method, path, auth):
    headers = {} if auth is None else {"Authorization": auth}
    body = {"messages": HI, "max_tokens": 1}
    resp = httpx.request(method, keyed.url + path, json=body, headers=headers, timeout=30)
    assert resp.status_code == 401
    assert resp.json()["error"]["type"] == "authentication_error"
    assert resp.headers["www-authenticate"] == "Bearer"


def test_health_needs_no_key(keyed):
    assert httpx.get(keyed.url + "/health", timeout=10).status_code == 200


def test_every_key_works(keyed, model):
    for key in (KEY, FILE_KEY):
        client = openai.OpenAI(base_url=keyed.url + "/v1", api_key=key, max_retries=0)
        r = client.chat.completions.create(model=model.name, messages=HI, max_tokens=2)
        assert r.choices[0].message.content
        assert client.models.list().data[0].id == model.name
    bad = openai.OpenAI(base_url=keyed.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model=model.name, messages=HI, max_tokens=2)
    log = keyed.output()
    assert KEY not in log and FILE_KEY not in log  # keys are logged by their hash's name
    assert "key=key-" in log


def test_rate_limit_per_key(keyed):
    other = {"Authorization": f"Bearer {FILE_KEY}"}
    codes = [keyed.post("/tokenize", {"prompt": "x"}, headers=other).status_code for _ in range(6)]
    assert codes.count(429) >= 2 and codes.index(429) <= 4, codes  # 4 a minute, one spent above
    resp = keyed.post("/tokenize", {"prompt": "x"}, headers=other)
    assert resp.status_code == 429 and 1 <= int(resp.headers["retry-after"]) <= 15
    assert resp.json()["error"]["type"] == "rate_limit_error"


def test_cors(keyed):
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST"}
    preflight["Access-Control-Request-Headers"] = "authorization, content-type"
    resp = httpx.options(keyed.url + "/v1/chat/completions", headers=preflight, timeout=10)
    assert resp.status_code == 200
    assert resp.headers["access-control-allow-origin"] == ORIGIN
    resp = httpx.options(
        keyed.url + "/v1/chat/completions", headers={**preflight, "Origin": "http://evil.example"}
    )
    assert resp.status_code == 400 and "access-control-allow-origin" not in resp.headers
    health = httpx.get(keyed.url + "/health", headers={"Origin": ORIGIN}, timeout=10)
    assert health.headers["access-control-allow-origin"] == ORIGIN


# -- one sequence at a time: the queue bound, priorities, shutdown ------------------------------


@pytest.fixture(scope="module")
def single(model):
    proc = ServerProcess(model, "--ctx", "2048", "--max-num-seqs", "1", "--max-queue", "2")
    yield proc
    proc.close()


# A request that outlasts the test on a fast machine too: it ends only by disconnect or shutdown.
ENDLESS = {"prompt": "Count: 1, 2, 3,", "max_tokens": 2000, "ignore_eos": True, "stream": True}


def _stream_until_first_token(server, body):
    """Open a stream and read it until its first content chunk -> (response, its context)."""
    ctx = httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120)
    resp = ctx.__enter__()
    lines = resp.iter_lines()
    for line in lines:
        if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
            break
    return ctx, lines


def test_queue_full_is_503_and_priority_orders_the_queue(single):
    # the running request ranks first (vLLM's priority: lower runs first), so neither queued
    # request may preempt it and the queue stays full until it disconnects
    ctx, _ = _stream_until_first_token(single, {**ENDLESS, "priority": -100})
    finished: list[str] = []
    errors: list = []

    def send(name, priority):
        body = {"prompt": f"{name} is", "max_tokens": 2, "priority": priority}
        resp = single.post("/v1/completions", body, timeout=120)
        (finished if resp.status_code == 200 else errors).append(name)

    low = threading.Thread(target=send, args=("low", 10))
    low.start()
    wait_for(lambda: single.metric("edgeinfer:num_requests_waiting") == 1)
    high = threading.Thread(target=send, args=("high", -10))
    high.start()
    wait_for(lambda: single.metric("edgeinfer:num_requests_waiting") == 2)

    full = single.post("/v1/completions", {"prompt": "x", "max_tokens": 1})
    assert full.status_code == 503, full.text
    assert int(full.headers["retry-after"]) >= 1
    assert full.json()["error"]["code"] == "queue_full"

    ctx.__exit__(None, None, None)  # disconnect: the running request makes room
    low.join(120)
    high.join(120)
    assert errors == [] and finished == ["high", "low"]
    assert single.post("/v1/completions", {"prompt": "x", "max_tokens": 1}).status_code == 200


def test_sigterm_aborts_streams_and_exits_0(single):
    ctx, lines = _stream_until_first_token(single, ENDLESS)
    t0 = time.monotonic()
    single.proc.send_signal(signal.SIGTERM)
    rest = list(lines)
    ctx.__exit__(None, None, None)
    events = [line[6:] for line in rest if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "shutting_down"
    assert single.proc.wait(30) == 0
    assert time.monotonic() - t0 < 20
    assert "Finished server process" in single.output()


def test_sigint_exits_0(model):
    proc = ServerProcess(model, "--ctx", "128", warm=False)
    try:
        proc.proc.send_signal(signal.SIGINT)
        assert proc.proc.wait(30) == 0
    finally:
        proc.close()


def test_load_failure_exits_2(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 16)
    with pytest.raises(RuntimeError, match="exited with 2"):
        ServerProcess(bad, warm=False)
