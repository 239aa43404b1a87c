"""One request's engine outputs -> Triton responses, in the vLLM backend's contract.

A request for n sequences has n engine children (backend.engine.parallel_sampling); each
response carries one entry per sequence, in index order, as the vLLM backend's
`text_output` does: a stream sends, on each child's output, that child's delta with ""
for the others; a single response waits for every child and sends their whole texts.
Runs on the adapter's response thread only.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Collection, Optional

import numpy as np
import triton_python_backend_utils as pb_utils

from backend.engine.engine_loop import RequestStopped
from backend.engine.outputs import RequestOutput
from backend.triton_server.errors import triton_error
from backend.triton_server.metrics import SequenceTiming
from backend.triton_server.request_parser import ParsedRequest

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def _strings(values: list[str]) -> np.ndarray:
    return np.array([v.encode("utf-8") for v in values], dtype=np.object_)


def inference_response(tensors: dict[str, np.ndarray], requested: Collection[str]):
    """A response with only the outputs its request asked for (all of the model's when
    it named none: Triton asks for all then). Python backend 24.10's send drops the
    others itself, but with the GIL released, and the numpy array it frees then
    corrupts the stub's heap: segfaults and garbled tensors under load, in whichever
    stub sent them (python_backend #390, fixed in 24.12)."""
    return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(name, value)
                                                      for name, value in tensors.items() if name in requested])


@dataclass
class Sequence:
    """One child's progress."""
    request_id: str
    timing: SequenceTiming
    text_parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    cumulative_logprob: float = 0.0
    finish_reason: Optional[str] = None
    finished: bool = False
    embedding: Optional[np.ndarray] = None      # a pooling model's result


class ResponseWriter:
    def __init__(self, request_id: str, sender, parsed: ParsedRequest, arrival: float,
                 child_ids: list[str], requested_outputs: Collection[str]) -> None:
        self.request_id = request_id
        self.sender = sender
        self.requested_outputs = frozenset(requested_outputs)
        self.parsed = parsed
        self.arrival = arrival
        self.seqs = [Sequence(cid, SequenceTiming(arrival, parsed.params.priority)) for cid in child_ids]
        self.sent_prompt = False
        # SamplingParams.prompt_logprobs' result (from whichever child computed it), and
        # whether a stream has sent it (once).
        self.prompt_logprobs: Optional[list] = None
        self.sent_prompt_logprobs = False
        self.done = False          # FINAL sent (or the client is gone)
        self.cancel_sent = False   # abort already requested

    @property
    def unfinished_child_ids(self) -> list[str]:
        return [s.request_id for s in self.seqs if not s.finished]

    def on_output(self, index: int, out: RequestOutput) -> Optional[tuple[object, int]]:
        """Record a child's output; return the (response, flags) to send, if any."""
        if self.done:
            return None
        if isinstance(out.error, RequestStopped):
            out.error = None  # a normal end: finish_reason "abort"
        seq = self.seqs[index]
        seq.timing.num_prompt_tokens = out.num_prompt_tokens
        seq.timing.on_tokens(time.monotonic(), len(out.new_token_ids))
        if not self.parsed.stream:  # a single response sends it all at the end
            seq.token_ids += out.new_token_ids
            seq.text_parts.append(out.new_text)
            seq.logprobs += out.new_logprobs or []
        if out.cumulative_logprob is not None:
            seq.cumulative_logprob = out.cumulative_logprob
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.pooling_output is not None:
            seq.embedding = out.pooling_output.numpy().astype(np.float32, copy=False)
        if out.finished:
            seq.finished, seq.finish_reason = True, out.finish_reason
        if out.error is not None:
            return pb_utils.InferenceResponse(error=triton_error(out.error)), FINAL
        all_done = all(s.finished for s in self.seqs)
        if self.parsed.stream:
            return self._delta_response(index, out), FINAL if all_done else 0
        if all_done:
            return self._final_response(), FINAL
        return None

    def send(self, response, flags: int) -> None:
        if flags & FINAL:
            self.done = True
        try:
            if flags & FINAL and response.has_error():
                # The error, then FINAL on its own: Python backend 24.10 drops an error
                # sent with FINAL after streamed responses on its way to a BLS caller
                # (the TensorRT-LLM fronts), which then never saw the end. The error
                # still reaches gRPC and HTTP clients; FINAL now reaches every caller.
                self.sender.send(response)
                self.sender.send(flags=FINAL)
            else:
                self.sender.send(response, flags=flags)
        except Exception:
            # The client is gone; past FINAL there is nothing left to abort, before it
            # the response thread aborts the request.
            if not self.done:
                raise

    # ------------------------------------------------------------ responses
    def _delta_response(self, index: int, out: RequestOutput):
        p = self.parsed
        texts = ["" for _ in self.seqs]
        texts[index] = out.new_text
        if not p.exclude_input_in_output and not self.sent_prompt:  # only reachable with n == 1
            texts[index], self.sent_prompt = p.prompt_text + texts[index], True
        new = [[] for _ in self.seqs]
        new[index] = out.new_token_ids
        entries = [[] for _ in self.seqs]
        entries[index] = out.new_logprobs or []
        return self._response(texts, new, entries)

    def _final_response(self):
        p = self.parsed
        prefix = "" if p.exclude_input_in_output else p.prompt_text
        return self._response([prefix + "".join(s.text_parts) for s in self.seqs],
                              [s.token_ids for s in self.seqs], [s.logprobs for s in self.seqs])

    def _response(self, texts: list[str], token_ids: list[list[int]], entries: list[list]):
        p = self.parsed
        tensors = {"text_output": _strings(texts), "output_ids": _token_ids(token_ids)}
        if p.return_finish_reason:  # "None" until a sequence ends, as vLLM
            tensors["finish_reason"] = _strings([str(s.finish_reason) for s in self.seqs])
        if p.return_cumulative_logprob:
            tensors["cumulative_logprob"] = np.array([s.cumulative_logprob for s in self.seqs], dtype=np.float32)
        if p.return_logprobs:
            tensors["logprobs"] = _strings([_logprobs_json(e) if p.logprobs_requested else "null" for e in entries])
        if p.return_prompt_logprobs:    # once: on the first response that has it
            text = "null"
            if self.prompt_logprobs is not None and not self.sent_prompt_logprobs:
                text, self.sent_prompt_logprobs = _logprobs_json(self.prompt_logprobs), True
            tensors["prompt_logprobs"] = _strings([text])
        if p.return_num_input_tokens:
            tensors["num_input_tokens"] = np.array([self.seqs[0].timing.num_prompt_tokens], dtype=np.uint32)
        if p.return_num_output_tokens:
            tensors["num_output_tokens"] = np.array([len(t) for t in token_ids], dtype=np.uint32)
        if self.seqs[0].embedding is not None:
            tensors["embedding"] = self.seqs[0].embedding
        return inference_response(tensors, self.requested_outputs)


def _token_ids(token_ids: list[list[int]]) -> np.ndarray:
    """[T] for one sequence; [n, T] padded with -1 for several (num_output_tokens says
    how many of each row are real)."""
    if len(token_ids) == 1:
        return np.array(token_ids[0], dtype=np.int32)
    width = max(len(t) for t in token_ids)
    return np.array([t + [-1] * (width - len(t)) for t in token_ids], dtype=np.int32)


def _logprobs_json(entries) -> str:
    """vLLM's logprobs as JSON: per token {token id: {logprob, rank, decoded_token}}, in
    the engine's order (the chosen token first); a prompt's first entry is null."""
    return json.dumps([None if entry is None else
                       {str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
                        for t, lp in entry.items()} for entry in entries])
