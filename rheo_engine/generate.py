"""`python -m rheo_engine.generate`: runs rheo_engine.entrypoints.generate (kept as the short
name)."""

import os
import signal
import sys

if __name__ == "__main__":
    # Ctrl-C while torch and the engine import (a second or two): exit 130 with one line, as
    # later, not with an import traceback. main() puts Python's handler back.
    signal.signal(signal.SIGINT, lambda *_: (os.write(2, b"interrupted while starting\n"),
                                             os._exit(130)))  # fmt: skip

from rheo_engine.entrypoints.generate import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
