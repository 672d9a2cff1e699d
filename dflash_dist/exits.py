"""The process contract: what a rank's exit code means, and where each worker records its own.

launch/run.sh, slurm/job.sh and the tests read these codes; every stage (training, regeneration,
evaluation, preparation) uses the same ones:

  0   done
  2   bad config or input (the message names the key, file, line or rank): fix it, do not retry
  3   a peer died (named by the heartbeat watchdog): requeue after the node is fixed
  4   diverged (non-finite loss or gradient): resume with a lower learning rate
  75  stopped on request with its state saved (EX_TEMPFAIL): requeue and resume
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_BAD_INPUT = 2
EXIT_PEER_LOST = 3
EXIT_DIVERGED = 4  # the loss or gradient norm was not finite in train.max_nonfinite_steps steps
EXIT_RESUME = 75  # EX_TEMPFAIL: "stopped on request, state saved, requeue and resume me"

# launch/run.sh names a directory here; each worker writes its exit code there as it leaves, because
# torchrun's own exit code after a signal is 1 whatever its workers returned (75 included).
EXIT_CODE_DIR = "DFLASH_EXIT_CODE_DIR"


def record_exit_code(code: int) -> int:
    """Write `code` to $DFLASH_EXIT_CODE_DIR/local-rank-$LOCAL_RANK (when both are set); returns it.
    A worker killed by a signal writes nothing (the dead-peer watchdog writes its code before os._exit),
    which run.sh reads as a failure."""
    where, local_rank = os.environ.get(EXIT_CODE_DIR), os.environ.get("LOCAL_RANK")
    if where and local_rank is not None:
        try:
            Path(where, f"local-rank-{local_rank}").write_text(f"{code}\n")
        except OSError as exc:
            log.warning("cannot record exit code %d in %s: %s", code, where, exc)
    return code
