"""Stop requests (parallel.stop.StopFlag): SIGINT asks for a stop and a second one aborts; SIGTERM then
SIGINT still stops cleanly."""
import os
import signal

import pytest

from dflash_dist.parallel.stop import StopFlag


@pytest.fixture
def handlers():
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR2)}
    yield
    for s, h in saved.items():
        signal.signal(s, h)


def test_sigint_asks_for_a_stop_and_a_second_one_aborts(handlers):
    flag = StopFlag().install()
    assert flag.describe() == "stop requested by another rank"
    os.kill(os.getpid(), signal.SIGINT)
    assert flag.requested and flag.signal_name == "SIGINT"
    assert flag.describe(now=flag.requested_at + 3.14) == "SIGINT received here 3.1 s ago"
    os.kill(os.getpid(), signal.SIGTERM)  # another kind of stop request changes nothing
    assert flag.signal_name == "SIGINT"
    with pytest.raises(KeyboardInterrupt, match="second SIGINT"):
        os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_sigterm_then_sigint_still_stops_cleanly(handlers):
    flag = StopFlag().install()
    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGINT)  # the first Ctrl-C: a request, already made
    assert flag.requested and flag.signal_name == "SIGTERM" and flag.describe().startswith("SIGTERM received here")
