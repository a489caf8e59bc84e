"""``python -m moetrain.plan [plan|bench] ...`` (the same commands as ``moetrain plan`` / ``moetrain bench``)."""

import sys

from moetrain.plan.cli import main

sys.exit(main())
