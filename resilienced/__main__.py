"""``python -m resilienced``: the same as the ``resilienced`` console script."""

import sys

from resilienced.cli import main

sys.exit(main())
