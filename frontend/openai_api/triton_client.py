"""The frontend's side of Triton: which models our backend serves, and one streamed gRPC
request per completion (tritonclient's asyncio client), read back as per-sequence deltas.

The request is our backend's contract (the vLLM backend's): `text_input` or `input_ids`,
`sampling_parameters` as JSON, `stream`, and the `return_*` switches for finish reasons,
token counts and logprobs.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator, Optional, Union

import grpc
import numpy as np
import tritonclient.grpc.aio as grpcaio
from tritonclient.grpc import InferRequestedOutput
from tritonclient.utils import InferenceServerException

from backend.models.architectures import reads_images
from frontend.triton_inputs import make_inputs
from frontend.openai_api.errors import APIError, from_triton
from frontend.openai_api.lora_adapters import listed_adapters
from frontend.openai_api.triton_channel import channel_args, unavailable

if TYPE_CHECKING:
    from frontend.openai_api.backend_health import BackendHealth

BACKENDS = ("paged_llm",)
OUTPUTS = ("text_output", "output_ids", "finish_reason", "num_input_tokens", "logprobs")
# How long to wait, after a request's final response, for Triton to end its stream.
STREAM_END_TIMEOUT_S = 5.0


@dataclass
class ServedModel:
    name: str
    checkpoint: Optional[str]     # the checkpoint folder (tokenizer, chat template), if on this machine
    created: int
    # A LoRA adapter is served as a model of its own name (as vLLM does): requests go to
    # the Triton model that holds it, with `lora_name` in their sampling parameters.
    triton_model: str = ""
    lora_name: Optional[str] = None
    max_queue_size: Optional[int] = None      # the engine's waiting-queue bound (config parameter)
    # The config's max_model_len, else the checkpoint's max_position_embeddings (the most
    # the engine allows when none is set): chat prompts are checked against it; None: unknown.
    max_model_len: Optional[int] = None
    runner: str = "generate"                  # config parameter runner: "pooling" serves /v1/embeddings
    lora_enabled: bool = False                # takes adapters at run time (lora_adapters.py)
    accepts_images: bool = False              # a vision-language checkpoint (chat_content.py)

    @property
    def parent(self) -> Optional[str]:
        return self.triton_model if self.lora_name else None

    def check_n(self, n: int) -> None:
        """The engine queues each of a request's n sequences: more than its queue holds can
        never be served (the engine would refuse the rest with a retryable 503)."""
        if self.max_queue_size is not None and n > self.max_queue_size:
            raise APIError(400, f"invalid 'n': {n} sequences is more than model '{self.name}' can queue "
                                f"(max_queue_size={self.max_queue_size})", "n")


@dataclass
class Delta:
    """One Triton response, for sequence `index`: what it added, and the totals so far."""
    index: int
    text: str
    token_ids: list[int]
    finish_reason: Optional[str]
    logprobs: list[dict] = field(default_factory=list)   # per new token: {token id: {logprob, rank, decoded_token}}
    num_input_tokens: int = 0
    # The prompt's (sampling parameter prompt_logprobs): vLLM's list, null first; on the
    # response that brings them.
    prompt_logprobs: Optional[list] = None


@dataclass(frozen=True)
class TritonTLS:
    """How to reach a tritonserver whose gRPC port serves TLS (`--grpc-use-ssl=true`)."""
    root_cert: str                       # the CA (or self-signed certificate) to trust
    target_name: Optional[str] = None    # the name its certificate carries, when not the address

    def client_options(self) -> dict:
        return {"ssl": True, "root_certificates": self.root_cert}


class TritonLLM:
    def __init__(self, url: str, model_repository: Optional[str] = None, cache_s: float = 5.0,
                 admin_headers: Optional[dict[str, str]] = None, tls: Optional[TritonTLS] = None,
                 health: Optional["BackendHealth"] = None) -> None:
        self.client = grpcaio.InferenceServerClient(url, channel_args=channel_args(tls.target_name if tls else None),
                                                    **(tls.client_options() if tls else {}))
        self._admin = admin_headers or None     # the repository index and configs are restricted
        self.repository = model_repository
        self._models: dict[str, ServedModel] = {}
        self._listed_at = 0.0
        self._cache_s = cache_s
        self.health = health            # under the supervisor: fail fast (backend_health.py)

    async def close(self) -> None:
        await self.client.close()

    async def ready(self) -> bool:
        try:
            return bool(await self.client.is_server_ready())
        except InferenceServerException:
            return False

    async def models(self) -> dict[str, ServedModel]:
        """Ready models whose backend is ours and whose contract is the vLLM one (not the
        TensorRT-LLM fronts). Cached for a few seconds."""
        if time.monotonic() - self._listed_at < self._cache_s:
            return self._models
        found = {}
        try:
            index = await self.client.get_model_repository_index(headers=self._admin, as_json=True)
        except InferenceServerException as e:
            if "restricted" in str(e):
                raise APIError(503, "the frontend cannot list Triton's models: its repository API is restricted "
                                    "and the frontend was started without the admin key (TRITON_ADMIN_KEY or "
                                    "TRITON_ADMIN_KEY_FILE)") from None
            raise APIError(503, f"the frontend cannot list Triton's models: {e.message() or e}") from None
        for entry in index.get("models", []):
            if entry.get("state") != "READY" or entry["name"] in found:
                continue
            try:
                config = (await self.client.get_model_config(entry["name"], headers=self._admin,
                                                             as_json=True))["config"]
            except InferenceServerException as e:    # unloaded or unreachable since the index
                raise APIError(503, f"the frontend cannot read model '{entry['name']}': {e.message() or e}") from None
            params = {k: v.get("string_value") for k, v in (config.get("parameters") or {}).items()}
            if config.get("backend") not in BACKENDS or "trtllm_contract" in params:
                continue
            name, now = entry["name"], int(time.time())
            queue = int(params["max_queue_size"]) if (params.get("max_queue_size") or "").isdigit() else None
            checkpoint = self._checkpoint(name, params.get("model"))
            lora = (params.get("enable_lora") or "").lower() == "true" or bool(params.get("lora_modules"))
            found[name] = ServedModel(name, checkpoint, now, name, max_queue_size=queue,
                                      max_model_len=_max_model_len(params, checkpoint) or None,
                                      runner=self._runner(name, params), lora_enabled=lora,
                                      accepts_images=reads_images(checkpoint))
            # The model's own list (adapters loaded since start included), else its config's.
            adapters = (await listed_adapters(self.client, name)) if lora else None
            for adapter in adapters if adapters is not None else self._adapters(name, params):
                found.setdefault(adapter, dataclasses.replace(found[name], name=adapter, lora_name=adapter))
        self._models, self._listed_at = found, time.monotonic()
        return found

    def forget_models(self) -> None:
        """The next listing asks Triton again (an adapter was loaded or unloaded)."""
        self._listed_at = 0.0

    def _adapters(self, name: str, params: dict) -> list[str]:
        """The model's LoRA adapters: its `lora_modules` parameter, or the vLLM backend's
        `1/multi_lora.json` when the repository is on this machine."""
        text = params.get("lora_modules")
        if not text and self.repository:
            path = os.path.join(self.repository, name, "1", "multi_lora.json")
            if os.path.isfile(path):
                with open(path) as f:
                    text = f.read()
        if not text:
            return []
        from backend.config import lora_modules_value
        try:
            return list(lora_modules_value(text))
        except ValueError:
            return []                   # the backend refused to load it anyway

    def _runner(self, name: str, params: dict) -> str:
        """The model's `runner` parameter, else (a vLLM-backend repository on this machine)
        its `1/model.json`'s, as the backend reads them."""
        if params.get("runner"):
            return params["runner"]
        path = os.path.join(self.repository or "", name, "1", "model.json")
        if self.repository and os.path.isfile(path):
            try:
                with open(path) as f:
                    return str(json.load(f).get("runner") or "generate")
            except (OSError, ValueError, AttributeError):
                pass                    # the backend refused to load it anyway
        return "generate"

    def _checkpoint(self, name: str, model: Optional[str]) -> Optional[str]:
        if not model:
            return None
        path = model if os.path.isabs(model) or not self.repository else os.path.join(self.repository, name, model)
        return path if os.path.isdir(path) else None

    async def model(self, name: str) -> ServedModel:
        models = await self.models()
        if name not in models:
            self._listed_at = 0.0                    # loaded since the last listing?
            models = await self.models()
        if name not in models:
            raise APIError(404, f"The model '{name}' does not exist", "model")
        return models[name]

    def generate(self, model: str, prompt: Union[str, list[int]], sampling: dict, stream: bool,
                 logprobs: bool, images: Optional[list[str]] = None) -> "Generation":
        """images: data: URLs, sent as the vLLM backend's `image` input. A 503 at once while
        the supervisor says the backend cannot serve (backend_health.py)."""
        if self.health is not None:
            self.health.check()
        served = self._models.get(model)
        if served is not None and served.lora_name:
            model, sampling = served.triton_model, {**sampling, "lora_name": served.lora_name}
        generation = Generation(self.client, model, prompt, sampling, stream, logprobs, images)
        if self.health is not None:
            self.health.watch(generation)
        return generation


class ClientDisconnected(Exception):
    """The request was cancelled because its HTTP client went away (not an error of ours)."""


@contextlib.asynccontextmanager
async def cancelled_on_disconnect(request, gen: "Generation") -> AsyncIterator[None]:
    """Within the block, the HTTP client going away cancels `gen` (its iteration then
    raises ClientDisconnected). Waits on the ASGI channel itself: polling is_disconnected()
    never saw a disconnect behind the app's BaseHTTPMiddleware, and the request ran to its end."""
    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        gen.cancel()

    watcher = asyncio.create_task(watch())
    try:
        yield
    finally:
        watcher.cancel()


class Generation:
    """One Triton request. Iterate for its deltas; `cancel()` ends it (the backend aborts
    the request and frees its KV blocks)."""

    def __init__(self, client, model: str, prompt: Union[str, list[int]], sampling: dict, stream: bool,
                 logprobs: bool, images: Optional[list[str]] = None) -> None:
        self.request_id = uuid.uuid4().hex
        self.n = int(sampling.get("n", 1))
        flags = ["exclude_input_in_output", "return_num_input_tokens"] + (["return_logprobs"] if logprobs else [])
        outputs = list(OUTPUTS)
        if sampling.get("prompt_logprobs") is not None:
            flags.append("return_prompt_logprobs")
            outputs.append("prompt_logprobs")
        inputs = make_inputs(prompt if isinstance(prompt, str) else None, sampling, stream,
                             input_ids=None if isinstance(prompt, str) else list(prompt),
                             extra={**{name: np.array([True]) for name in flags},
                                    **({"image": np.array([u.encode() for u in images], dtype=np.object_)}
                                       if images else {})})
        # The empty final response tells us when Triton is done with the request.
        self._request = {"model_name": model, "inputs": inputs, "request_id": self.request_id,
                         "outputs": [InferRequestedOutput(o) for o in outputs],
                         "parameters": {"triton_enable_empty_final_response": True}}
        self._client = client
        self._call = None
        self._cancelled = False
        self._failure: Optional[APIError] = None     # fail(): ended by us, with this error
        self._answered = False          # Triton sent an error or the final response: fail() leaves it
        self._finished = [False] * self.n

    async def _requests(self):
        yield self._request

    def cancel(self) -> None:
        self._cancelled = True
        if self._call is not None:
            self._call.cancel()

    def fail(self, error: APIError) -> None:
        """Ends the request with `error` (its iteration raises it): the backend cannot
        serve it (backend_health.py). Not once Triton has answered its end (an error, or
        the final response): it is reading on to the end, which a cancel would overtake."""
        if self._failure is None and not self._answered and not all(self._finished):
            self._failure = error
            self.cancel()

    async def __aiter__(self) -> AsyncIterator[Delta]:
        if self._failure is not None:
            raise self._failure             # failed before it was sent
        self._call = self._client.stream_infer(self._requests())
        failure: Optional[APIError] = None
        try:
            async for result, error in self._call:
                if error is not None:
                    # The backend sends FINAL after an error: read on to it. Cancelling the
                    # stream in between leaves the request behind in Triton 24.10, which
                    # then never unloads the model.
                    self._answered = True
                    failure = failure or from_triton(str(error.message() if hasattr(error, "message") else error))
                    continue
                param = result.get_response().parameters.get("triton_final_response")
                if failure is None and result.as_numpy("text_output") is not None:
                    for delta in _deltas(result, self.n, self._finished):
                        if delta.finish_reason is not None:
                            self._finished[delta.index] = True
                        yield delta
                if param is not None and param.bool_param:
                    self._answered = True
                    await stream_end(self._call)
                    break
            if failure is not None:
                raise failure
        except asyncio.CancelledError:
            # Our own cancel() ends the gRPC call with CancelledError; a cancellation of
            # this task (shutdown) stays one.
            task = asyncio.current_task()
            if self._cancelled and not (task and task.cancelling()):
                if self._failure is not None:
                    raise self._failure from None
                raise ClientDisconnected(self.request_id) from None
            raise
        except (InferenceServerException, grpc.RpcError) as e:
            raise unavailable(e) or from_triton(e.message() if isinstance(e, InferenceServerException)
                                                else e.details() or str(e)) from None
        finally:
            # Ends the gRPC stream too: one left open keeps Triton from unloading the
            # model (a decoupled model stays live while any of its streams is open).
            self.cancel()


async def stream_end(call) -> None:
    """After a request's final response, let Triton end its stream (our side has
    half-closed it: one request) instead of cancelling it, for at most
    STREAM_END_TIMEOUT_S; the caller's cancel then ends what is left. A cancel that
    overtakes the backend's release of the request (a request the engine refuses at once
    sends its final response while execute() is still returning) left the request behind
    in Triton 24.10: the model stayed live and shutdown waited out its 30 s exit timeout.
    One cancellation of the calling task meanwhile (what /v1/embeddings does to the
    other inputs when one fails) waits for the end too, then goes on. A cancel scope
    that cancels again and again (Starlette's, when a streaming client hangs up right
    after the last token) ends the wait early, and the caller's cancel then comes as
    early as it did before."""
    async def rest() -> None:
        async for _ in call:
            pass

    async def bounded() -> None:
        try:
            await asyncio.wait_for(rest(), STREAM_END_TIMEOUT_S)
        except (asyncio.TimeoutError, InferenceServerException, grpc.RpcError):
            pass
    end = asyncio.ensure_future(bounded())
    try:
        await asyncio.shield(end)
    except asyncio.CancelledError:
        await asyncio.wait([end])
        raise


def _max_model_len(params: dict, checkpoint: Optional[str]) -> int:
    value = params.get("max_model_len") or ""
    if value.isdigit():
        return int(value)
    try:
        with open(os.path.join(checkpoint or "", "config.json")) as f:
            return int(json.load(f).get("max_position_embeddings") or 0)
    except (OSError, ValueError):
        return 0


def _deltas(result, n: int, finished: list[bool]) -> list[Delta]:
    """A stream response carries one sequence's delta ("" and padding for the others, and
    every sequence's finish reason so far); a single response carries every sequence whole.
    Sequences already reported finished are skipped."""
    texts = [t.decode() for t in result.as_numpy("text_output").reshape(-1)]
    ids = result.as_numpy("output_ids")
    rows = [ids.reshape(-1).tolist()] if n == 1 else [[t for t in row if t >= 0] for row in ids.reshape(n, -1)]
    reasons = [r.decode() for r in result.as_numpy("finish_reason").reshape(-1)]
    num_input = int(result.as_numpy("num_input_tokens").reshape(-1)[0])
    raw_lp = result.as_numpy("logprobs")
    lps = [json.loads(x.decode()) or [] for x in raw_lp.reshape(-1)] if raw_lp is not None else [[]] * n
    raw_prompt = result.as_numpy("prompt_logprobs")
    prompt_lps = json.loads(raw_prompt.reshape(-1)[0].decode()) if raw_prompt is not None else None
    out = []
    for i in range(n):
        if finished[i]:
            continue
        reason = None if reasons[i] == "None" else reasons[i]
        if n > 1 and not rows[i] and not texts[i] and reason is None:
            continue                                  # another sequence's delta
        out.append(Delta(i, texts[i], rows[i], reason, lps[i], num_input, prompt_lps))
    return out
