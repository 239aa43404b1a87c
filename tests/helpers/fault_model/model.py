"""Test-only python-backend model: our backend with a fault-injection hook on the engine.

A test copies this file to a model's `1/model.py` and sets `backend: "python"` (see
`tests/helpers/faults.py`). Each engine step first looks for `<model dir>/fault_trigger`;
when the file exists it is removed (one shot, so a recovered model serves normally) and
its content picks the fault:
  crash     the step raises
  stall     the step blocks forever with the GIL released (a deadlock, a hung kernel)
  hang_gil  the step blocks forever holding the GIL (a native call that never returns):
            no thread of the process runs again, the in-process watchdog included
"""

import ctypes
import os
import threading

from backend.triton_server.model import TritonPythonModel as _Backend


class TritonPythonModel(_Backend):
    def initialize(self, args):
        super().initialize(args)
        trigger = os.path.join(args["model_repository"], "fault_trigger")
        real_step = self.engine.core_step

        def step():
            if os.path.exists(trigger):
                with open(trigger) as f:
                    fault = f.read().strip()
                os.remove(trigger)
                if fault == "crash":
                    raise RuntimeError("injected fault: crash")
                if fault == "stall":
                    threading.Event().wait()
                if fault == "hang_gil":
                    ctypes.PyDLL(None).sleep(3600)  # PyDLL keeps the GIL during the call
            return real_step()

        self.engine.core_step = step
