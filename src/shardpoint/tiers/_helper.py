"""The drain helper process: ``python -m shardpoint.tiers._helper PARENT_PID`` (a module
nothing imports, so that running it as ``__main__`` imports it once)."""

from __future__ import annotations

import sys

from .drain import main

if __name__ == "__main__":
    main(sys.argv)
