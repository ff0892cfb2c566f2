"""``python -m attnhub.cli``: the same as the ``attnhub`` command."""

import sys

from . import main

sys.exit(main())
