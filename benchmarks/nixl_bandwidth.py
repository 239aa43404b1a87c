"""NIXL transfer bandwidth between two processes, as disaggregation uses it (issue 55):
one process registers a buffer of KV blocks, the other READs blocks of it into its own,
one descriptor per block, as backend/engine/kv_transfer/nixl_transport.py does.

    python -m benchmarks.nixl_bandwidth [--device cpu|cuda] [--total-mib 1024]
        [--block-kib 32 256 2048] [--repeats 5] [--json out.json]

`--block-kib 32` is one layer's K (or V) block of a Llama-3.1-8B-shaped bf16 cache (16
tokens x 8 KV heads x 128 dims x 2 bytes); the engine moves one such range per layer,
K and V, per block. Printed per block size: the median time of a READ of `--total-mib`
and its GB/s, with the machine's memory copy rate (torch, same buffers, one process)
beside it as the ceiling. With `--device cuda` the buffers are device memory (VRAM)
on GPU 0 in both processes.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time

from benchmarks.report import dump, print_table


def _owner(device: str, total: int, conn) -> None:
    import torch

    from backend.engine.kv_transfer.nixl_transport import _nixl
    nixl_agent, nixl_agent_config = _nixl()
    agent = nixl_agent("owner", nixl_agent_config(backends=["UCX"]))
    buffer = torch.randint(0, 255, (total,), dtype=torch.uint8, device=device)
    agent.register_memory(buffer)
    conn.send((agent.get_agent_metadata(), buffer.data_ptr()))
    conn.recv()                         # until the reader is done


def _read(agent, remote: str, local_descs, remote_descs) -> float:
    start = time.perf_counter()
    handle = agent.initialize_xfer("READ", local_descs, remote_descs, remote)
    state = agent.transfer(handle)
    while state not in ("DONE", "ERR"):
        state = agent.check_xfer_state(handle)
    elapsed = time.perf_counter() - start
    agent.release_xfer_handle(handle)
    if state == "ERR":
        raise RuntimeError("NIXL reported an error")
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--total-mib", type=int, default=1024)
    ap.add_argument("--block-kib", type=int, nargs="+", default=[32, 256, 2048])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()
    import numpy as np
    import torch

    from backend.engine.kv_transfer.nixl_transport import _nixl
    total = args.total_mib << 20
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    owner = ctx.Process(target=_owner, args=(args.device, total, child), daemon=True)
    owner.start()
    try:
        metadata, remote_base = parent.recv()
        nixl_agent, nixl_agent_config = _nixl()
        agent = nixl_agent("reader", nixl_agent_config(backends=["UCX"]))
        local = torch.empty(total, dtype=torch.uint8, device=args.device)
        agent.register_memory(local)
        remote = agent.add_remote_agent(metadata)
        mem = "VRAM" if args.device == "cuda" else "DRAM"
        rows = []
        for kib in args.block_kib:
            size = kib << 10
            n = total // size
            offsets = np.arange(n, dtype=np.int64) * size

            def descs(base):
                table = np.stack([base + offsets, np.full(n, size, np.int64), np.zeros(n, np.int64)], axis=1)
                return agent.get_xfer_descs(table, mem)
            times = [_read(agent, remote, descs(local.data_ptr()), descs(remote_base)) for _ in range(args.repeats)]
            copy = torch.empty_like(local)
            copies = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                copy.copy_(local)
                if args.device == "cuda":
                    torch.cuda.synchronize()
                copies.append(time.perf_counter() - start)
            t, c = statistics.median(times), statistics.median(copies)
            rows.append({"block_kib": kib, "blocks": n, "read_s": t, "read_gb_s": total / t / 1e9,
                         "copy_gb_s": total / c / 1e9})
            print(rows[-1], flush=True)
    finally:
        parent.send("done")
        owner.join(timeout=30)
    print_table(["block KiB", "blocks", "READ ms", "READ GB/s", "local copy GB/s"],
                [[r["block_kib"], r["blocks"], 1000 * r["read_s"], r["read_gb_s"], r["copy_gb_s"]] for r in rows])
    dump(args.json, args, rows=rows)


if __name__ == "__main__":
    main()
