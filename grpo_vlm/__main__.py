"""`python -m grpo_vlm` (and `torchrun ... -m grpo_vlm`): the full trainer's command line."""

import os
import signal
import sys
import traceback

if __name__ == "__main__":  # NOTE: a Ctrl-C while torch imports (~2 s) exits 130, with no traceback
    signal.signal(signal.SIGINT, lambda signum, frame: os._exit(130))

from grpo_vlm import cli, distributed, trainer

if __name__ == "__main__":
    try:
        command = lambda argv: trainer.main(trainer.command_line(argv), trainer.typed_flags(argv), argv)
        cli.run(command, sys.argv[1:])
    except SystemExit as e:
        code = e.code
    except Exception:  # noqa: BLE001 (a bug: its traceback, exit 1, as Python would)
        traceback.print_exc()
        code = cli.EXIT_INTERNAL
    finally:
        distributed.finish_distributed()  # torchrun: destroy the process group, after a stop too
    cli.exit_process(code)  # NOTE: never waits for a thread a plug-in left running
