"""The machine line every benchmark result file starts with."""

import os
import platform
import subprocess


def machine():
    """CPU model (from lscpu when available) and core count."""
    model = platform.processor() or "unknown"
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores"
