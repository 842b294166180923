"""``python -m mobius`` (and ``torchrun ... -m mobius train run.yaml``): the ``mobius`` command."""

import sys

from mobius.cli import main

sys.exit(main())
