"""`python -m rheo_engine.info`: runs rheo_engine.entrypoints.info (kept as the short name)."""

import sys

from rheo_engine.entrypoints.info import main

if __name__ == "__main__":
    sys.exit(main())
