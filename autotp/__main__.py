"""``python -m autotp ...`` runs the ``autotp`` command."""

import sys

from autotp.tools.cli import main

sys.exit(main())
