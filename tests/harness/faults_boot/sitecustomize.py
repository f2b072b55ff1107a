"""Start-up hook of scenario processes that asked for faults (see ``process_faults``).

Python imports ``sitecustomize`` from ``PYTHONPATH`` at start-up and only reports an exception
raised here; a fault that failed to apply must stop the process instead, or its test would run
without it."""

import os
import sys
import traceback

try:
    from tests.harness.process_faults import apply_from_env

    apply_from_env()
except BaseException:  # noqa: BLE001 - any failure here means the scenario runs without its fault
    traceback.print_exc()
    sys.stderr.write("himamba test faults: could not apply HIMAMBA_TEST_FAULTS; stopping\n")
    sys.stderr.flush()
    os._exit(70)
