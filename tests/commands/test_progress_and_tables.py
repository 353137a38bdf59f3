"""What the offline commands show while they work and what they print.

- Progress: ``avest simulate``, ``avest fleet`` and ``avest evaluate`` draw a bar
  with the rate and the time left when stderr is a terminal (a pty here, sized as
  a terminal is), and no bar without one: ``simulate`` and ``fleet`` one short
  line per stage, ``evaluate`` nothing.
- Tables: every column of every table they print (and ``avest audit``'s) lines up,
  read back from the printed text: the rule under each header has one run of
  dashes per column, and no cell leaves its column's span; each column's cells are
  flush on one side. The run includes ``--recommend``'s
  ``avest+calibration/lossless-walk@1``, longer than the policy column was.
- Plots: no legend covers its axes' data area (evaluate's two figures, simulate's
  Pareto plot, the service's reliability diagram).
"""

from __future__ import annotations

import fcntl
import os
import pty
import re
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest

from avest.offline.trace import write_trace
from tests.support.tables import assert_lined_up, tables
from tests.support.traces import make_synthetic_trace

AVEST = str(Path(sys.executable).with_name("avest"))

#: Quick runs of the three commands on the tiny trace, and how many stages each has.
RUNS = {
    "simulate": (["--costs", "a100-llama8b,l40s-llama8b", "--concurrency", "2"], 2),
    "fleet": (["--workers", "1,2", "--restart-every", "0", "--steps", "100"], 2),
    "evaluate": ([], 0),
}
RUNS["simulate"][0].extend(["--min-steps", "100"])
#: tqdm's counts, elapsed<remaining and rate: ``12/300 [00:01<00:04, 250.1step/s``.
BAR = re.compile(r"\d+/\d+ \[\d\d:\d\d<(\?|\d\d:\d\d), [\d.?]+step/s")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("trace") / "tiny.npz"
    write_trace(path, make_synthetic_trace(steps=40, requests=8, k=3))
    return path


def env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("AVEST_", "TQDM_"))}


def on_a_terminal(argv: list[str]) -> tuple[int, str]:
    """Run ``argv`` with stderr on a 120-column pty; its exit status and what it wrote there."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=follower, env=env())
    os.close(follower)
    written = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # EIO: the command closed its end
            break
        if not chunk:
            break
        written += chunk
    os.close(leader)
    return proc.wait(timeout=120), written.decode("utf-8", "replace")


@pytest.mark.parametrize("command", list(RUNS))
def test_a_bar_with_the_time_left_on_a_terminal(command: str, tiny: Path) -> None:
    flags, _ = RUNS[command]
    code, err = on_a_terminal([AVEST, command, str(tiny), *flags])
    assert code == 0, err
    assert BAR.search(err), err
    assert err.lstrip("\r").startswith(f"{command}:"), err  # the bar names the command


@pytest.mark.parametrize("command", list(RUNS))
def test_no_bar_and_a_short_line_per_stage_without_a_terminal(command: str, tiny: Path) -> None:
    flags, stages = RUNS[command]
    proc = subprocess.run(
        [AVEST, command, str(tiny), *flags], capture_output=True, text=True, env=env(), timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert "\r" not in proc.stderr and not BAR.search(proc.stderr), proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == stages, proc.stderr
    for i, line in enumerate(lines, 1):
        assert line.startswith(f"{command} {i}/{stages}: tiny.npz ") and len(line) < 80, line


# -- tables ------------------------------------------------------------------------------


def test_every_column_of_every_table_lines_up(tiny: Path) -> None:
    runs = [
        # Every policy's table and the recommendation (drafting 1..K: the @d names).
        ["simulate", str(tiny), "--costs", "a100-llama8b-parallel", "--concurrency", "2,4"]
        + ["--min-steps", "0", "--recommend", "--table"],
        # Two simulations into a pipe: the summary tables.
        ["simulate", str(tiny), "--costs", "a100-llama8b,l40s-llama8b", "--concurrency", "2,4"]
        + ["--min-steps", "0", "--recommend"],
        ["fleet", str(tiny), "--workers", "1,2", "--restart-every", "0,5", "--steps", "20"],
        ["evaluate", str(tiny)],
        ["audit", "--trials", "20"],
    ]
    printed = [
        subprocess.run([AVEST, *argv], capture_output=True, text=True, env=env(), timeout=120)
        for argv in runs
    ]
    for argv, proc in zip(runs, printed, strict=True):
        assert proc.returncode in (0, 1), (argv, proc.stderr)  # audit: 1 when a claim breaks
        found = tables(proc.stdout)
        assert found, f"{argv}: no table with a rule per column:\n{proc.stdout}"
        for spans, lines in found:
            assert len(spans) >= 5
            assert_lined_up(spans, lines)
    assert "avest+calibration/lossless-walk@1 " in printed[0].stdout
    assert "recommended num_speculative_tokens" in printed[0].stdout
    assert len(tables(printed[1].stdout)) == 4  # summary and recommendation, per profile


# -- plot legends --------------------------------------------------------------------------


def test_no_legend_covers_its_axes(tiny: Path) -> None:
    from avest.offline.evaluate import evaluate
    from avest.offline.plots import figures
    from avest.offline.reliability import figure
    from avest.offline.simulate.engine import simulate
    from avest.offline.simulate.profiles import load_profile
    from avest.offline.simulate.report import pareto_figure
    from avest.offline.trace import read_trace

    trace = read_trace(tiny)
    report = evaluate(trace, name=str(tiny))
    sim = simulate(trace, load_profile("a100-llama8b"), [2, 4], name=str(tiny))
    method = report.methods["tracking"]
    drawn = [
        *figures(report),
        ("pareto", pareto_figure(sim)),
        (
            "reliability.svg",
            figure(
                method.calibration.reliability(),
                method.summary.by_position,
                title="t <- d",
                subtitle="subtitle",
                ece=method.summary.ece,
            ),
        ),
    ]
    import matplotlib.pyplot as plt

    legends = 0
    for name, fig in drawn:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        for ax in fig.axes:
            legend = ax.get_legend()
            if legend is None:
                continue
            legends += 1
            box, data = legend.get_window_extent(renderer), ax.get_window_extent(renderer)
            assert not box.overlaps(data), (name, box, data)
            assert box.x0 >= 0 and box.y0 >= 0, (name, box)  # not cut off either
        plt.close(fig)
    assert legends == 4
