"""Progress bars for the submitter's long steps (profiling layers, generating templates).

    with progress_task("profiling layers", total=len(layers)) as update:
        for i, layer in enumerate(layers):
            profile(layer)
            update(i + 1, note=f"layer {i}")

On a terminal it draws a rich bar (with elapsed and remaining time) that disappears when done,
leaving one summary line; elsewhere (logs, CI) it prints only the summary line, so logs stay short.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

Update = Callable[..., None]


@contextmanager
def progress_task(
    description: str,
    total: int | None = None,
    *,
    console: Console | None = None,
    enabled: bool | None = None,
) -> Iterator[Update]:
    """Yield `update(done, total=None, note=None)`: set progress to `done` (absolute, not a delta).

    `total` may be unknown at first and given later through `update`. enabled=None shows the bar
    only when the console is a terminal.
    """
    console = console or Console(stderr=True)
    show_bar = console.is_terminal if enabled is None else enabled
    started = time.monotonic()
    last = {"done": 0, "total": total}

    if not show_bar:
        def update(done: int, total: int | None = None, note: str | None = None) -> None:
            last["done"] = done
            if total is not None:
                last["total"] = total

        yield update
        console.print(_summary(description, last["done"], last["total"], time.monotonic() - started), highlight=False)
        return

    progress = Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
        TextColumn("[dim]{task.fields[note]}"), TimeElapsedColumn(), TimeRemainingColumn(),
        console=console, transient=True,
    )
    with progress:
        task = progress.add_task(description, total=total, note="")

        def update(done: int, total: int | None = None, note: str | None = None) -> None:
            last["done"] = done
            fields = {"completed": done}
            if total is not None:
                last["total"] = total
                fields["total"] = total
            if note is not None:
                fields["note"] = note
            progress.update(task, **fields)

        yield update
    console.print(_summary(description, last["done"], last["total"], time.monotonic() - started), highlight=False)


def _summary(description: str, done: int, total: int | None, seconds: float) -> str:
    count = f"{done}/{total}" if total is not None else f"{done}"
    return f"[green]✓[/] {description}: {count} in {seconds:.1f}s"
