"""The whole dashboard screen: panels laid out for the terminal's size (readable from 100x30).

`Dashboard(state, view)` is a rich renderable that lays itself out for the size it is given, so the
same object serves the live screen and a recording console in the tests.
"""

from __future__ import annotations

from rich.console import Console, ConsoleOptions, RenderResult
from rich.layout import Layout

from oobleck_slurm.dashboard import panels
from oobleck_slurm.dashboard.panels import NodeGrid, View
from oobleck_slurm.dashboard.state import DashboardState

HEADER_ROWS = 4
FOOTER_ROWS = 1
MIN_EVENT_ROWS = 8  # 6 lines of events, the part one reads after a failure


class Dashboard:
    def __init__(self, state: DashboardState, view: View | None = None) -> None:
        self.state = state
        self.view = view or View()

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        width = options.max_width
        height = options.height or console.height
        # Rendered here at our height: a yielded child would get the console's height back, not ours.
        lines = console.render_lines(layout(self.state, self.view, width, height),
                                     options.update_dimensions(width, height), new_lines=True)
        for line in lines:
            yield from line


def layout(state: DashboardState, view: View, width: int, height: int) -> Layout:
    """Header, nodes beside pipelines, throughput, events, footer; events take what is left."""
    nodes_width = max(30, width * 11 // 20)  # two node cells side by side at 100 columns
    pipeline_rows = 2 * len(state.pipelines) or 1
    node_rows = NodeGrid.rows_needed(list(state.nodes.values()), nodes_width - 4)
    # Taller terminals get a taller throughput chart (up to 6 rows of bars).
    throughput_rows = 4 + min(4, max(0, (height - 36) // 3))
    spare = height - HEADER_ROWS - throughput_rows - FOOTER_ROWS - MIN_EVENT_ROWS
    middle_rows = max(4, min(max(node_rows, pipeline_rows) + 2, spare))

    root = Layout()
    root.split_column(
        Layout(panels.header(state, view), name="header", size=HEADER_ROWS),
        Layout(name="middle", size=middle_rows),
        Layout(panels.throughput_panel(state), name="throughput", size=throughput_rows),
        Layout(panels.events_panel(state, view), name="events"),
        Layout(panels.footer(state, view), name="footer", size=FOOTER_ROWS),
    )
    root["middle"].split_row(
        Layout(panels.nodes_panel(state), name="nodes", size=nodes_width),
        Layout(panels.pipelines_panel(state), name="pipelines"),
    )
    return root
