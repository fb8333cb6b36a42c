"""``python -m shardpoint.cli``: the ``shardpoint`` command."""

import sys

from . import main

sys.exit(main())
