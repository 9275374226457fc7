"""The test files' shared code, importable by name from every test and every spawned rank: tests/helpers (the
references, the attention backends, the plans the distributed tests run) and tests/workers (what the spawned
ranks run; spawned children inherit this sys.path)."""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
for sub in ("helpers", "workers"):
    path = os.path.join(HERE, sub)
    if path not in sys.path:
        sys.path.insert(0, path)
