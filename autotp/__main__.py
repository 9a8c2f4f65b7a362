"""``python -m autotp ...`` runs the ``autotp`` command."""

import sys

from autotp.cli import main

sys.exit(main())
