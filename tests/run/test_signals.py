"""StopSignals: SIGTERM and a first Ctrl-C ask the loop to stop; a second Ctrl-C is the system's."""

import os
import signal

import pytest

from jaxspec.run import StopSignals


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_asks_to_stop_and_the_handlers_come_back(signum, capsys):
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    with StopSignals() as stop:
        assert not stop.requested
        os.kill(os.getpid(), signum)
        assert stop.requested and stop.name == signal.Signals(signum).name
        # after a first Ctrl-C, a second one ends the process at once (no Python handler runs)
        assert (signal.getsignal(signal.SIGINT) == signal.SIG_DFL) == (signum == signal.SIGINT)
    assert {s: signal.getsignal(s) for s in before} == before
    err = capsys.readouterr().err
    assert ("Ctrl-C again aborts at once" in err) == (signum == signal.SIGINT)
