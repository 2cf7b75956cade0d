"""``python -m triflash.bench``: the same as the ``triflash bench`` console script."""

import sys

from .cli import main

sys.exit(main())
