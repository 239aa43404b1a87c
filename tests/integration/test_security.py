"""What a client without keys can and cannot do to the session's server: a REAL
tritonserver under the supervisor with the OpenAI frontend, started as `make serve` starts
it (clients.tritonserver serve), driven with tritonclient, urllib and the official
`openai` client. Unauthenticated calls to Triton's repository API are refused and change
nothing; the frontend takes its API keys; the supervisor's port only reports."""

import base64
import http.client
import json
import urllib.error
import urllib.request

import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from clients.triton_client import StreamingRequest
from supervisor.triton_api import http_request
from tests.integration.conftest import API_KEY, NEXT_API_KEY, auth, openai_frontend, wait_blocks_free

openai = pytest.importorskip("openai")
GREEDY = {"max_tokens": 4, "temperature": 0}


def serves(server) -> bool:
    res = StreamingRequest(server.grpc_url).run("The pass statement", GREEDY)
    return res.ok and len(res.token_ids) == 4 and server.model_ready("llm")


def post(url: str, body: bytes = b"", headers=None) -> tuple[int, str]:
    request = urllib.request.Request(url, data=body, method="POST", headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_unauthenticated_http_unload_is_refused_and_the_model_keeps_serving(server):
    status, body = post(f"http://{server.http_url}/v2/repository/models/llm/unload")
    assert status == 403 and "restricted" in body and "admin-key" in body, (status, body)
    status, _ = post(f"http://{server.http_url}/v2/repository/models/llm/unload", headers={"admin-key": "wrong-key"})
    assert status == 403
    assert serves(server)


def test_unauthenticated_grpc_unload_is_refused_and_the_model_keeps_serving(server):
    client = grpcclient.InferenceServerClient(server.grpc_url)
    for headers in (None, {"triton-grpc-protocol-admin-key": "wrong-key"}):
        with pytest.raises(InferenceServerException, match="restricted"):
            client.unload_model("llm", headers=headers)
    client.close()
    assert serves(server)


def test_unauthenticated_load_with_files_is_refused_and_runs_nothing(server, tmp_path):
    """A load may carry model files: Python the server would run. Without the key Triton
    refuses it: no model appears, and the code never ran (it would have written a file)."""
    marker = tmp_path / "ran"
    code = f"open({str(marker)!r}, 'w').write('pwned')\nclass TritonPythonModel:\n    pass\n"
    config = {"backend": "python", "max_batch_size": 0, "input": [], "output": []}
    body = json.dumps({"parameters": {"config": json.dumps(config),
                                      "file:1/model.py": base64.b64encode(code.encode()).decode()}}).encode()
    status, answer = post(f"http://{server.http_url}/v2/repository/models/intruder/load", body,
                          {"content-type": "application/json"})
    assert status == 403 and "restricted" in answer, (status, answer)
    assert not marker.exists()
    index = json.loads(http_request(f"http://{server.http_url}/v2/repository/index", "POST",
                                    headers=server.admin_headers)[1])
    assert [m["name"] for m in index] == ["llm"]
    assert serves(server)


def test_repository_api_with_the_key_answers(server):
    """The key works (what the supervisor's reload uses: test_recovery.py reloads through it)."""
    status, body = http_request(f"http://{server.http_url}/v2/repository/index", "POST",
                                headers=server.admin_headers)
    assert status == 200 and json.loads(body)[0]["state"] == "READY"
    client = grpcclient.InferenceServerClient(server.grpc_url)
    assert client.get_model_repository_index(headers=server.admin_grpc_headers).models[0].name == "llm"
    client.close()


@pytest.mark.parametrize("api", ["logging", "trace", "shared-memory"])
def test_optional_groups_are_restricted_by_default(server, api):
    path = {"logging": "/v2/logging", "trace": "/v2/trace/setting", "shared-memory": "/v2/systemsharedmemory/status"}
    status, body = http_request(f"http://{server.http_url}{path[api]}")
    assert status == 403 and "restricted" in body, (api, status, body)
    assert http_request(f"http://{server.http_url}{path[api]}", headers=server.admin_headers)[0] == 200


def test_frontend_api_keys(server):
    """401 without a key and with a wrong one (OpenAI-shaped), 200 with either key of a
    rotation; /health stays open for probes."""
    url = openai_frontend(server)
    body = json.dumps({"model": "llm", "prompt": "The pass statement", "max_tokens": 2}).encode()
    json_type = {"content-type": "application/json"}
    for headers, expected in (({}, 401), ({"authorization": "Bearer wrong"}, 401),
                              ({"authorization": f"Basic {API_KEY}"}, 401), (auth(), 200),
                              ({"authorization": f"Bearer {NEXT_API_KEY}"}, 200)):
        status, answer = post(url + "/v1/completions", body, {**json_type, **headers})
        assert status == expected, (headers, status, answer)
        if expected == 401:
            error = json.loads(answer)["error"]
            assert error["code"] == 401 and error["type"] == "AuthenticationError" and "API key" in error["message"]
    assert post(url + "/v1/models", headers={})[0] == 401    # checked before routing
    with urllib.request.urlopen(url + "/health", timeout=10) as r:
        assert r.status == 200
    wait_blocks_free(server)


def test_official_client_with_api_key(server):
    url = openai_frontend(server) + "/v1"
    good = openai.OpenAI(base_url=url, api_key=API_KEY, max_retries=0)
    assert good.completions.create(model="llm", prompt="The pass statement", max_tokens=3).usage.completion_tokens == 3
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url, api_key="sk-wrong", max_retries=0).models.list()
    wait_blocks_free(server)


def test_request_body_over_the_limit_gets_413_and_the_next_is_served(server):
    """Past the 16 MiB default: a declared length is refused before any of the body is sent;
    a chunked body (no declared length) is refused once what arrived passes the limit."""
    url = openai_frontend(server)
    host = url.removeprefix("http://")
    conn = http.client.HTTPConnection(host, timeout=30)
    conn.putrequest("POST", "/v1/completions")
    for k, v in auth({"content-type": "application/json", "content-length": str(17 << 20)}).items():
        conn.putheader(k, v)
    conn.endheaders()                       # and no body: the answer must not wait for it
    response = conn.getresponse()
    error = json.loads(response.read())["error"]
    assert response.status == 413 and error["param"] == "max_request_body_bytes", error
    assert "max_request_body_bytes" in error["message"]
    conn.close()

    conn = http.client.HTTPConnection(host, timeout=30)
    conn.putrequest("POST", "/v1/completions")
    for k, v in auth({"content-type": "application/json", "transfer-encoding": "chunked"}).items():
        conn.putheader(k, v)
    conn.endheaders()
    piece = b"x" * (1 << 20)
    for _ in range(16):                     # exactly the limit: still read
        conn.send(b"%x\r\n%s\r\n" % (len(piece), piece))
    conn.send(b"1\r\nx\r\n0\r\n\r\n")   # one byte past it
    response = conn.getresponse()
    assert response.status == 413, response.read()[:300]
    conn.close()
    client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)
    assert client.completions.create(model="llm", prompt="The pass statement", max_tokens=2).usage.completion_tokens == 2
    wait_blocks_free(server)


def test_supervisor_port_only_reports(server):
    """GET only: nothing on the supervisor's port stops, restarts or reloads anything."""
    for path in ("/ready", "/live", "/status", "/restart", "/reload"):
        status, _ = post(server.supervisor_url + path)
        assert status == 501, (path, status)
    assert server.supervisor("/status")[0] == 200 and serves(server)


def test_prompts_and_outputs_stay_out_of_the_logs(server):
    """Request logging is off by default: the server's log (tritonserver, the supervisor and
    the frontend, as `make serve` writes them) never holds a prompt or an output."""
    client = openai.OpenAI(base_url=openai_frontend(server) + "/v1", api_key=API_KEY, max_retries=0)
    prompt = "The confidential codeword is xylophone"
    out = client.completions.create(model="llm", prompt=prompt, max_tokens=8, temperature=0).choices[0].text
    chat = client.chat.completions.create(model="llm", max_tokens=8, temperature=0, messages=[
        {"role": "user", "content": "My password is hunter2-zebra"}]).choices[0].message.content
    with open(server.log_path, encoding="utf-8", errors="replace") as f:
        log = f.read()
    assert "POST /v1/completions" in log                      # the access log is there, and says no more
    for secret in ("xylophone", "hunter2-zebra", out.strip(), chat.strip()):
        assert len(secret) < 4 or secret not in log, secret
    wait_blocks_free(server)


def test_openai_limits_and_deadline(server):
    """The engine's limits and its per-request deadline, through the OpenAI API: 400 naming
    the field, and 504 for a request aborted at its request_timeout_s, its blocks freed."""
    client = openai.OpenAI(base_url=openai_frontend(server) + "/v1", api_key=API_KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="llm", prompt="The pass statement", max_tokens=2, logprobs=21)
    assert "max_logprobs=20" in e.value.message and e.value.body["param"] == "logprobs"
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model="llm", prompt="The pass statement", max_tokens=1000,
                                  extra_body={"min_tokens": 1000, "ignore_eos": True, "request_timeout_s": 0.5})
    assert e.value.status_code == 504 and "request_timeout_s" in e.value.message, e.value.message
    assert client.completions.create(model="llm", prompt="The pass statement", max_tokens=2).usage.completion_tokens == 2
    wait_blocks_free(server)


def test_grpc_tls_and_the_frontend_behind_it(tmp_path, model_repo):
    """Triton's gRPC with its own SSL flags (passed through serve): a plain-text client is
    refused, a client that trusts the certificate is served, and the OpenAI frontend that
    serve starts beside it speaks TLS to it (the launcher tells it which certificate)."""
    from clients.tritonserver import TritonServer
    from tests.helpers.certs import self_signed
    cert, key = self_signed(tmp_path)
    srv = TritonServer(model_repo, log_path=str(tmp_path / "server.log"), supervised=True, openai=True,
                       api_keys=(API_KEY,),
                       extra_args=["--grpc-use-ssl=true", "--grpc-server-cert", cert, "--grpc-server-key", key])
    with srv:
        with pytest.raises(InferenceServerException):
            grpcclient.InferenceServerClient(srv.grpc_url).is_server_live(client_timeout=5)
        secure = grpcclient.InferenceServerClient(srv.grpc_url, ssl=True, root_certificates=cert)
        assert secure.is_model_ready("llm")
        secure.close()
        client = openai.OpenAI(base_url=openai_frontend(srv) + "/v1", api_key=API_KEY, max_retries=0)
        assert client.completions.create(model="llm", prompt="The pass statement", max_tokens=3).usage.completion_tokens == 3
