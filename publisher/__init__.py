"""The outbox publisher: a sidecar process that delivers committed intents to Kafka.

Run it as ``outbox-publisher``; see ``publisher.cli`` for its settings,
``publisher.app`` for how a publisher is built from them, and
``publisher.loop`` for the state machine of one batch.

Installed with the ``publisher`` extra (``pip install
'pg-kafka-outbox[publisher]'``). The library (``outbox``) ships in the same
wheel but needs none of it; without the extra, importing this package fails
at once with what to install, rather than deep inside a module.
"""

import os
import sys
from importlib.util import find_spec

#: The import names of what the publisher extra installs.
_EXTRA = ("kafka", "prometheus_client")

if _missing := [name for name in _EXTRA if find_spec(name) is None]:
    _needs = (
        f"the outbox publisher needs {', '.join(_missing)}: "
        "pip install 'pg-kafka-outbox[publisher]'"
    )
    if os.path.basename(sys.argv[0]) == "outbox-publisher":
        # The console script, installed with the library even without the extra:
        # one line and exit code 2 (a usage error), as `outbox reconcile` says
        # where it went, rather than a traceback and 1 ("some left uncertain").
        sys.stderr.write(f"outbox-publisher: {_needs}\n")
        raise SystemExit(2)
    raise ModuleNotFoundError(_needs, name=_missing[0])
