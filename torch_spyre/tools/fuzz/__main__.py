"""``python -m torch_spyre.tools.fuzz``."""

import sys

from torch_spyre.tools.fuzz.cli import main

sys.exit(main())
