"""Cancellation storm and overload against a real tritonserver whose KV pool is several
times too small for the offered load (loopback only, bounded in count and time)."""

import pytest

from builder.build import BuildOptions, build
from clients.stress import run_stress
from clients.tritonserver import TritonServer


@pytest.fixture(scope="module")
def small_pool_server(tmp_path_factory, tiny_ckpt):
    repo = tmp_path_factory.mktemp("stress_repo")
    # 48 blocks x 16 = 768 tokens of KV for 48 concurrent streams of ~40-150 tokens.
    build(BuildOptions.create(checkpoint=tiny_ckpt, output=str(repo / "llm"), name="llm", link=True, block_size=16,
                              num_kv_blocks=48, max_num_seqs=48, max_num_batched_tokens=256, max_model_len=768,
                              max_queue_size=1000), log=lambda *_: None)
    # Supervised, as `make serve` runs it: a storm is no fault, so nothing is restarted.
    with TritonServer(str(repo), log_path=str(repo / "server.log"), supervised=True) as srv:
        yield srv


def test_cancellation_storm_under_overload(small_pool_server):
    srv = small_pool_server
    report = run_stress(srv.grpc_url, srv.metrics_url, streams=160, concurrency=48, max_tokens=24,
                        killed_clients=3, streams_per_killed_client=6, time_limit_s=240)
    print(report)
    assert report.leaked_blocks == 0
    assert report.survivors_mismatched == 0 and report.survivors_checked == 80
    assert report.cancelled > 0 and report.preemptions > 0
    assert report.rejected == 0
    assert '"failures": {}' in srv.supervisor("/status")[1]
