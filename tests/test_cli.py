"""The `moet` command line as a user's shell runs it: a real subprocess and a real pipe."""

import subprocess
import sys
from pathlib import Path


def test_a_closed_pipe_ends_quietly():
    """`moet plan MODEL | true`: the reader is gone before moet writes; moet exits 141 (SIGPIPE's code, as
    coreutils) with no traceback, instead of a BrokenPipeError stack on stderr."""
    model = Path(__file__).resolve().parent.parent / "moet" / "models" / "default"
    proc = subprocess.Popen([sys.executable, "-m", "moet.cli", "plan", str(model)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()  # moet is still importing (~1 s): every write it makes hits a pipe with no reader
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141, err
    assert "Traceback" not in err and "BrokenPipe" not in err, err
