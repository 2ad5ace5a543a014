"""The ``masktrl`` command line: thin commands (one module each in ``masktrl/commands/``)
that load a config, call a stage (``masktrl/recipes/``) and print a rich summary.

One error boundary: a ``MasktrlError`` (bad config, missing file, unknown method, corrupted
artifact...) becomes one red line on stderr and exit code 2, and so does an ``OSError`` the
machine raises (permission denied, no space left, read-only file system, a file where a folder
belongs), named by its file, and running out of memory (``io.memory_error_line``). ``MASKTRL_DEBUG=1`` shows the
traceback instead. A run stopped by
Ctrl-C or SIGTERM exits with 128 + the signal number (130, 143); any other command stopped by
Ctrl-C prints ``interrupted`` and exits 130 (``commands/help_format.py: Group.invoke``).
"""

from __future__ import annotations

import os
import re
import sys

import typer
from typer.core import Abort, _click

from masktrl.commands import analyze as analyze_cmd
from masktrl.commands import check_method as check_method_cmd
from masktrl.commands import config as config_cmd
from masktrl.commands import eval as eval_cmd
from masktrl.commands import rollout as rollout_cmd
from masktrl.commands import runs as runs_cmd
from masktrl.commands import sweep as sweep_cmd
from masktrl.commands import train as train_cmd
from masktrl.commands.help_format import Command, Group
from masktrl.commands.ui import err_console
from masktrl.errors import MasktrlError
from masktrl.io import memory_error_line

app = typer.Typer(
    cls=Group,
    help="Trust-region masking experiments for LLM RL: rollout -> train -> evaluate -> analyze.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _root() -> None:
    """Trust-region masking experiments for LLM RL: rollout -> train -> evaluate -> analyze."""


app.command(cls=Command)(rollout_cmd.rollout)
app.command(cls=Command)(train_cmd.train)
app.add_typer(analyze_cmd.app, name="analyze")
app.add_typer(config_cmd.app, name="config")
app.command(cls=Command)(sweep_cmd.sweep)
app.command("eval", cls=Command)(eval_cmd.eval_command)
app.command("evaluate", cls=Command, hidden=True)(eval_cmd.eval_command)
app.command(cls=Command)(runs_cmd.runs)
app.command("check-method", cls=Command)(check_method_cmd.check_method)


def main() -> None:
    from masktrl.caches import contain, tidy

    contain(sys.argv[1:])  # library caches under --out, set before those libraries are imported
    try:
        _main()
    except BaseException as exc:  # _main ends in sys.exit: a refusal, a failure or a dry run keeps no --out
        failed = not (isinstance(exc, SystemExit) and exc.code in (0, None))
        if (failed or "--dry-run" in sys.argv[1:]) and os.environ.get("WORLD_SIZE", "1") == "1":
            tidy()
        raise


def _main() -> None:
    try:
        code = app(standalone_mode=False)
    except _click.exceptions.NoArgsIsHelpError as exc:  # `masktrl` alone: the help, as before
        exc.show()
        sys.exit(exc.exit_code)
    except _click.exceptions.UsageError as exc:  # an unknown flag, a missing argument: one line too
        where = exc.ctx.command_path if exc.ctx else "masktrl"
        _fail(exc, f"{exc.format_message()} (see `{where} --help`)")
    except _click.exceptions.ClickException as exc:
        _fail(exc, exc.format_message())
    except Abort:
        err_console.print("[yellow]aborted[/]")
        sys.exit(1)
    except MasktrlError as exc:
        _fail(exc, str(exc))
    except OSError as exc:  # the machine, not masktrl: name the file and the reason
        _fail(exc, os_error_line(exc))
    except Exception as exc:  # out of memory (MemoryError, torch's OutOfMemoryError, the CPU allocator): one line too
        line = memory_error_line(exc, _memory_options(sys.argv[1:]))
        if line is None:
            raise
        _fail(exc, line)
    close_process_group()
    sys.exit(code if isinstance(code, int) else 0)


def close_process_group() -> None:
    """A command that ran under a launcher (``accelerate launch``, torchrun) closes its process
    group when it ends well, as torch asks: NCCL otherwise warns at exit that
    ``destroy_process_group()`` was not called (seen on a GPU, docs/BENCHMARKS.md §4). Not after a
    failure, where another process may still wait in a collective. Nothing without torch loaded."""
    if "torch.distributed" not in sys.modules:
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _memory_options(argv: list[str]) -> str | None:
    """What to lower when a command runs out of memory, in its own options: ``eval`` has no
    training keys (None: the training keys)."""
    if argv and argv[0] in ("eval", "evaluate"):
        from masktrl.recipes.eval import MEMORY_HINT

        return MEMORY_HINT
    return None


_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")  # every control character but the tab


def _fail(exc: BaseException, line: str) -> None:
    if os.environ.get("MASKTRL_DEBUG"):
        raise exc
    from rich.markup import escape

    line = line.encode("utf-8", "backslashreplace").decode(
        "utf-8"
    )  # a name with bytes that are not UTF-8 prints as \udcff
    line = _CONTROL.sub(
        lambda m: repr(m.group())[1:-1], line
    )  # a value given with a line break stays on one line: a\nb
    err_console.print(
        f"[red]error:[/] {escape(line)}", highlight=False, soft_wrap=True
    )  # the line is text: "dppo[x]" stays
    sys.exit(2)


def os_error_line(exc: OSError) -> str:
    """``<file>: <reason>`` for an OSError (ENOSPC, EACCES, EROFS, ENOTDIR...)."""
    reason = exc.strerror or str(exc) or type(exc).__name__
    files = [f for f in (exc.filename, exc.filename2) if f]
    where = " -> ".join(str(f) for f in files)
    return f"{where}: {reason}" if where else reason


if __name__ == "__main__":
    main()
