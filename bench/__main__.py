"""``python -m bench``: see bench.main."""

import sys

from bench import main

sys.exit(main())
