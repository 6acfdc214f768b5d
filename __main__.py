"""python -m deepinfer {compile,run,inspect,bench} ... (the console scripts, for launchers such as torchrun)."""

import sys

from .cli import bench_main, compile_main, inspect_main, run_main

COMMANDS = {"compile": compile_main, "run": run_main, "inspect": inspect_main, "bench": bench_main}

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
        print(f"usage: python -m deepinfer {{{','.join(COMMANDS)}}} [ARGS]...", file=sys.stderr)
        sys.exit(2)
    cmd = sys.argv.pop(1)
    sys.argv[0] = f"deepinfer-{cmd}"
    COMMANDS[cmd]()
