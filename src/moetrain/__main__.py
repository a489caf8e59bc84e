"""``python -m moetrain`` (and ``torchrun -m moetrain train ...``)."""

import sys

from moetrain.cli import main

sys.exit(main())
