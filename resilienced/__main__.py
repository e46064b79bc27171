"""``python -m resilienced``: the same as the ``resilienced`` console script."""

import sys

from resilienced.app.cli import main

sys.exit(main())
