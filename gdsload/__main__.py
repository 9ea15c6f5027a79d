"""``python -m gdsload ...`` is the ``gdsload`` command."""

import sys

from .tools.cli import main

sys.exit(main())
