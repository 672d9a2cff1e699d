"""Feature-packet path against a raw send/recv of the same bytes, same backend, same run.

    python -m dflash_dist.bench.transport [--json runs/bench/transport.json] [--reps 7]
    torchrun --nproc_per_node=2 -m dflash_dist.bench.transport      # NCCL + CUDA where there is CUDA

Without torchrun it spawns two gloo processes itself. Rank 0 sends, rank 1 receives; other ranks only
join the barriers. One timed transfer = barrier, then rank 0 sends and waits for a one-element ack
that rank 1 sends once it holds the data; the same handshake wraps both paths, so the ratio is fair.
Paths rotate order every repetition (the machines are shared and noisy); GiB/s is the median, and
packet/raw the median of the ratios of the two paths' times within each repetition.

  packet: PacketSender.send + flush  ->  PendingPacket(...).wait()   (header, meta, features)
  raw:    dist.send / dist.recv of one preallocated uint8 buffer of the packet's total bytes
  raw_again: raw once more, as an A/A control; packet_fresh (CPU): packet with the receive pool off
  bare:   the packet's three messages as bare isend/irecv of preallocated buffers, no packet code: what
          the protocol costs by itself
Besides the medians, p10 (10th percentile) times: on a shared machine the noise only ever adds time,
so the low percentiles show the fixed cost of each path that the medians blur.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dflash_dist.bench.common import sync
from dflash_dist.bench.jobs import check_outputs
from dflash_dist.config import ranged
from dflash_dist.data.collate import PackedBatch
from dflash_dist.parallel.transport import HEADER_LEN, PacketSender, PendingPacket, RecvPool

FEAT_DIM = 5 * 4096  # five captured layers of a Qwen3-8B-sized target
MiB = 1 << 20


def cases(sizes_mib: list[float], real_tokens: int, feat_dim: int) -> list[tuple[str, int]]:
    """(name, token count): packets of about each size, then the realistic packet."""
    per_tok = feat_dim * 2  # bf16 features; meta adds 16 B per token
    out = [(f"{s:g} MiB", max(1, int(s * MiB) // per_tok)) for s in sizes_mib]
    if real_tokens:
        out.append((f"real: {real_tokens} tok x {feat_dim}", real_tokens))
    return out


def make_batch(n_tokens: int, seq_len: int, feat_dim: int, device: torch.device) -> tuple[PackedBatch, torch.Tensor]:
    lens = [seq_len] * (n_tokens // seq_len) + ([n_tokens % seq_len] if n_tokens % seq_len else [])
    cu = torch.tensor([0] + lens).cumsum(0)
    g = torch.Generator().manual_seed(n_tokens)
    ids = torch.randint(0, 151936, (n_tokens,), generator=g)
    mask = torch.rand(n_tokens, generator=g) < 0.7
    # Drawn where it lives: a 49K-token packet is 1.9 GiB, too slow to draw on the host and copy.
    feats = torch.empty(n_tokens, feat_dim, dtype=torch.bfloat16, device=device).normal_()
    return PackedBatch(ids, mask, cu), feats


def packet_bytes(batch: PackedBatch, feat_dim: int) -> int:
    return 8 * (HEADER_LEN + 2 * batch.num_tokens + batch.num_seqs + 1) + 2 * batch.num_tokens * feat_dim


def _timed(rank: int, device: torch.device, send_fn, recv_fn, ack: torch.Tensor) -> float:
    """Seconds from rank 0 starting the send until rank 1 has acknowledged the data (rank 0 only)."""
    dist.barrier()
    sync(device)
    if rank == 0:
        t0 = time.perf_counter()
        send_fn()
        dist.recv(ack, 1)
        sync(device)
        return time.perf_counter() - t0
    if rank == 1:
        recv_fn()
        sync(device)
        dist.send(ack, 0)
    return 0.0


def run_case(rank: int, device: torch.device, name: str, n_tokens: int, feat_dim: int, reps: int,
             warmup: int, fresh: bool = True) -> dict:
    batch, feats = make_batch(n_tokens, 512, feat_dim, device)
    total = packet_bytes(batch, feat_dim)
    raw = torch.empty(total, dtype=torch.uint8, device=device)
    ack = torch.zeros(1, device=device)
    sender = PacketSender(max_in_flight=1)
    counter = iter(range(1 << 30))

    def packet_send():
        sender.send(1, 0, next(counter), batch, feats, 0.0, 0.0)
        sender.flush()

    pool = RecvPool() if device.type == "cpu" else None

    def packet_recv(pool=pool):
        p = PendingPacket(0, 0, next(counter), batch.num_tokens, batch.num_seqs, feat_dim, torch.bfloat16,
                          device, pool=pool).wait()
        assert p.features.shape == (n_tokens, feat_dim)
        if pool is not None:
            pool.give_back(p.features)

    def fresh_recv():  # the receiver without a buffer pool: a new allocation per packet
        packet_recv(pool=None)

    raw_paths = (lambda: dist.send(raw, 1), lambda: dist.recv(raw, 0))
    n, s = batch.num_tokens, batch.num_seqs
    parts = (torch.zeros(HEADER_LEN, dtype=torch.int64, device=device),
             torch.zeros(2 * n + s + 1, dtype=torch.int64, device=device), feats)
    into = [torch.empty_like(t) for t in parts] if rank == 1 else []

    def bare(op, tensors, peer):
        for w in [op(t, peer) for t in tensors]:
            w.wait()

    # raw_again is the raw path timed a second time (an A/A control): its ratio is this machine's noise.
    paths = {"packet": (packet_send, packet_recv), "raw": raw_paths, "raw_again": raw_paths,
             "bare": (lambda: bare(dist.isend, parts, 1), lambda: bare(dist.irecv, into, 0))}
    if device.type == "cpu" and fresh:
        paths["packet_fresh"] = (packet_send, fresh_recv)
    times: dict[str, list[float]] = {k: [] for k in paths}
    names = list(paths)
    for i in range(warmup + reps):
        for k in names[i % len(names):] + names[:i % len(names)]:  # rotate the order every repetition
            t = _timed(rank, device, *paths[k], ack)
            if i >= warmup:
                times[k].append(t)
    gib = total / (1 << 30)
    row = {"case": name, "tokens": n_tokens, "seqs": batch.num_seqs, "feat_dim": feat_dim, "bytes": total}
    for k, v in times.items():
        med = statistics.median(v) if rank == 0 else 0.0
        row[f"{k}_s"], row[f"{k}_gib_s"], row[f"{k}_all_s"] = med, gib / med if med else 0.0, v
        row[f"{k}_p10_s"] = sorted(v)[len(v) // 10] if rank == 0 else 0.0
    for k in paths:  # per repetition, raw and this path ran back to back: the ratio of each pair, median
        if k != "raw" and rank == 0:
            row[f"{k}/raw"] = statistics.median(r / t for r, t in zip(times["raw"], times[k]))
    return row


def print_table(rows: list[dict], backend: str) -> None:
    fresh = bool(rows) and "packet_fresh_s" in rows[0]
    print(f"\ntransport: packet path vs raw send/recv of the same bytes ({backend}; GiB/s: median; "
          "packet/raw: median of the per-repetition ratios)")
    print(f"{'case':<24}{'MiB':>8}{'packet':>9}{'raw':>9}{'packet/raw':>12}{'A/A':>7}{'bare/raw':>10}"
          f"{'p10 ms: packet':>16}{'bare':>7}{'raw':>7}" + (f"{'fresh':>9}{'fresh/raw':>11}" if fresh else ""))
    for r in rows:
        line = (f"{r['case']:<24}{r['bytes'] / MiB:>8.2f}{r['packet_gib_s']:>9.3f}{r['raw_gib_s']:>9.3f}"
                f"{r['packet/raw']:>12.3f}{r['raw_again/raw']:>7.3f}{r['bare/raw']:>10.3f}"
                f"{r['packet_p10_s'] * 1e3:>16.2f}{r['bare_p10_s'] * 1e3:>7.2f}{r['raw_p10_s'] * 1e3:>7.2f}")
        if fresh:
            line += f"{r['packet_fresh_gib_s']:>9.3f}{r['packet_fresh/raw']:>11.3f}"
        print(line)
    print("A/A: raw timed twice in each repetition, raw/raw again: how far from 1 this machine's noise alone is")
    print("bare: the packet's three messages without packet code; p10: 10th-percentile time of a transfer")
    if fresh:
        print("fresh: the packet path with a new receive buffer per packet (no pool), as before the fix")


def bench(rank: int, world: int, args: argparse.Namespace) -> list[dict] | None:
    backend = dist.get_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    rows = [run_case(rank, device, name, n, args.feat_dim, args.reps, args.warmup, not args.no_fresh)
            for name, n in cases(args.sizes, args.real_tokens, args.feat_dim)]
    if rank != 0:
        return None
    print_table(rows, backend)
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"backend": backend, "world": world, "device": str(device), "reps": args.reps, "warmup": args.warmup,
            "torch": torch.__version__, "threads": torch.get_num_threads()}
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")
    return rows


def _init(backend: str, **rendezvous) -> None:
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend, **rendezvous)


def _spawned(rank: int, init_method: str, args: argparse.Namespace) -> None:
    os.environ.update(LOCAL_RANK=str(rank))
    # Two processes share the cores; a full intra-op pool each would only contend.
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    _init(args.backend, init_method=init_method, rank=rank, world_size=2)
    try:
        bench(rank, 2, args)
    finally:
        dist.destroy_process_group()


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=ranged(float, gt=0), nargs="*", default=[1, 16, 128], help="packet sizes in MiB")
    p.add_argument("--real-tokens", type=ranged(int, ge=0), default=2048,
                   help="tokens of the realistic packet (2048 x 5x4096 bf16 = 80 MiB); 0 skips it")
    p.add_argument("--feat-dim", type=ranged(int, ge=1), default=FEAT_DIM)
    p.add_argument("--reps", type=ranged(int, ge=1), default=15)
    p.add_argument("--warmup", type=ranged(int, ge=0), default=2)
    p.add_argument("--backend", default="auto", help="auto: nccl with CUDA, gloo otherwise")
    p.add_argument("--no-fresh", action="store_true",
                   help="skip the CPU comparison path that allocates a new receive buffer per packet")
    p.add_argument("--json", default="runs/bench/transport.json")
    args = p.parse_args(argv)
    if "RANK" not in os.environ:  # the launching process (under torchrun every rank parses the same flags)
        check_outputs(p, args)
    if args.backend == "auto":
        args.backend = "nccl" if torch.cuda.is_available() else "gloo"
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if "RANK" in os.environ:  # under torchrun
        _init(args.backend)
        try:
            if dist.get_world_size() < 2:
                raise SystemExit("transport bench needs two ranks")
            bench(dist.get_rank(), dist.get_world_size(), args)
        finally:
            dist.destroy_process_group()
        return
    # The rendezvous is a file of this run's own: no port to choose, release and have rank 0 bind later.
    with tempfile.TemporaryDirectory(prefix="dflash-transport-") as d:
        mp.spawn(_spawned, args=(f"file://{d}/store", args), nprocs=2, join=True)


if __name__ == "__main__":
    main()
