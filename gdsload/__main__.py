"""``python -m gdsload ...`` is the ``gdsload`` command."""

import sys

from .cli import main

sys.exit(main())
