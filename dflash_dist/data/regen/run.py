"""The driver: this rank's chunks, turn by turn, then (rank 0) the merge.

Turn by turn: assistant turn t of a conversation is generated from the conversation rendered up to that
turn with the target's chat template and generation prompt; the reply replaces the turn before turn t + 1
is rendered, so every later turn continues the target's own conversation. All conversations of a chunk are
in flight at once: the vLLM engine takes a conversation's next turn as soon as its reply ends (continuous
batching); the hf engine batches turn t of every conversation together. A conversation whose reply reaches the token limit is dropped under --on-length drop (its
later turns are not generated) or kept cut under keep; either way it is counted.

Faults (docs/operations.md, "Regeneration under faults"): rank 0 holds the run lock of --output (one run per
output); under torchrun the ranks watch each other's heartbeats (peers.py: a dead peer is named, every rank
exits 3); a write that fails (a full disk) exits 2 naming the file with every finished chunk kept; a run
whose every conversation was skipped exits 2, saying so.
"""
from __future__ import annotations

import json
import logging
import math
import os
import signal
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

from dflash_dist.data.digest import file_digest
from dflash_dist.data.prepare import Skip
from dflash_dist.data.regen import chunks
from dflash_dist.data.regen.chat import SKIP_REASONS, ChatRenderer, Conversation, parse_line, stop_token_ids
from dflash_dist.data.regen.engine import Engine, EngineSpec, Generated, Request, Sampling
from dflash_dist.data.regen.engines import build_engine
from dflash_dist.data.regen.peers import END, GO, PeerLost, Peers
from dflash_dist.data.regen.progress import RankProgress, Reporter
from dflash_dist.exits import EXIT_BAD_INPUT, EXIT_PEER_LOST, EXIT_RESUME  # 75: finished chunks kept, rerun
from dflash_dist.io.runlock import RunLock

log = logging.getLogger(__name__)

LOGGED_PER_REASON = 20


@dataclass(frozen=True)
class Job:
    input: Path
    output: Path
    engine: EngineSpec
    sampling: Sampling
    on_length: str = "drop"  # drop | keep
    enable_thinking: bool | None = None  # None: the chat template's default
    chunk_size: int = 2000
    progress_s: float = 30.0
    heartbeat_s: float = 1.0  # under torchrun: the ranks' heartbeats (peers.py)
    dead_after_s: float = 60.0


@dataclass(frozen=True)
class Shard:
    """Which share of the chunks this process does: chunk c belongs to rank c % world."""
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @staticmethod
    def from_env() -> "Shard":
        return Shard(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
                     int(os.environ.get("LOCAL_RANK", 0)))


class StopSignal:
    """SIGTERM / SIGUSR2 / SIGINT: finish the chunk in hand, write it, exit 75."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR2, signal.SIGINT)

    def __init__(self):
        self.name = ""
        self.before = {sig: signal.getsignal(sig) for sig in self.SIGNALS}

    def install(self) -> "StopSignal":
        for sig in self.SIGNALS:
            signal.signal(sig, self._handler)
        return self

    def restore(self) -> None:
        for sig, handler in self.before.items():
            signal.signal(sig, handler)

    def _handler(self, signum, frame) -> None:
        if not self.name:
            self.name = signal.Signals(signum).name
            log.warning("received %s: stopping after the current chunk is written", self.name)


def job_key(job: Job) -> dict:
    """What a chunk's content depends on (not the number of ranks, nor where the output goes). The input
    by its content: an edit that keeps its size and mtime (sed, then touch -r; cp -p; rsync -a) is another job."""
    return {"format": 3, "input": str(job.input.absolute()), "input_size": job.input.stat().st_size,
            "input_sha256": file_digest(job.input), "target": str(Path(job.engine.target).absolute()),
            "tokenizer": str(Path(job.engine.tokenizer).absolute()), "engine": job.engine.name,
            "dtype": job.engine.dtype, "max_model_len": job.engine.max_model_len, "sampling": asdict(job.sampling),
            "on_length": job.on_length, "enable_thinking": job.enable_thinking, "chunk_size": job.chunk_size}


def request_seed(seed: int, line_no: int, turn: int) -> int:
    """A sampled reply depends on (seed, line, turn) only: the same with any chunking or rank count."""
    return (seed * 1_000_003 + line_no * 257 + turn) % (2 ** 31 - 1)


class ChunkWorker:
    """Regenerates one chunk at a time with this rank's engine; keeps the skip log bounded."""

    def __init__(self, job: Job, engine: Engine, renderer: ChatRenderer, progress: RankProgress):
        self.job, self.engine, self.renderer, self.progress = job, engine, renderer, progress
        self.logged: Counter = Counter()

    def skip(self, counts: Counter, line_no: int, reason: str, message: str) -> None:
        counts[f"skipped.{reason}"] += 1
        if reason == "blank_line":
            return
        self.logged[reason] += 1
        level = logging.WARNING if self.logged[reason] <= LOGGED_PER_REASON else logging.DEBUG
        log.log(level, "%s:%d: skipped (%s): %s", self.job.input, line_no, reason, message)
        if self.logged[reason] == LOGGED_PER_REASON:
            log.warning("later %s skips of this rank are not logged one by one: the progress line and the final "
                        "line count them all (and OUTPUT's meta file)", reason)

    def run(self, lines: list[tuple[int, bytes]]) -> tuple[list[str], Counter]:
        counts: Counter = Counter(lines=len(lines))
        convs: list[Conversation] = []
        for line_no, raw in lines:
            try:
                convs.append(parse_line(line_no, raw))
            except Skip as s:
                self.skip(counts, line_no, s.reason, str(s))
        self.progress.add(conversations=len(lines) - len(convs))
        alive = {c.line_no: c for c in convs}
        first = [r for c in convs if (r := self._request(c, 0, alive, counts)) is not None]
        self.engine.serve(first, self.job.sampling, lambda r, g: self._reply(r, g, alive, counts))
        out = [c for c in convs if c.line_no in alive]
        counts.update(conversations_out=len(out), replies=sum(len(c.turns) for c in out),
                      new_tokens=sum(c.new_tokens for c in out), cut_kept=sum(c.cut_turns > 0 for c in out),
                      reasoning_content_dropped=sum(c.reasoning_dropped for c in out),
                      tool_calls_replaced=sum(c.tool_calls_replaced for c in out),
                      tools_not_rendered=sum(c.tools_not_rendered for c in out))
        return [c.to_line() for c in out], counts

    def _request(self, c: Conversation, t: int, alive: dict, counts: Counter) -> Request | None:
        """Assistant turn t of c for the engine, or None (the conversation is dropped, counted)."""
        ctx = self.engine.context_len
        try:
            ids = self.renderer.prompt_ids(c, c.turns[t])
            if len(ids) >= ctx:
                raise Skip("over_context", f"assistant turn {t + 1}: prompt of {len(ids)} tokens >= the "
                                           f"engine's context of {ctx}")
        except Skip as s:
            self._drop(c, alive, counts, s.reason, str(s))
            return None
        counts["prompt_tokens"] += len(ids)
        return Request(key=(c, t), prompt=ids, max_tokens=min(self.job.sampling.max_new_tokens, ctx - len(ids)),
                       seed=request_seed(self.job.sampling.seed, c.line_no, t))

    def _reply(self, r: Request, g: Generated, alive: dict, counts: Counter) -> Request | None:
        """Turn t's reply goes into the conversation; returns its next turn's request, if any."""
        c, t = r.key
        c.set_reply(c.turns[t], self.renderer.reply_text(g.ids), g.ids, g.stopped)
        c.new_tokens += len(g.ids) + g.stopped  # the end token was generated too
        self.progress.add(tokens=len(g.ids) + g.stopped, replies=1, cut=int(not g.stopped))
        counts.update(replies_generated=1, replies_cut=int(not g.stopped))
        if not g.stopped:
            c.cut_turns += 1
            if self.job.on_length == "drop":
                self._drop(c, alive, counts, "cut", f"assistant turn {t + 1} reached {len(g.ids)} tokens "
                                                    "(--max-new-tokens or the context) without ending")
                return None
        if t + 1 < len(c.turns):
            return self._request(c, t + 1, alive, counts)
        self.progress.add(conversations=1)
        return None

    def _drop(self, c: Conversation, alive: dict, counts: Counter, reason: str, message: str) -> None:
        del alive[c.line_no]
        self.skip(counts, c.line_no, reason, message)
        self.progress.add(conversations=1)


def load_tokenizer(path: str):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(path)
    if not tok.chat_template:
        raise ValueError(f"{path}: the tokenizer has no chat_template")
    return tok


def generation_config(target: str) -> dict:
    p = Path(target) / "generation_config.json"
    return json.loads(p.read_text()) if p.is_file() else {}


def summed(counts: list[dict]) -> dict:
    total: Counter = Counter()
    for c in counts:
        total.update(c)
    skipped = {r: int(total.pop(f"skipped.{r}", 0)) for r in SKIP_REASONS}
    return {**{k: int(v) for k, v in sorted(total.items())}, "skipped": skipped}


def work(job: Job, shard: Shard, stop: StopSignal, parts: Path, num_chunks: int, engine: Engine | None) -> bool:
    """This rank's unfinished chunks; False when a stop signal ended it early."""
    mine = {c for c in range(num_chunks) if c % shard.world == shard.rank and not chunks.finished(parts, c)}
    log.info("rank %d: %d of its chunks to do (%d chunks of %d lines in all)", shard.rank, len(mine), num_chunks,
             job.chunk_size)
    if not mine:
        return True
    tok = load_tokenizer(job.engine.tokenizer)
    stops = stop_token_ids(tok, generation_config(job.engine.target))
    if engine is None:
        # Slurm's --signal reaches every process of the step, the engine's own child processes too (vLLM's
        # engine core): they are started with SIGUSR2 blocked, a mask they inherit and keep, so the stop
        # request reaches this rank alone and it writes the chunk in hand. Blocked, not ignored, here: a
        # request that arrives while the engine starts is delivered when the mask is lifted.
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})
        try:
            engine = build_engine(job.engine, stops, shard.local_rank)
            stop.install()  # after the engine: nothing it starts may take the handlers over
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    stop.install()
    worker = ChunkWorker(job, engine, ChatRenderer(tok, job.enable_thinking), RankProgress(parts, shard.rank))
    for c, lines in chunks.chunk_lines(job.input, job.chunk_size, mine):
        t0 = time.monotonic()
        try:
            out, counts = worker.run(lines)
        except Exception:
            if not stop.name:
                raise
            # The signal reached the engine's own process too (a process-group signal, e.g. Ctrl-C).
            log.exception("chunk %d: the engine failed after %s; this chunk is lost and will be redone", c, stop.name)
            return False
        chunks.write_chunk(parts, c, out, dict(counts))
        worker.progress.chunk_written()
        log.info("chunk %d: %d lines -> %d conversations, %d new tokens in %.1f s", c, counts["lines"],
                 counts["conversations_out"], counts["new_tokens"], time.monotonic() - t0)
        if stop.name:
            return False
    return True


# What exits 2 (bad input: fix it, do not retry): the CLI maps these alike. A failed write (chunks.WriteError,
# an OSError) is one: the disk must be given room first.
BAD_INPUT = (ValueError, FileNotFoundError, FileExistsError, ImportError, chunks.WriteError)


def exit_code_of(exc: BaseException) -> int:
    if isinstance(exc, BAD_INPUT):
        return EXIT_BAD_INPUT
    return EXIT_PEER_LOST if isinstance(exc, PeerLost) else 1


def run(job: Job, shard: Shard, engine: Engine | None = None) -> int:
    """Exit code: 0 done (rank 0: OUTPUT written), 75 stopped by a signal with its chunks kept, 2 nothing
    usable was produced. Raises on bad input (BAD_INPUT: exit 2). Under torchrun (world > 1) the ranks
    watch each other from the start (peers.py): every rank leaves within --dead-after-s of a peer's death.
    `engine`: one already built for job.engine (the tests share one vLLM start between jobs)."""
    stop = StopSignal().install()
    peers, code, why = None, 1, ""
    try:
        if shard.world > 1:
            peers = Peers(shard.rank, shard.world, job.heartbeat_s, job.dead_after_s, join_s=max(60.0, 10 * job.dead_after_s))
        code = _run(job, shard, stop, engine, peers)
        return code
    except BaseException as exc:
        code, why = exit_code_of(exc), f"{type(exc).__name__}: {exc}"
        raise
    finally:
        if peers is not None:
            peers.leave(code, why)
        stop.restore()


def _run(job: Job, shard: Shard, stop: StopSignal, engine: Engine | None, peers: Peers | None) -> int:
    parts = chunks.parts_dir(job.output)
    # One run per --output: rank 0 holds the lock (the kernel drops it however the process ends); the other
    # ranks start only once it is taken, so a refused second run touches nothing of the first's.
    lock = RunLock(parts, what="--output") if shard.rank == 0 else None
    try:
        if lock is not None:
            with chunks.writing(parts / ".lock"):
                lock.acquire()
            key = job_key(job)
            chunks.claim(parts, key)
            if peers is not None:
                peers.go(key)
        else:
            if not peers.wait_for(GO, lambda: stop.name):
                return EXIT_RESUME
            key = peers.job_key()
            chunks.claim(parts, key)
        return _regenerate(job, shard, stop, engine, peers, parts, key)
    finally:
        if lock is not None:
            lock.release()


def _regenerate(job: Job, shard: Shard, stop: StopSignal, engine: Engine | None, peers: Peers | None,
                parts: Path, key: dict) -> int:
    total = chunks.count_lines(job.input)
    num_chunks = math.ceil(total / job.chunk_size)
    reporter = None
    if shard.rank == 0:
        before = sum(chunks.read_counts(parts, c)["lines"] for c in range(num_chunks) if chunks.finished(parts, c))
        reporter = Reporter(parts, total, before, job.progress_s).start()
    try:
        if not work(job, shard, stop, parts, num_chunks, engine):
            log.warning("stopped by %s: finished chunks are kept in %s; rerun the same command to resume", stop.name,
                        parts)
            return EXIT_RESUME
        if shard.rank != 0:  # rank 0 merges; this rank watches it until it is done
            return 0 if peers.wait_for(END, lambda: stop.name) and not peers.peer_stopped() else EXIT_RESUME
        while not all(chunks.finished(parts, c) for c in range(num_chunks)):  # the other ranks' chunks
            if stop.name or (peers is not None and peers.peer_stopped()):
                log.warning("stopped (%s) before every rank's chunks were done: finished chunks are kept in %s; "
                            "rerun the same command to resume", stop.name or "a peer stopped", parts)
                return EXIT_RESUME
            time.sleep(1.0)
    finally:
        if reporter is not None:
            log.info("%s", reporter.stop())
    meta = {"made_by": "dflash_dist.data.regenerate", "input_lines": total, **summed(
        [chunks.read_counts(parts, c) for c in range(num_chunks)]), "job": key}
    chunks.merge(parts, job.output, num_chunks, meta)
    return final_report(job, meta)


def final_report(job: Job, meta: dict) -> int:
    """The last line, with every skip counted; exit 2 when no conversation came out (nothing to train on)."""
    skipped = {k: v for k, v in meta["skipped"].items() if v}
    replies, cut = meta.get("replies_generated", 0), meta.get("replies_cut", 0)
    cut_share = f"; {cut} of {replies} generated replies reached the token limit ({100.0 * cut / replies:.1f}%)" \
        if replies else ""
    log.info("wrote %s: %d conversations from %d lines, %d new tokens; skipped %s%s", job.output,
             meta.get("conversations_out", 0), meta["input_lines"], meta.get("new_tokens", 0), skipped, cut_share)
    if meta.get("conversations_out", 0) == 0:
        hint = (" (--on-length drop: raise --max-new-tokens, or --on-length keep)"
                if skipped.get("cut") else "")
        log.error("%s holds no conversation: all %d input lines were skipped (%s)%s; nothing usable was produced",
                  job.output, meta["input_lines"], skipped, hint)
        return EXIT_BAD_INPUT
    return 0
