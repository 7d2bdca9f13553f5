#!/usr/bin/env python3
"""``python dlicmd.py ...``: WMLA's command line for this console (see console/cli/dlicmd.py,
which is self-contained and can be copied alone; it needs only ``requests``)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from console.cli.dlicmd import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
