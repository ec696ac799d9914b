"""``python -m recover_hsdp.workload --replay-paper``: see :mod:`recover_hsdp.workload.replay`."""

import sys

from recover_hsdp.workload.replay import main

sys.exit(main())
