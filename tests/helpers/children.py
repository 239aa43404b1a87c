"""Real child processes for the supervisor's tests."""

from __future__ import annotations

import subprocess
import sys
import time

from supervisor.processes import _cmdline


def sleeping_child(*argv: str) -> subprocess.Popen:
    """A python child sleeping for a minute, with extra argv words (an instance name in
    its cmdline); returned once it shows them (right after fork the cmdline is still its
    parent's)."""
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", *argv])
    for _ in range(100):
        if not argv or argv[-1] in _cmdline(p.pid):
            break
        time.sleep(0.02)
    return p
