"""python -m dflash_dist.data.regenerate: the target writes the training replies itself.

Two inputs, one command:
  * a chat JSONL (`--input chats.jsonl --target DIR --output out.jsonl`): every assistant turn is
    replaced by the target's reply, turn by turn, through vLLM or transformers (dflash_dist.data.regen);
  * the default job's token corpus (`--out DIR [--config FILE]`): dflash_dist.data.target_corpus.
`--help` shows the chat options; `--out x --help` the token corpus's.
"""
from __future__ import annotations

import sys


def main(argv=None) -> int:
    given = sys.argv[1:] if argv is None else list(argv)
    if any(a == "--out" or a.startswith("--out=") for a in given):
        from dflash_dist.data.target_corpus import main as corpus_main
        return corpus_main(given)
    from dflash_dist.data.regen.cli import main as chat_main
    return chat_main(given)


if __name__ == "__main__":
    sys.exit(main())
