"""Serving benchmark over gRPC streaming: fixed concurrency or Poisson arrivals.

Per request: TTFT = first token - send; E2E = last response - send;
TPOT = (E2E - TTFT) / (n - 1); ITL = gaps between consecutive token responses (pooled
over all requests). Goodput = requests/s that met every SLO.
"""

from __future__ import annotations

import random
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Optional

from clients.triton_client import StreamingRequest


@dataclass
class RequestRecord:
    send: float
    token_times: list[float]
    end: float
    num_prompt_tokens: int
    num_output_tokens: int
    error: Optional[str] = None

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.send

    @property
    def e2e(self) -> float:
        return self.end - self.send

    @property
    def tpot(self) -> Optional[float]:
        n = self.num_output_tokens
        return (self.e2e - self.ttft) / (n - 1) if n > 1 else None

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


def percentiles(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {"mean": float("nan"), "p50": float("nan"), "p90": float("nan"), "p99": float("nan")}
    s = sorted(xs)

    def pct(p: float) -> float:  # linear interpolation, as numpy's default
        k = (len(s) - 1) * p
        lo, hi = int(k), min(int(k) + 1, len(s) - 1)
        return s[lo] + (s[hi] - s[lo]) * (k - lo)

    return {"mean": statistics.fmean(s), "p50": pct(0.5), "p90": pct(0.9), "p99": pct(0.99)}


def summarize(records: list[RequestRecord], duration_s: float,
              slo: Optional[tuple[float, float]] = None) -> dict:
    """slo = (ttft_ms, tpot_ms)."""
    ok = [r for r in records if r.error is None and r.token_times]
    out_tokens = sum(r.num_output_tokens for r in ok)
    tpots = [r.tpot for r in ok if r.tpot is not None]
    summary = {
        "requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration_s,
        "request_throughput": len(ok) / duration_s,
        "output_token_throughput": out_tokens / duration_s,
        "ttft_s": percentiles([r.ttft for r in ok]),
        "tpot_s": percentiles(tpots),
        "itl_s": percentiles([x for r in ok for x in r.itls]),
        "e2e_s": percentiles([r.e2e for r in ok]),
    }
    if slo is not None:
        ttft_max, tpot_max = slo[0] / 1000, slo[1] / 1000
        good = [r for r in ok if r.ttft <= ttft_max and (r.tpot is None or r.tpot <= tpot_max)]
        summary["slo_ms"] = {"ttft": slo[0], "tpot": slo[1]}
        summary["goodput"] = len(good) / duration_s
    return summary


def run_serving(url: str, prompts: list[list[int]], output_lens: list[int], model: str = "llm",
                concurrency: Optional[int] = None, request_rate: Optional[float] = None,
                seed: int = 0) -> tuple[list[RequestRecord], float]:
    """Either `concurrency` requests in flight at all times, or Poisson arrivals at
    `request_rate` per second (unbounded concurrency)."""
    records: list[Optional[RequestRecord]] = [None] * len(prompts)

    def one(i: int) -> None:
        n = output_lens[i]
        params = {"max_tokens": n, "min_tokens": n, "ignore_eos": True, "temperature": 0}
        res = StreamingRequest(url, model).run(None, params, input_ids=prompts[i])
        records[i] = RequestRecord(send=res.start, token_times=res.times, end=res.end,
                                   num_prompt_tokens=len(prompts[i]), num_output_tokens=len(res.token_ids),
                                   error=res.error)

    t0 = time.perf_counter()
    if request_rate is None:
        with ThreadPoolExecutor(concurrency or 1) as pool:
            list(pool.map(one, range(len(prompts))))
    else:
        rng = random.Random(seed)
        threads = []
        for i in range(len(prompts)):
            th = threading.Thread(target=one, args=(i,))
            th.start()
            threads.append(th)
            time.sleep(rng.expovariate(request_rate))
        for th in threads:
            th.join()
    duration = time.perf_counter() - t0
    return [r for r in records if r is not None], duration


def records_to_json(records: list[RequestRecord]) -> list[dict]:
    return [asdict(r) for r in records]
