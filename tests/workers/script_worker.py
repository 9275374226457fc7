"""An example script's main() run in ranks forked by dist_worker.spawn, with the environment torchrun gives each of
its processes (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT): the script's own code from its argument
parsing to its verdict, without starting a fresh interpreter (and importing torch again) per rank per run. What
only a real torchrun run shows (the launcher, the exit status, the interpreter's shutdown) stays with one torchrun
run of each script (tests/test_example_train.py, tests/test_trainer.py) and tests/test_teardown.py."""

import contextlib
import importlib.util
import io
import os
import subprocess
import sys
import time
import traceback

import torch

TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                      "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def load(path):
    """The script at `path` as a module (its `if __name__ == "__main__"` block not run)."""
    name = "example_" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _main(module, path, argv):
    """module.main() with sys.argv as a command line would set it: (its status as the process's exit status would
    be, 0 for None; what it printed to stdout and stderr)."""
    sys.argv = [path, *argv]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
        try:
            status = module.main()
        except SystemExit as e:
            status = e.code
    if status is None:
        status = 0
    elif not isinstance(status, int):  # sys.exit("message"): the message printed, status 1
        printed.write(f"{status}\n")
        status = 1
    return status, printed.getvalue()


def run_main(rank, world, init, path, argv, port, results):
    """The script's main() as torchrun's process `rank` of `world` would run it (torch's threads at one, as
    torchrun's OMP_NUM_THREADS=1 sets them). Reports (rank, exit status, output) or (rank, "error", traceback)."""
    try:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                          GROUP_RANK="0", ROLE_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                          OMP_NUM_THREADS="1")
        torch.set_num_threads(1)
        status, out = _main(load(path), path, argv)
        results.put((rank, status, out))
    except Exception:
        results.put((rank, "error", traceback.format_exc()))


def run_main_with_a_fresh_process(rank, world, init, path, argv, port, requests, results):
    """run_main for a script whose rank 0 runs `sys.executable <the script> ...` in a process of its own (no torchrun
    environment) and waits for it, on world - 1 ranks: the last process spawned is that process. It waits for rank
    0's command line (a file in `requests`), checks that it runs the script itself, and runs the script's main()
    with it outside any torchrun environment; rank 0's subprocess.run waits for it and returns as subprocess.run
    would (CalledProcessError under check=True if it failed)."""
    fresh = world - 1
    ask, done = os.path.join(requests, "command"), os.path.join(requests, "status")
    try:
        if rank == fresh:
            for name in TORCHRUN_VARIABLES:
                os.environ.pop(name, None)
            torch.set_num_threads(1)
            while not os.path.exists(ask):
                time.sleep(0.05)
            with open(ask) as f:
                command = f.read().split("\0")
            status, out = ("error", f"not this script: {command}") if command[:2] != [sys.executable, path] else \
                _main(load(path), path, command[2:])
            with open(done + ".tmp", "w") as f:
                f.write(str(status))
            os.replace(done + ".tmp", done)
            results.put((rank, status, out))
            return
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(fresh),
                          LOCAL_WORLD_SIZE=str(fresh), GROUP_RANK="0", ROLE_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        torch.set_num_threads(1)
        module = load(path)

        def run(cmd, check=False, **_):
            with open(ask + ".tmp", "w") as f:
                f.write("\0".join(str(c) for c in cmd))
            os.replace(ask + ".tmp", ask)
            while not os.path.exists(done):
                time.sleep(0.05)
            with open(done) as f:
                status = f.read()
            code = int(status) if status.lstrip("-").isdigit() else 1
            if check and code != 0:
                raise subprocess.CalledProcessError(code, cmd)
            return subprocess.CompletedProcess(cmd, code)

        module.subprocess = type("FreshProcess", (), {"run": staticmethod(run)})
        try:
            status, out = _main(module, path, argv)
        finally:
            if rank == 0 and not os.path.exists(ask):  # rank 0 ended without asking: release the waiting process
                with open(ask, "w") as f:
                    f.write("")
        results.put((rank, status, out))
    except Exception:
        results.put((rank, "error", traceback.format_exc()))
