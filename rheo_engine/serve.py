"""`python -m rheo_engine.serve`: runs rheo_engine.entrypoints.serve (kept as the short name)."""

import sys

try:
    from rheo_engine.entrypoints.serve import main
except ImportError as err:  # starlette / uvicorn missing: one line, as the server says it
    if __name__ == "__main__":
        sys.exit(str(err))
    raise

if __name__ == "__main__":
    sys.exit(main())
