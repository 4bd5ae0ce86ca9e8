"""`python -m rheo_engine.chat`: runs rheo_engine.entrypoints.chat (the short name)."""

import os
import signal
import sys

if __name__ == "__main__":
    # Ctrl-C while torch and the engine import: exit 130 with one line, not a traceback.
    signal.signal(signal.SIGINT, lambda *_: (os.write(2, b"interrupted while starting\n"),
                                             os._exit(130)))  # fmt: skip

from rheo_engine.entrypoints.chat import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
