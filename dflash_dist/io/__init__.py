"""The ground floor of durable output, used by every stage that writes (checkpoints, datasets, summaries,
caches, benchmark results, exports, the report): files.py (the one atomic file write atomic_write, the
one atomic directory write AtomicDir and their temporary-name rule; file_sha256; the start-up checks of
output paths; terminate_cleanly), write_errors.py (a library's failed write as the OSError under it) and
runlock.py (one job per output directory: training's run directory, regeneration's output). files.py and
write_errors.py use the standard library only, so that the report runs on any machine.

May import: config.py (its ConfigError, for the lock's refusal).
"""
