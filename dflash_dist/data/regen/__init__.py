"""Chat regeneration at scale: the target rewrites every assistant turn of a chat corpus, turn by turn.

    chat.py      parse a JSONL line, render turn k's prompt, write the reply back (same schema)
    engine.py    the engine interface; hf.py (transformers) and vllm.py (vLLM) implement it;
                 engines.py picks and builds one
    run.py       a rank's chunks, turn by turn, stop signals, the run lock of --output, rank 0's merge
    peers.py     under torchrun: the ranks' heartbeats through torchrun's store (a dead peer: exit 3)
    reaper.py    the watchdog process that kills vLLM's engine processes when their rank dies
    chunks.py    chunk files, atomic writes, resume key, merge
    progress.py  per-rank totals and rank 0's progress line
    cli.py       the command line (python -m dflash_dist.data.regenerate --input ...)

May import: data/ (prepare's skip reasons), checkpoints/, exits.py; nothing above data/.

Multi-turn and reasoning, and what the peer trainers do (their public scripts, read for facts):
  * SpecForge (scripts/regenerate_train_data.py, SGLang's chat API) regenerates turn by turn: each user
    turn is sent with the conversation so far, whose assistant turns are the target's own new replies;
    `--reasoning save` stores the reasoning apart (`reasoning_content`) and strips it from earlier turns of
    the query, `disable` passes enable_thinking=false. speculators (scripts/response_regeneration, vLLM's
    chat API) takes the first user message of each row and regenerates one reply: single turn.
  * Here: turn by turn, as SpecForge, since a drafter serves every turn of a chat and later turns' replies
    depend on the earlier ones the target itself wrote. The reply is kept as the target wrote it, reasoning
    included (`<think>...</think>` inside `content`): data.prepare reads `content`, supervises it, and can
    leave the reasoning out of the loss (--no-reasoning-loss); what an earlier turn's reasoning looks like in
    a later prompt is the chat template's decision (Qwen3 drops it), so every prompt is the text the target
    sees when it serves. --enable-thinking/--no-thinking go to the template as enable_thinking.
  * Tool use: the line's `tools` go to the template with every prompt (counted as tools_not_rendered when
    the template ignores them); tool results and weight-0 assistant turns stay as recorded; the target
    writes its own calls in its replies (chat.py).
"""
