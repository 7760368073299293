"""``python -m publisher`` runs the publisher like the ``outbox-publisher`` script."""

import sys

from publisher.cli import main

sys.exit(main())
