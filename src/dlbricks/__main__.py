from __future__ import annotations

import sys

from dlbricks.cli import console_main

if __name__ == "__main__":
    sys.exit(console_main())
