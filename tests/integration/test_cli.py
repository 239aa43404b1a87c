"""`paged-llm` (clients/cli.py) as a user runs it. Starts its own servers: `paged-llm
serve` on a tiny Hugging Face folder made here (tritonserver, the supervisor and the
OpenAI API on free loopback ports), twice: the first start builds the entry into the
cache, the second reuses it. The official `openai` client talks to each."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from clients.tritonserver import free_port

pytestmark = pytest.mark.timeout(600)


def paged_llm() -> list[str]:
    script = shutil.which("paged-llm", path=os.path.dirname(sys.executable))
    return [script] if script else [sys.executable, "-m", "clients.cli"]


@pytest.mark.parametrize("command", [[], ["serve"], ["build"], ["plan"], ["generate"], ["chat"], ["bench"]])
def test_help_of_every_command(command):
    done = subprocess.run(paged_llm() + command + ["--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "usage" in done.stdout.lower() or "paged-llm" in done.stdout


def serve(folder: str, cache: str, log_path: str) -> tuple[subprocess.Popen, int]:
    port = free_port()
    ports = ["--http-port", str(free_port()), "--grpc-port", str(free_port()), "--metrics-port", str(free_port()),
             "--supervisor-port", str(free_port())]
    with open(log_path, "w") as log:
        process = subprocess.Popen(paged_llm() + ["serve", folder, "--port", str(port), "--max-model-len", "512",
                                                  "--num-kv-blocks", "64", *ports],
                                   stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PAGED_LLM_CACHE": cache})
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        assert process.poll() is None, open(log_path).read()[-3000:]
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2) as r:
                if r.status == 200:
                    return process, port
        except Exception:
            time.sleep(0.5)
    raise AssertionError(f"not ready in 240 s:\n{open(log_path).read()[-3000:]}")


def stop(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(90)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def test_serve_builds_a_folder_once_and_answers_the_official_client(tmp_path, tiny_ckpt):
    import openai
    folder = str(tmp_path / "Tiny-Llama")
    shutil.copytree(tiny_ckpt, folder)
    cache = str(tmp_path / "cache")
    for start, words in enumerate(("building", "reusing the entry built before")):
        log_path = str(tmp_path / f"serve{start}.log")
        process, port = serve(folder, cache, log_path)
        try:
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
            assert [m.id for m in client.models.list().data] == ["Tiny-Llama"]     # (the folder's name, as vLLM)
            reply = client.completions.create(model="Tiny-Llama", prompt="The with statement", max_tokens=4)
            assert reply.usage.completion_tokens == 4
            if start == 0:      # the terminal chat, its turns piped in
                chat = subprocess.run(paged_llm() + ["chat", "--url", f"http://127.0.0.1:{port}/v1", "--max-tokens",
                                                     "4", "--temperature", "0"], input="Hello\nAnd again\n",
                                      capture_output=True, text=True, timeout=120)
                assert chat.returncode == 0 and chat.stdout.strip(), chat.stderr
        finally:
            stop(process)
        assert words in open(log_path).read()
    assert len([n for n in os.listdir(os.path.join(cache, "repositories")) if not n.endswith(".lock")]) == 1
