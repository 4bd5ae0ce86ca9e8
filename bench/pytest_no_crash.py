"""pytest, where a test that kills the process is reported and the other tests still run.

    python bench/pytest_no_crash.py PYTEST_ARGS...

A test that crashes the interpreter (a segmentation fault in a kernel, an abort) ends a pytest
run there: the tests after it never run and the summary never prints. This runs pytest -v with
the arguments given; when the run dies of a signal (or any exit status pytest itself never
uses), the test whose line has no outcome is the one that crashed: it is reported as
``CRASHED nodeid (signal or status)``, deselected, and the run starts again, until a run ends
as pytest ends. The output of every run streams through; the last run's summary comes last,
then one line naming every crashed test. Exit status: 1 when a test crashed, else pytest's.
bench/gpu_check.sh runs its CUDA tests through it.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys

PYTEST_STATUSES = {0, 1, 2, 3, 4, 5}  # pytest's own exit codes: anything else is a crash
OUTCOME = re.compile(r"\b(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b")
NODE = re.compile(r"^(\S+\.py::\S+)")
MAX_CRASHES = 20


def run(args: list[str]) -> tuple[int, str | None]:
    """One pytest run, streamed; (exit status, the nodeid last started and never finished)."""
    proc = subprocess.Popen([sys.executable, "-u", "-m", "pytest", "-v", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    open_node = None
    assert proc.stdout is not None
    for line in proc.stdout:
        sys.stdout.write(line)
        sys.stdout.flush()
        node = NODE.match(line)
        if node:
            open_node = None if OUTCOME.search(line) else node.group(1)
    return proc.wait(), open_node


def describe(status: int) -> str:
    if status < 0:
        try:
            return f"killed by {signal.Signals(-status).name}"
        except ValueError:
            return f"killed by signal {-status}"
    return f"exit status {status}"


def main(args: list[str]) -> int:
    crashed: list[str] = []
    while True:
        status, open_node = run([*args, *(f"--deselect={node}" for node in crashed)])
        if status in PYTEST_STATUSES:
            break
        if open_node is None or open_node in crashed or len(crashed) >= MAX_CRASHES:
            print(f"pytest_no_crash: pytest died ({describe(status)}) outside a test; stopping")
            return status if status > 0 else 1
        crashed.append(open_node)
        print(f"\nCRASHED {open_node} ({describe(status)}): deselected, the other tests run "
              "again", flush=True)  # fmt: skip
    if crashed:
        print(f"{len(crashed)} crashed: {' '.join(crashed)}")
        return 1
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
